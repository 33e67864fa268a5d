"""Tokenizers selected by Megatron-LM's `--tokenizer-type` names, with Megatron-LM's conventions.

Conventions (what `megatron.core.tokenizers` does, so datasets are interchangeable with Megatron-LM's):

    type                     ids of a text                              eod                    vocab_size
    SentencePieceTokenizer   sp.encode(text) (no BOS/EOS)               sp.eos_id()            piece count
    HuggingFaceTokenizer     tokenizer(text).input_ids (post-processor   eos_token (else        len(tokenizer)
                             template applied, e.g. a BOS)              sep_token)
    GPT2BPETokenizer         byte-level BPE from vocab.json+merges.txt  <|endoftext|>          len(vocab)
    TikTokenizer (.json)     Megatron's tiktoken vocab, ids shifted by  </s> = 2               --vocab-size
                             --tiktoken-num-special-tokens
    TikTokenizer (.tiktoken) an OpenAI encoding file on disk            <|endoftext|>          n_vocab
    NullTokenizer            the text itself: "17 4 99" -> [17, 4, 99]   vocab_size - 1         --vocab-size

Megatron-LM's tokenizer options that change ids are honoured the same way: `special_tokens`
(--tokenizer-special-tokens: added special tokens for HF/GPT-2, the special list of TikTokenizer, legacy
special tokens of SentencePiece), `include_special_tokens=False` (--tokenizer-hf-no-include-special-tokens:
no post-processor ids such as a BOS), `sentencepiece_legacy` and `sentencepiece_ignore_extra_whitespaces`.

Special-token text inside a document (e.g. a literal "<|endoftext|>") becomes the special id, as it does
in Megatron-LM. Byte-level BPE tokenizers (GPT-2 style, also Llama-3 style `Split`+`ByteLevel`) run on
tiktoken's BPE engine when their tokenizer.json converts exactly; that is ~5x faster than the `tokenizers`
library and gives the same ids (checked at load on a probe text, and in the tests against megatron-core's
own tokenizer). Anything else falls back to the `tokenizers` library.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

SP_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TOKENIZER_TYPES = (*SP_TYPES, "HuggingFaceTokenizer", "GPT2BPETokenizer", "TikTokenizer", "NullTokenizer")
# Megatron-LM's other --tokenizer-type names, and why megatron-jreg refuses them.
REFUSED_TYPES = {
    "BertWordPieceLowerCase": "a BERT WordPiece tokenizer for BERT/T5 models, which megatron-jreg does not train "
    "(Megatron-LM also fetches bert-large-uncased's config from the Hub for it); for a BERT tokenizer saved "
    "with save_pretrained use --tokenizer-type HuggingFaceTokenizer",
    "BertWordPieceCase": "a BERT WordPiece tokenizer for BERT/T5 models, which megatron-jreg does not train "
    "(Megatron-LM also fetches bert-large-cased's config from the Hub for it); for a BERT tokenizer saved "
    "with save_pretrained use --tokenizer-type HuggingFaceTokenizer",
    "MultimodalTokenizer": "needs --tokenizer-prompt-format and image options that Megatron-LM's "
    "tools/preprocess_data.py does not have either (it fails there); text data needs a text tokenizer",
    "NullMultimodalTokenizer": "serves multimodal (LLaVA) training, which megatron-jreg does not run; for "
    "pre-tokenized text use --tokenizer-type NullTokenizer",
    "SFTTokenizer": "needs --sft-tokenizer-prompt-format, which Megatron-LM's tools/preprocess_data.py does "
    "not have either (it fails there); pretraining text needs a text tokenizer",
}
MEGATRON_TOKENIZER_TYPES = (*TOKENIZER_TYPES, *REFUSED_TYPES)

# GPT-2's pre-tokenizer regex, as the `tokenizers` ByteLevel pre-tokenizer applies it with use_regex=True.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Megatron-LM's TikTokenizer patterns (`--tiktoken-pattern v1|v2`).
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
MEGATRON_TIKTOKEN_SPECIALS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]
SP_EXTRA_SPACE = "☯"  # Megatron-LM's marker for runs of spaces a SentencePiece model would collapse
ENDOFTEXT = "<|endoftext|>"
PROBE_TEXT = (
    "Hello world! It's 3.14159 o'clock; they'll  say \"naïve café\" — 東京 😀\n\n\tTabs   and"
    " spaces  \n x=y+1; don't I'VE 1234567 ｆｕｌｌ <tag> ... ?!"
)


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the training CLI need from a tokenizer."""

    identity: dict  # {"type", "model", "sha256", "vocab_size", "eod"} for manifests
    vocab_size: int  # true vocabulary size (before padding for tensor parallelism)
    eod: int | None  # end-of-document id appended with --append-eod
    pad: int | None

    def tokenize(self, text: str) -> list[int]: ...

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]: ...

    def detokenize(self, ids: list[int]) -> str: ...


def file_sha256(*paths: str | Path) -> str:
    """sha256 over the bytes of the given files, in order (a tokenizer's identity in manifests)."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to code points 256+.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    mapping = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in mapping)
    mapping.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return mapping


@dataclass
class _TiktokenPlan:
    """How to run a byte-level BPE tokenizer.json on tiktoken: encoding + ids the post-processor adds."""

    pat_str: str
    ranks: dict[bytes, int]
    specials: dict[str, int]
    prefix: list[int] = field(default_factory=list)
    suffix: list[int] = field(default_factory=list)


def _template_ids(processor: dict | None) -> tuple[list[int], list[int]] | str:
    """Ids a post-processor puts before/after a single sequence, or the reason it cannot be mirrored."""
    if processor is None or processor.get("type") == "ByteLevel":
        return [], []
    if processor.get("type") == "Sequence":
        prefix: list[int] = []
        suffix: list[int] = []
        for sub in processor.get("processors", []):
            got = _template_ids(sub)
            if isinstance(got, str):
                return got
            prefix, suffix = prefix + got[0], got[1] + suffix
        return prefix, suffix
    if processor.get("type") != "TemplateProcessing":
        return f"post-processor {processor.get('type')}"
    prefix, suffix, seen = [], [], False
    for piece in processor["single"]:
        if "Sequence" in piece:
            seen = True
            continue
        ids = processor["special_tokens"][piece["SpecialToken"]["id"]]["ids"]
        (suffix if seen else prefix).extend(ids)
    return prefix, suffix


def _plan_tiktoken(spec: dict) -> _TiktokenPlan | str:
    """Convert a tokenizer.json (as a dict) to a tiktoken plan, or return why it cannot be exact."""
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        return f"model type {model.get('type')}"
    if model.get("dropout") or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return "BPE dropout or subword prefix/suffix"
    if spec.get("normalizer") is not None:
        return "a normalizer"
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        pattern = GPT2_PATTERN
    elif pre.get("type") == "Sequence" and [p.get("type") for p in pre["pretokenizers"]] == [
        "Split",
        "ByteLevel",
    ]:
        split, byte_level = pre["pretokenizers"]
        if (
            split.get("behavior") != "Isolated"
            or split.get("invert")
            or "Regex" not in split.get("pattern", {})
            or byte_level.get("use_regex")
            or byte_level.get("add_prefix_space")
        ):
            return "an unsupported Split/ByteLevel pre-tokenizer"
        pattern = split["pattern"]["Regex"]
    else:
        return f"pre-tokenizer {pre.get('type')}"
    template = _template_ids(spec.get("post_processor"))
    if isinstance(template, str):
        return template
    added = spec.get("added_tokens", [])
    if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added):
        return "added tokens with lstrip/rstrip/single_word"
    specials = {t["content"]: t["id"] for t in added}
    to_byte = {c: b for b, c in _byte_to_unicode().items()}
    vocab: dict[str, int] = model["vocab"]
    try:
        ranks = {bytes(to_byte[c] for c in piece): i for piece, i in vocab.items() if piece not in specials}
    except KeyError:
        return "vocabulary entries outside the byte-level alphabet"
    if len(ranks) != len(vocab) - sum(p in vocab for p in specials) or not all(
        bytes([b]) in ranks for b in range(256)
    ):
        return "a vocabulary without all 256 bytes or with duplicate pieces"
    merged = ["".join(m) if isinstance(m, list) else m.replace(" ", "", 1) for m in model.get("merges", [])]
    ids = [vocab.get(m, -1) for m in merged]
    if any(i < 0 for i in ids) or any(a >= b for a, b in zip(ids, ids[1:])):
        return "merges whose results are missing or not in increasing id order"
    multi = {p for p in vocab if len(p) > 1 and p not in specials}
    if multi != set(merged):
        return "vocabulary pieces not produced by any merge"
    # Longest special first: tiktoken matches specials leftmost-first, `tokenizers` leftmost-longest.
    specials = dict(sorted(specials.items(), key=lambda kv: -len(kv[0])))
    return _TiktokenPlan(pattern, ranks, specials, *template)


class _TiktokenEngine:
    """tiktoken encoding + optional post-processor ids; `allowed_special` makes special text special."""

    def __init__(self, name: str, plan: _TiktokenPlan, threads: int) -> None:
        import tiktoken

        self.encoding = tiktoken.Encoding(
            name, pat_str=plan.pat_str, mergeable_ranks=plan.ranks, special_tokens=plan.specials
        )
        self.allowed = frozenset(plan.specials)
        self.prefix, self.suffix = plan.prefix, plan.suffix
        self.threads = threads

    def encode(self, text: str) -> list[int]:
        ids = self.encoding.encode(text, allowed_special=self.allowed, disallowed_special=())
        return self.prefix + ids + self.suffix if self.prefix or self.suffix else ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self.threads == 1:  # tiktoken's batch call runs a thread pool: ~20% slower on one thread
            out = [
                self.encoding.encode(t, allowed_special=self.allowed, disallowed_special=()) for t in texts
            ]
        else:
            out = self.encoding.encode_batch(
                texts, num_threads=self.threads, allowed_special=self.allowed, disallowed_special=()
            )
        if self.prefix or self.suffix:
            out = [self.prefix + ids + self.suffix for ids in out]
        return out

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)


def _special_token(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


class HuggingFaceTokenizer:
    """A Hugging Face fast tokenizer (a folder with tokenizer.json), Megatron-LM's `HuggingFaceTokenizer`."""

    type_name = "HuggingFaceTokenizer"

    def __init__(
        self,
        model: str | Path,
        threads: int = 1,
        *,
        special_tokens: list[str] | None = None,
        include_special_tokens: bool = True,
    ) -> None:
        path = Path(model)
        json_path = path / "tokenizer.json" if path.is_dir() else path
        if not json_path.is_file():
            raise FileNotFoundError(
                f"--tokenizer-model {model}: no tokenizer.json there. HuggingFaceTokenizer needs a local "
                "folder saved by a fast tokenizer: AutoTokenizer.from_pretrained(...).save_pretrained(folder)"
            )
        config = tokenizer_config(json_path.parent)
        eos = _special_token(config.get("eos_token")) or _special_token(config.get("sep_token"))
        # transformers' split_special_tokens (AutoTokenizer, so Megatron-LM's HuggingFaceTokenizer, honours it):
        # special-token text in a document stays text, as SentencePiece leaves a literal "</s>"
        split = config.get("split_special_tokens") is True
        try:
            text = json_path.read_text(encoding="utf-8")
            self._setup(
                text, eos, _special_token(config.get("pad_token")), threads, special_tokens, include_special_tokens,
                split,
            )
        except Exception as e:  # not UTF-8, not JSON, or rejected by the `tokenizers` library
            raise ValueError(
                f"--tokenizer-model {json_path}: not a Hugging Face tokenizer.json ({type(e).__name__}: "
                f"{str(e)[:200]}); for a SentencePiece .model use --tokenizer-type SentencePieceTokenizer"
            ) from None
        self.identity = {
            "type": self.type_name,
            "model": str(path.resolve()),
            "sha256": file_sha256(json_path),
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            **_options_identity(special_tokens=special_tokens, include_special_tokens=include_special_tokens),
            **({"split_special_tokens": True} if split else {}),
        }

    def _setup(
        self,
        tokenizer_json: str,
        eos: str | None,
        pad: str | None,
        threads: int,
        special_tokens: list[str] | None = None,
        include_special_tokens: bool = True,
        split_special_tokens: bool = False,
    ) -> None:
        """The `tokenizers` object and, when it converts exactly, the tiktoken engine.

        `special_tokens` are added as transformers' `add_special_tokens` adds them (new ones get the next
        ids); without `include_special_tokens` the post-processor's ids (e.g. a BOS) are left out;
        `split_special_tokens` encodes special-token text as text (transformers' option of that name).
        """
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as HFTokenizer

        self._hf = HFTokenizer.from_str(tokenizer_json)
        if special_tokens:
            self._hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
            tokenizer_json = self._hf.to_str()
        self._hf.encode_special_tokens = split_special_tokens
        self._with_specials = include_special_tokens
        self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
        self.eod = self._hf.token_to_id(eos) if eos else None
        self.pad = self._hf.token_to_id(pad) if pad else None
        plan = _plan_tiktoken(json.loads(tokenizer_json))
        self.engine: _TiktokenEngine | None = None
        self.backend = (
            f"tokenizers (no exact tiktoken conversion: {plan})" if isinstance(plan, str) else "tiktoken"
        )
        if split_special_tokens and not isinstance(plan, str):
            plan, self.backend = "split_special_tokens", "tokenizers (split_special_tokens: tiktoken not used)"
        if not isinstance(plan, str):
            if not include_special_tokens:
                plan.prefix, plan.suffix = [], []
            engine = _TiktokenEngine(self.type_name, plan, threads)
            if engine.encode(PROBE_TEXT) == self._hf.encode(PROBE_TEXT, add_special_tokens=include_special_tokens).ids:
                self.engine = engine
            else:
                self.backend = "tokenizers (tiktoken conversion disagreed on the probe text)"

    def tokenize(self, text: str) -> list[int]:
        if self.engine:
            return self.engine.encode(text)
        return self._hf.encode(text, add_special_tokens=self._with_specials).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        if self.engine:
            return self.engine.encode_batch(texts)
        return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=self._with_specials)]

    def detokenize(self, ids: list[int]) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=False)

    def backend_tokenizer(self) -> Any:
        """A copy of the `tokenizers.Tokenizer` that defines the ids (special tokens added; without its
        post-processor when the run leaves the post-processor's ids out), for an export."""
        from tokenizers import Tokenizer as HFTokenizer

        copy = HFTokenizer.from_str(self._hf.to_str())
        if not self._with_specials:
            copy.post_processor = None
        return copy


class GPT2BPETokenizer(HuggingFaceTokenizer):
    """GPT-2 byte-level BPE from `--vocab-file vocab.json --merge-file merges.txt`; eod = <|endoftext|>."""

    type_name = "GPT2BPETokenizer"

    def __init__(
        self,
        vocab_file: str | Path,
        merge_file: str | Path,
        threads: int = 1,
        *,
        special_tokens: list[str] | None = None,
        include_special_tokens: bool = True,
    ) -> None:
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        for flag, value in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not value or not Path(value).is_file():
                raise FileNotFoundError(
                    f"GPT2BPETokenizer needs {flag} (GPT-2 vocab.json / merges.txt); got {value!r}"
                )
        try:
            hf = HFTokenizer(models.BPE.from_file(str(vocab_file), str(merge_file)))
        except Exception as e:  # the `tokenizers` library raises its own exception type
            raise ValueError(
                f"--vocab-file {vocab_file} / --merge-file {merge_file}: not a GPT-2 vocab.json and merges.txt "
                f"({str(e)[:200]})"
            ) from None
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        if hf.token_to_id(ENDOFTEXT) is None:
            raise ValueError(
                f"--vocab-file {vocab_file}: no {ENDOFTEXT} token, which GPT2BPETokenizer uses as eod"
            )
        hf.add_special_tokens([AddedToken(ENDOFTEXT, special=True, normalized=False)])
        self._setup(hf.to_str(), ENDOFTEXT, None, threads, special_tokens, include_special_tokens)
        self.identity = {
            "type": self.type_name,
            "model": [str(Path(vocab_file).resolve()), str(Path(merge_file).resolve())],
            "sha256": file_sha256(vocab_file, merge_file),
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            **_options_identity(special_tokens=special_tokens, include_special_tokens=include_special_tokens),
        }


class SentencePieceTokenizer:
    """A SentencePiece `.model`; ids without BOS/EOS, eod = the model's eos id (Megatron-LM convention).

    Megatron-LM's two encoding options are mirrored exactly: legacy special tokens (`special_tokens` with
    `legacy`: the text is cut at each special token, the pieces encoded apart, a "▁" right after a special
    dropped; tokens unknown to the model get ids from the piece count up) and
    `ignore_extra_whitespaces=False` (runs of spaces that the model would collapse are kept by encoding a
    marker between them and dropping the marker's last id).
    """

    def __init__(
        self,
        model: str | Path,
        type_name: str = "SentencePieceTokenizer",
        threads: int = 1,
        *,
        special_tokens: list[str] | None = None,
        legacy: bool = False,
        ignore_extra_whitespaces: bool = True,
    ) -> None:
        import sentencepiece

        if not model or not Path(model).is_file():
            raise FileNotFoundError(
                f"{type_name} needs --tokenizer-model pointing to a .model file; got {model!r}"
            )
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(model))
        except (RuntimeError, OSError) as e:
            raise ValueError(
                f"--tokenizer-model {model}: not a SentencePiece model ({str(e)[:200]}); for a tokenizer.json "
                "folder use --tokenizer-type HuggingFaceTokenizer"
            ) from None
        if special_tokens and not legacy:
            raise ValueError(
                f"--tokenizer-special-tokens with {type_name} needs --tokenizer-sentencepiece-legacy: "
                "Megatron-LM adds special tokens to a SentencePiece model only in its legacy mode"
            )
        self.threads = threads
        self.vocab_size = self._sp.get_piece_size()
        self._specials: dict[str, int] = {}
        for token in special_tokens or []:
            piece = self._sp.piece_to_id(token)
            if piece == self._sp.unk_id() and token not in self._specials:
                self._specials[token] = self.vocab_size
                self.vocab_size += 1
            elif piece != self._sp.unk_id():
                self._specials[token] = piece
        self._special_ids = {i: t for t, i in self._specials.items()}
        self._separator = self._sp.piece_to_id("▁")
        collapses = self._sp.encode_as_pieces("x  y") == self._sp.encode_as_pieces("x y")
        self._keep_spaces = collapses and not ignore_extra_whitespaces
        self.eod = self._sp.eos_id() if self._sp.eos_id() >= 0 else None
        self.pad = self._sp.pad_id() if self._sp.pad_id() >= 0 else None
        self.model_file, self.processor = str(model), self._sp
        self.special_tokens = dict(self._specials)  # Megatron-LM's legacy special tokens: text → id
        self.keeps_extra_spaces = self._keep_spaces
        self.backend = "sentencepiece"
        self.identity = {
            "type": type_name,
            "model": str(Path(model).resolve()),
            "sha256": file_sha256(model),
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            **_options_identity(
                special_tokens=special_tokens,
                sentencepiece_legacy=legacy,
                sentencepiece_ignore_extra_whitespaces=ignore_extra_whitespaces,
            ),
        }

    def _encode(self, text: str) -> list[int]:
        if not self._keep_spaces:
            return self._sp.encode(text)
        ids: list[int] = []
        for part in text.split(SP_EXTRA_SPACE):
            if part:
                ids += self._sp.encode(part + SP_EXTRA_SPACE)[:-1]
        return ids

    def tokenize(self, text: str) -> list[int]:
        if self._keep_spaces:
            text = re.sub(r"(?<= )(?= )|^ | $", f" {SP_EXTRA_SPACE} ", text).rstrip()
        ids: list[int] = []
        at = 0
        while self._specials:
            found = {t: i for t in self._specials if (i := text.find(t, at)) >= 0}
            if not found:
                break
            token = min(found, key=found.get)
            piece_ids = self._sp.encode(text[at : found[token]])  # no marker handling here, as in Megatron-LM
            if ids and ids[-1] in self._special_ids and piece_ids and piece_ids[0] == self._separator:
                piece_ids.pop(0)
            ids += piece_ids
            ids.append(self._specials[token])
            at = found[token] + len(token)
        return ids + self._encode(text[at:])

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        if self._specials or self._keep_spaces:
            return [self.tokenize(t) for t in texts]
        return self._sp.encode(texts, num_threads=self.threads)

    def detokenize(self, ids: list[int]) -> str:
        out, run = [], []
        for i in ids:
            if i in self._special_ids:
                out += [self._sp.decode(run), self._special_ids[i]]
                run = []
            else:
                run.append(i)
        return "".join([*out, self._sp.decode(run)])


class NullTokenizer:
    """Megatron-LM's NullTokenizer: the text already holds the ids, space separated ("17 4 99").

    `reject` says why a text is not such a list (Megatron-LM would crash on it, or write ids past the
    vocabulary); the pipeline skips and counts those documents.
    """

    def __init__(self, vocab_size: int | None, eod_id: int | None = None, pad_id: int = -1) -> None:
        if vocab_size is None or vocab_size < 1:
            raise ValueError(
                f"--tokenizer-type NullTokenizer needs --vocab-size N >= 1 (the ids in the text are 0..N-1); "
                f"got {vocab_size}"
            )
        eod = vocab_size - 1 if eod_id is None else eod_id
        if not 0 <= eod < vocab_size:
            raise ValueError(
                f"--null-tokenizer-eod-id {eod_id}: must lie in 0..{vocab_size - 1} (--vocab-size {vocab_size})"
            )
        self.vocab_size, self.eod = vocab_size, eod
        self.pad = pad_id if pad_id >= 0 else None
        self.backend = "null (the text holds the ids)"
        self.identity = {
            "type": "NullTokenizer",
            "model": None,
            "sha256": None,
            "vocab_size": vocab_size,
            "eod": eod,
            **({"pad": pad_id} if pad_id != -1 else {}),
        }

    def reject(self, text: str) -> str | None:
        """Why `text` is not space-separated ids in 0..vocab_size-1, or None when it is."""
        try:
            ids = self.tokenize(text)
        except ValueError:
            return "NullTokenizer needs space-separated integers"
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        return None if bad is None else f"id {bad} outside 0..{self.vocab_size - 1} (--vocab-size)"

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split(" ")]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)


def _megatron_tiktoken_ranks(path: Path, inner_vocab: int, shift: int) -> dict[bytes, int]:
    """Megatron-LM's tiktoken vocabulary: a JSON list of {rank, token_bytes (base64), token_str}."""
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(entries, list) or not entries or "token_bytes" not in entries[0]:
            raise ValueError("not a list of {rank, token_bytes, token_str}")
        ranks = {base64.b64decode(e["token_bytes"]): e["rank"] + shift for e in entries[:inner_vocab]}
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"--tokenizer-model {path}: not Megatron-LM's tiktoken JSON ({type(e).__name__}: {str(e)[:120]})"
        ) from None
    if sorted(ranks.values()) != list(range(shift, shift + len(ranks))):
        raise ValueError(f"--tokenizer-model {path}: ranks are not 0..N-1 in order")
    return ranks


@contextlib.contextmanager
def _local_openai_ranks(ranks: dict[bytes, int]):
    """Let tiktoken's own encoding constructors take `ranks` instead of fetching their URL."""
    from tiktoken_ext import openai_public

    saved = openai_public.load_tiktoken_bpe, openai_public.data_gym_to_mergeable_bpe_ranks
    openai_public.load_tiktoken_bpe = lambda *_a, **_k: ranks
    openai_public.data_gym_to_mergeable_bpe_ranks = lambda *_a, **_k: ranks
    try:
        yield openai_public.ENCODING_CONSTRUCTORS
    finally:
        openai_public.load_tiktoken_bpe, openai_public.data_gym_to_mergeable_bpe_ranks = saved


class TikTokenizer:
    """tiktoken: Megatron-LM's JSON vocabulary, or an OpenAI `.tiktoken` file (e.g. cl100k_base.tiktoken)."""

    def __init__(
        self,
        model: str | Path,
        pattern: str = "v2",
        num_special_tokens: int = 1000,
        vocab_size: int | None = None,
        threads: int = 1,
        special_tokens: list[str] | None = None,
    ) -> None:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        path = Path(model) if model else None
        if path is None or not path.is_file():
            raise FileNotFoundError(
                f"TikTokenizer needs --tokenizer-model: Megatron-LM's tiktoken .json or an encoding file "
                f"such as cl100k_base.tiktoken on disk (no download happens); got {model!r}"
            )
        if path.suffix == ".json":
            if pattern not in TIKTOKEN_PATTERNS:
                raise ValueError(
                    f"--tiktoken-pattern must be one of {sorted(TIKTOKEN_PATTERNS)}, got {pattern!r}"
                )
            vocab_size = vocab_size or 2**17
            specials = list(special_tokens or MEGATRON_TIKTOKEN_SPECIALS)
            missing = [t for t in MEGATRON_TIKTOKEN_SPECIALS if t not in specials]
            if missing or len(set(specials)) != len(specials):
                raise ValueError(
                    f"--tokenizer-special-tokens for TikTokenizer must be distinct and include "
                    f"{' '.join(MEGATRON_TIKTOKEN_SPECIALS)} (as in Megatron-LM); missing {missing}"
                )
            if not len(specials) <= num_special_tokens < vocab_size:
                raise ValueError(
                    f"--tiktoken-num-special-tokens {num_special_tokens}: needs {len(specials)} <= N < "
                    f"--vocab-size {vocab_size}"
                )
            specials += [f"<SPECIAL_{i}>" for i in range(len(specials), num_special_tokens)]
            ranks = _megatron_tiktoken_ranks(path, vocab_size - num_special_tokens, num_special_tokens)
            encoding = tiktoken.Encoding(
                path.parent.name,
                pat_str=TIKTOKEN_PATTERNS[pattern],
                mergeable_ranks=ranks,
                special_tokens={t: i for i, t in enumerate(specials)},
            )
            self.vocab_size, self.eod, self.pad = vocab_size, specials.index("</s>"), specials.index("<pad>")
        else:
            if special_tokens:
                raise ValueError(
                    f"--tokenizer-special-tokens: {path} is an OpenAI encoding with its own special tokens; "
                    "the option applies to Megatron-LM's tiktoken .json vocabularies"
                )
            ranks = load_tiktoken_bpe(str(path))
            with _local_openai_ranks(ranks) as constructors:
                if path.stem not in constructors:
                    raise ValueError(
                        f"--tokenizer-model {path}: unknown tiktoken encoding {path.stem!r}; name the file "
                        f"after one of {sorted(constructors)} or use Megatron-LM's tiktoken .json"
                    )
                encoding = tiktoken.Encoding(**constructors[path.stem]())
            self.vocab_size, self.eod, self.pad = encoding.n_vocab, encoding.eot_token, None
        self.encoding = encoding
        self.threads = threads
        self.backend = "tiktoken"
        self.identity = {
            "type": "TikTokenizer",
            "model": str(path.resolve()),
            "sha256": file_sha256(path),
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            **_options_identity(special_tokens=special_tokens),
        }

    def tokenize(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special="all", disallowed_special=())

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        if self.threads == 1:
            return [self.tokenize(t) for t in texts]
        return self.encoding.encode_batch(
            texts, num_threads=self.threads, allowed_special="all", disallowed_special=()
        )

    def detokenize(self, ids: list[int]) -> str:
        return self.encoding.decode(list(ids))


def _options_identity(**options: Any) -> dict:
    """Tokenizer options that differ from Megatron-LM's defaults, for manifests (defaults add nothing)."""
    defaults = {
        "special_tokens": None,
        "include_special_tokens": True,
        "sentencepiece_legacy": False,
        "sentencepiece_ignore_extra_whitespaces": True,
    }
    changed = {k: v for k, v in options.items() if v != defaults[k] and not (k == "special_tokens" and not v)}
    return {"options": changed} if changed else {}


def tokenizer_config(folder: str | Path) -> dict[str, Any]:
    """special_tokens_map.json updated by tokenizer_config.json of a Hugging Face tokenizer folder."""
    config: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = Path(folder) / name
        if path.is_file():
            try:
                loaded = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise ValueError(f"--tokenizer-model {path}: unreadable JSON ({e}); fix or remove the file") from None
            if isinstance(loaded, dict):
                config.update(loaded)
    return config


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    *,
    tiktoken_pattern: str | None = "v2",
    tiktoken_num_special_tokens: int = 1000,
    vocab_size: int | None = None,
    special_tokens: list[str] | None = None,
    include_special_tokens: bool = True,
    sentencepiece_legacy: bool = False,
    sentencepiece_ignore_extra_whitespaces: bool = True,
    null_eod_id: int | None = None,
    null_pad_id: int = -1,
    threads: int | None = None,
) -> Tokenizer:
    """A tokenizer by Megatron-LM `--tokenizer-type` name; unknown types and missing files raise clearly.

    The keyword options are Megatron-LM's tokenizer flags (`--tokenizer-special-tokens`, ...), applied to
    the types they apply to there. `threads` is the batch-tokenization parallelism (default:
    TOKENIZER_THREADS or 1; worker processes use 1 each and parallelise across processes instead).
    """
    threads = threads or int(os.environ.get("TOKENIZER_THREADS", "1"))
    if tokenizer_type in SP_TYPES:
        return SentencePieceTokenizer(
            tokenizer_model,
            tokenizer_type,
            threads=threads,
            special_tokens=special_tokens,
            legacy=sentencepiece_legacy,
            ignore_extra_whitespaces=sentencepiece_ignore_extra_whitespaces,
        )
    hf_options = {"special_tokens": special_tokens, "include_special_tokens": include_special_tokens}
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise ValueError("HuggingFaceTokenizer needs --tokenizer-model FOLDER (with tokenizer.json)")
        return HuggingFaceTokenizer(tokenizer_model, threads=threads, **hf_options)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file, threads=threads, **hf_options)
    if tokenizer_type == "TikTokenizer":
        return TikTokenizer(
            tokenizer_model,
            tiktoken_pattern or "v2",
            tiktoken_num_special_tokens,
            vocab_size,
            threads,
            special_tokens=special_tokens,
        )
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size, null_eod_id, null_pad_id)
    if tokenizer_type in REFUSED_TYPES:
        raise ValueError(f"--tokenizer-type {tokenizer_type}: {REFUSED_TYPES[tokenizer_type]}")
    raise ValueError(
        f"--tokenizer-type {tokenizer_type!r} is not supported; choose one of {', '.join(TOKENIZER_TYPES)}"
    )
