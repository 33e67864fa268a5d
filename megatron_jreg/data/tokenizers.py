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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

SP_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TOKENIZER_TYPES = (*SP_TYPES, "HuggingFaceTokenizer", "GPT2BPETokenizer", "TikTokenizer")

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

    def __init__(self, model: str | Path, threads: int = 1) -> None:
        path = Path(model)
        json_path = path / "tokenizer.json" if path.is_dir() else path
        if not json_path.is_file():
            raise FileNotFoundError(
                f"--tokenizer-model {model}: no tokenizer.json there. HuggingFaceTokenizer needs a local "
                "folder saved by a fast tokenizer: AutoTokenizer.from_pretrained(...).save_pretrained(folder)"
            )
        config: dict[str, Any] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            if (json_path.parent / name).is_file():
                config.update(json.loads((json_path.parent / name).read_text(encoding="utf-8")))
        eos = _special_token(config.get("eos_token")) or _special_token(config.get("sep_token"))
        self._setup(
            json_path.read_text(encoding="utf-8"), eos, _special_token(config.get("pad_token")), threads
        )
        self.identity = {
            "type": self.type_name,
            "model": str(path.resolve()),
            "sha256": file_sha256(json_path),
            "vocab_size": self.vocab_size,
            "eod": self.eod,
        }

    def _setup(self, tokenizer_json: str, eos: str | None, pad: str | None, threads: int) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self._hf = HFTokenizer.from_str(tokenizer_json)
        self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
        self.eod = self._hf.token_to_id(eos) if eos else None
        self.pad = self._hf.token_to_id(pad) if pad else None
        plan = _plan_tiktoken(json.loads(tokenizer_json))
        self.engine: _TiktokenEngine | None = None
        self.backend = (
            f"tokenizers (no exact tiktoken conversion: {plan})" if isinstance(plan, str) else "tiktoken"
        )
        if not isinstance(plan, str):
            engine = _TiktokenEngine(self.type_name, plan, threads)
            if engine.encode(PROBE_TEXT) == self._hf.encode(PROBE_TEXT).ids:
                self.engine = engine
            else:
                self.backend = "tokenizers (tiktoken conversion disagreed on the probe text)"

    def tokenize(self, text: str) -> list[int]:
        return self.engine.encode(text) if self.engine else self._hf.encode(text).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        if self.engine:
            return self.engine.encode_batch(texts)
        return [e.ids for e in self._hf.encode_batch(texts)]

    def detokenize(self, ids: list[int]) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=False)


class GPT2BPETokenizer(HuggingFaceTokenizer):
    """GPT-2 byte-level BPE from `--vocab-file vocab.json --merge-file merges.txt`; eod = <|endoftext|>."""

    type_name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str | Path, merge_file: str | Path, threads: int = 1) -> None:
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        for flag, value in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not value or not Path(value).is_file():
                raise FileNotFoundError(
                    f"GPT2BPETokenizer needs {flag} (GPT-2 vocab.json / merges.txt); got {value!r}"
                )
        hf = HFTokenizer(models.BPE.from_file(str(vocab_file), str(merge_file)))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        if hf.token_to_id(ENDOFTEXT) is None:
            raise ValueError(
                f"--vocab-file {vocab_file}: no {ENDOFTEXT} token, which GPT2BPETokenizer uses as eod"
            )
        hf.add_special_tokens([AddedToken(ENDOFTEXT, special=True, normalized=False)])
        self._setup(hf.to_str(), ENDOFTEXT, None, threads)
        self.identity = {
            "type": self.type_name,
            "model": [str(Path(vocab_file).resolve()), str(Path(merge_file).resolve())],
            "sha256": file_sha256(vocab_file, merge_file),
            "vocab_size": self.vocab_size,
            "eod": self.eod,
        }


class SentencePieceTokenizer:
    """A SentencePiece `.model`; ids without BOS/EOS, eod = the model's eos id (Megatron-LM convention)."""

    def __init__(
        self, model: str | Path, type_name: str = "SentencePieceTokenizer", threads: int = 1
    ) -> None:
        import sentencepiece

        if not model or not Path(model).is_file():
            raise FileNotFoundError(
                f"{type_name} needs --tokenizer-model pointing to a .model file; got {model!r}"
            )
        self._sp = sentencepiece.SentencePieceProcessor(model_file=str(model))
        self.threads = threads
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id() if self._sp.eos_id() >= 0 else None
        self.pad = self._sp.pad_id() if self._sp.pad_id() >= 0 else None
        self.backend = "sentencepiece"
        self.identity = {
            "type": type_name,
            "model": str(Path(model).resolve()),
            "sha256": file_sha256(model),
            "vocab_size": self.vocab_size,
            "eod": self.eod,
        }

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts, num_threads=self.threads)

    def detokenize(self, ids: list[int]) -> str:
        return self._sp.decode(list(ids))


def _megatron_tiktoken_ranks(path: Path, inner_vocab: int, shift: int) -> dict[bytes, int]:
    """Megatron-LM's tiktoken vocabulary: a JSON list of {rank, token_bytes (base64), token_str}."""
    entries = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(entries, list) or not entries or "token_bytes" not in entries[0]:
        raise ValueError(f"--tokenizer-model {path}: not Megatron-LM's tiktoken JSON (a list of token_bytes)")
    ranks = {base64.b64decode(e["token_bytes"]): e["rank"] + shift for e in entries[:inner_vocab]}
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
            specials = MEGATRON_TIKTOKEN_SPECIALS + [
                f"<SPECIAL_{i}>" for i in range(len(MEGATRON_TIKTOKEN_SPECIALS), num_special_tokens)
            ]
            ranks = _megatron_tiktoken_ranks(path, vocab_size - num_special_tokens, num_special_tokens)
            encoding = tiktoken.Encoding(
                path.parent.name,
                pat_str=TIKTOKEN_PATTERNS[pattern],
                mergeable_ranks=ranks,
                special_tokens={t: i for i, t in enumerate(specials)},
            )
            self.vocab_size, self.eod, self.pad = vocab_size, specials.index("</s>"), specials.index("<pad>")
        else:
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


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    *,
    tiktoken_pattern: str = "v2",
    tiktoken_num_special_tokens: int = 1000,
    vocab_size: int | None = None,
    threads: int | None = None,
) -> Tokenizer:
    """A tokenizer by Megatron-LM `--tokenizer-type` name; unknown types and missing files raise clearly.

    `threads` is the batch-tokenization parallelism (default: TOKENIZER_THREADS or 1; worker processes
    use 1 each and parallelise across processes instead).
    """
    threads = threads or int(os.environ.get("TOKENIZER_THREADS", "1"))
    if tokenizer_type in SP_TYPES:
        return SentencePieceTokenizer(tokenizer_model, tokenizer_type, threads=threads)
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise ValueError("HuggingFaceTokenizer needs --tokenizer-model FOLDER (with tokenizer.json)")
        return HuggingFaceTokenizer(tokenizer_model, threads=threads)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file, threads=threads)
    if tokenizer_type == "TikTokenizer":
        return TikTokenizer(
            tokenizer_model, tiktoken_pattern, tiktoken_num_special_tokens, vocab_size, threads
        )
    raise ValueError(
        f"--tokenizer-type {tokenizer_type!r} is not supported; choose one of {', '.join(TOKENIZER_TYPES)}"
    )
