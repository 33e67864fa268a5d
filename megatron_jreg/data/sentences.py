"""Sentence splitting for `--split-sentences` with nltk's Punkt, without any download.

Cluster nodes have no internet, so nltk's downloader is never used. The Punkt parameters come
from, in order: `--punkt-model` (a `punkt_tab/<lang>` folder), nltk's data path (NLTK_DATA, ~/nltk_data;
looked up, not fetched), or Punkt training on the first `--punkt-train-chars` characters of the input.
The source is reported in the summary and the manifests; trained parameters are saved in punkt_tab format
so a later run can pass them back with `--punkt-model`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from nltk.tokenize.punkt import PunktLanguageVars, PunktParameters, PunktSentenceTokenizer, PunktTrainer

# Megatron-LM splits very long documents in 1,000,000-character pieces before Punkt sees them.
MAX_SPLIT_CHARS = 1_000_000
_TAB_FILES = ("abbrev_types.txt", "collocations.tab", "sent_starters.txt", "ortho_context.tab")


class _KeepNewlinesVars(PunktLanguageVars):
    """Punkt language variables whose sentence end also takes the whitespace after it (--keep-newlines).

    Stock Punkt drops the whitespace between sentences; keeping it with the preceding sentence keeps
    paragraph breaks in the token stream.
    """

    _period_context_fmt = r"""
        \S*                          # word material before the candidate end
        %(SentEndChars)s             # the candidate sentence end
        \s*                          # whitespace stays with this sentence (stock Punkt: \s+, dropped)
        (?=(?P<after_tok>
            %(NonWord)s              # punctuation follows
            |
            (?P<next_tok>\S+)        # or the next word
        ))"""


def load_punkt_tab(folder: str | Path) -> PunktParameters:
    """Read Punkt parameters in nltk's punkt_tab format (the files of `punkt_tab/<lang>/`)."""
    folder = Path(folder)
    missing = [name for name in _TAB_FILES if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"--punkt-model {folder}: not a punkt_tab language folder (missing {', '.join(missing)}); "
            "pass e.g. nltk_data/tokenizers/punkt_tab/english"
        )

    def lines(name: str) -> list[str]:
        return [ln for ln in (folder / name).read_text(encoding="utf-8").split("\n") if ln]

    params = PunktParameters()
    params.abbrev_types = set(lines("abbrev_types.txt"))
    params.sent_starters = set(lines("sent_starters.txt"))
    params.collocations = {tuple(ln.split("\t")[:2]) for ln in lines("collocations.tab")}
    for ln in lines("ortho_context.tab"):
        word, flags = ln.rsplit("\t", 1)
        params.ortho_context[word] = int(flags)
    return params


def save_punkt_tab(params: PunktParameters, folder: str | Path) -> Path:
    """Write Punkt parameters as punkt_tab files (readable by nltk and by `load_punkt_tab`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    contents = {
        "abbrev_types.txt": sorted(params.abbrev_types),
        "sent_starters.txt": sorted(params.sent_starters),
        "collocations.tab": sorted("\t".join(pair) for pair in params.collocations),
        "ortho_context.tab": sorted(f"{w}\t{f}" for w, f in params.ortho_context.items()),
    }
    for name, rows in contents.items():
        (folder / name).write_text("".join(f"{r}\n" for r in rows), encoding="utf-8", newline="")
    return folder


def train_punkt(texts: Iterable[str], max_chars: int) -> tuple[PunktParameters, int]:
    """Unsupervised Punkt training on up to `max_chars` characters; returns (parameters, chars used)."""
    trainer = PunktTrainer()
    used = 0
    for text in texts:
        piece = text[: max_chars - used]
        trainer.train(piece, finalize=False)
        used += len(piece)
        if used >= max_chars:
            break
    trainer.finalize_training()
    return trainer.get_params(), used


def find_punkt(punkt_model: str | None, lang: str) -> tuple[PunktParameters, str] | None:
    """Punkt parameters from `--punkt-model` or nltk's local data path, with a description; None if absent."""
    if punkt_model:
        path = Path(punkt_model)
        if path.suffix == ".pickle":
            raise ValueError(
                f"--punkt-model {path}: pickled Punkt models are refused (unsafe to load, and nltk >= 3.9 no "
                "longer reads them); pass a punkt_tab folder such as nltk_data/tokenizers/punkt_tab/english"
            )
        folder = path / "tokenizers" / "punkt_tab" / lang if (path / "tokenizers").is_dir() else path
        return load_punkt_tab(folder), f"punkt_tab {folder}"
    import nltk.data

    try:
        folder = Path(nltk.data.find(f"tokenizers/punkt_tab/{lang}/"))
    except LookupError:
        return None
    return load_punkt_tab(folder), f"punkt_tab {folder} (nltk data path)"


class SentenceSplitter:
    """Punkt sentence splitting of one document, Megatron-LM style (1M-character pieces, then Punkt)."""

    def __init__(self, params: PunktParameters, keep_newlines: bool = False) -> None:
        lang_vars = _KeepNewlinesVars() if keep_newlines else PunktLanguageVars()
        self._punkt = PunktSentenceTokenizer(params, lang_vars=lang_vars)

    def split(self, text: str) -> list[str]:
        return [
            sentence
            for start in range(0, len(text), MAX_SPLIT_CHARS)
            for sentence in self._punkt.tokenize(text[start : start + MAX_SPLIT_CHARS])
        ]
