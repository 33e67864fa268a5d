"""Readers for the plain corpora the project uses directly (demo, analysis, evaluation), one place per format:
LAMBADA and other JSONL, WikiText (articles at ` = Title = ` lines), plain text (blank-line separated paragraphs),
and the `--data FORMAT:FILE` spec that names one of them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from megatron_jreg.errors import UsageError
from megatron_jreg.fileio import JsonlError, read_jsonl

_WIKITEXT_TITLE = re.compile(r"^(?= = [^=].* = $)", re.MULTILINE)  # split before each title line
DEFAULT_LAMBADA = Path(__file__).resolve().parent.parent / "resources" / "lambada_test.jsonl"
DATA_FORMATS = ("lambada", "wikitext", "jsonl", "text")


def iter_jsonl(path: str | Path, key: str = "text") -> Iterator[str]:
    """Yield the `key` field of each JSON line; a line without it raises "<file>:<line>: cannot read key ...",
    the wording `read_samples` passes on."""
    try:
        for line, record in read_jsonl(path):
            if key not in record:
                raise JsonlError(Path(path), line, f"has no {key!r} (keys: {sorted(record)[:8]})")
            yield str(record[key])
    except JsonlError as e:
        raise ValueError(f"{e.path}:{e.line}: cannot read key {key!r}: {e.reason}") from None


def lambada_passages(path: str | Path = DEFAULT_LAMBADA) -> list[str]:
    """Full LAMBADA passages (the target word is the last whitespace-separated word)."""
    return list(iter_jsonl(path, "text"))


def wikitext_articles(path: str | Path) -> list[str]:
    """Split a WikiText file into articles at its top-level ` = Title = ` lines."""
    articles = _WIKITEXT_TITLE.split(Path(path).read_text(encoding="utf-8"))
    return [t.strip() for t in articles if t.strip()]


def text_paragraphs(path: str | Path) -> list[str]:
    """Blank-line separated paragraphs of a plain text file."""
    content = Path(path).read_text(encoding="utf-8")
    return [p.strip() for p in re.split(r"\n\s*\n", content) if p.strip()]


def parse_data_spec(spec: str) -> tuple[str, Path, str | None]:
    """`--data` → (format, file, jsonl key). `lambada` alone is the vendored LAMBADA test set."""
    fmt, _, rest = spec.partition(":")
    if fmt not in DATA_FORMATS:
        raise UsageError(f"--data {spec!r}: format must be one of {DATA_FORMATS}, e.g. --data lambada:FILE")
    if fmt == "lambada" and not rest:
        return fmt, DEFAULT_LAMBADA, None
    key = None
    if fmt == "jsonl":
        rest, sep, key = rest.rpartition(":")
        if not sep or not key or not rest:
            raise UsageError(f"--data {spec!r}: jsonl needs a key, e.g. --data jsonl:data.jsonl:text")
    if not rest:
        raise UsageError(f"--data {spec!r}: give a file, e.g. --data {fmt}:FILE")
    path = Path(rest)
    if not path.is_file():
        raise UsageError(f"--data {spec!r}: no such file {path}; pass an existing file")
    return fmt, path, key


def read_samples(spec: str, limit: int | None) -> list[str]:
    """The first `limit` non-empty samples of `--data` (all when None), in file order."""
    fmt, path, key = parse_data_spec(spec)
    read = {"lambada": lambada_passages, "wikitext": wikitext_articles, "text": text_paragraphs,
            "jsonl": lambda p: list(iter_jsonl(p, key or "text"))}[fmt]
    try:
        texts = read(path)
    except UnicodeDecodeError as e:
        raise UsageError(
            f"--data {spec!r}: {path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8"
        ) from None
    except ValueError as e:  # iter_jsonl: "<file>:<line>: cannot read key ..."
        raise UsageError(f"--data {spec!r}: {e}; fix or drop that line") from None
    texts = [t for t in texts if t.strip()][:limit]
    if not texts:
        raise UsageError(f"--data {spec!r}: no non-empty samples in {path}; pass a file that holds text")
    return texts
