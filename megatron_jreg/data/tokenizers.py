"""Tokenizers by Megatron-LM's `--tokenizer-type`, built by megatron-core's own `build_tokenizer(args)` as its
tools/preprocess_data.py builds them, so the ids are Megatron-LM's by construction; added: a manifest identity,
an exact fast engine (fast_bpe.py), local files only, and load errors in one line naming the flag and the fix.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from megatron_jreg.data import fast_bpe
from megatron_jreg.data.checks import megatron_package
from megatron_jreg.data.fast_bpe import PROBE_TEXT
from megatron_jreg.data.tokenizer_flags import (
    REFUSED_TYPES,
    SP_TYPES,
    TOKENIZER_TYPES,
    add_tokenizer_args,
    megatron_args,
    tokenizer_defaults,
)

__all__ = ["PROBE_TEXT", "REFUSED_TYPES", "SP_TYPES", "TOKENIZER_TYPES", "Tokenizer", "add_tokenizer_args",
           "build_tokenizer", "from_args", "megatron_args", "tokenizer_defaults"]

ENDOFTEXT = "<|endoftext|>"
# What a wrong file gives megatron-core, in one line naming the flag and the fix.
_LOAD_HINTS = {
    **dict.fromkeys(SP_TYPES, "not a SentencePiece model; {type} needs a SentencePiece .model file (for a folder "
                    "with tokenizer.json use --tokenizer-type HuggingFaceTokenizer)"),
    "HuggingFaceTokenizer": "not a Hugging Face tokenizer folder; give a folder saved by a fast tokenizer "
    "(AutoTokenizer.from_pretrained(...).save_pretrained(folder)); for a SentencePiece .model use "
    "--tokenizer-type SentencePieceTokenizer",
    "TikTokenizer": "not Megatron-LM's tiktoken JSON (a list of {{rank, token_bytes, token_str}}) nor an OpenAI "
    ".tiktoken file; check the file, --vocab-size, --tiktoken-num-special-tokens and --tokenizer-special-tokens",
    "NullTokenizer": "NullTokenizer needs --vocab-size N (the ids in the text are 0..N-1)",
}


def file_sha256(*paths: str | Path) -> str:
    """sha256 over the bytes of the given files, in order (a tokenizer's identity in manifests)."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None = None, vocab_file: str | None = None,
                    merge_file: str | None = None, *, tiktoken_pattern: str | None = None,
                    tiktoken_num_special_tokens: int = 1000, vocab_size: int | None = None,
                    special_tokens: list[str] | None = None, include_special_tokens: bool = True,
                    sentencepiece_legacy: bool = False, sentencepiece_ignore_extra_whitespaces: bool = True,
                    null_eod_id: int | None = None, null_pad_id: int = -1) -> Tokenizer:
    """`from_args` for keyword options named after Megatron-LM's tokenizer flags (convert and checkpoints)."""
    return from_args(megatron_args(
        tokenizer_type, tokenizer_model, vocab_file=vocab_file, merge_file=merge_file,
        tiktoken_pattern=tiktoken_pattern, tiktoken_num_special_tokens=tiktoken_num_special_tokens,
        vocab_size=vocab_size, special_tokens=special_tokens or None,
        tokenizer_hf_no_include_special_tokens=not include_special_tokens,
        tokenizer_sentencepiece_legacy=sentencepiece_legacy,
        tokenizer_sentencepiece_ignore_extra_whitespaces=sentencepiece_ignore_extra_whitespaces,
        null_tokenizer_eod_id=null_eod_id, null_tokenizer_pad_id=null_pad_id,
    ))


def from_args(args: argparse.Namespace) -> Tokenizer:
    """The tokenizer of Megatron-LM's tokenizer args; a file that does not load is a ValueError naming it."""
    kind, model = args.tokenizer_type, args.tokenizer_model
    if kind in REFUSED_TYPES:
        raise ValueError(f"--tokenizer-type {kind}: {REFUSED_TYPES[kind]}")
    if kind not in TOKENIZER_TYPES:
        raise ValueError(f"--tokenizer-type {kind!r} is not supported; choose one of {', '.join(TOKENIZER_TYPES)}")
    if kind == "GPT2BPETokenizer":
        return _gpt2(args)
    if kind == "TikTokenizer" and model and str(model).endswith(".tiktoken"):
        return _openai_tiktoken(Path(model))
    eod, vocab = args.null_tokenizer_eod_id, args.vocab_size
    if kind == "NullTokenizer" and vocab and eod is not None and not 0 <= eod < vocab:
        raise ValueError(f"--null-tokenizer-eod-id {eod}: must lie in 0..{vocab - 1} (--vocab-size {vocab})")
    if kind != "NullTokenizer" and (not model or not Path(model).exists()):
        raise FileNotFoundError(f"--tokenizer-model {model}: no such file or folder; {kind} needs the tokenizer "
                                "on disk (nothing is downloaded)")
    hf = kind == "HuggingFaceTokenizer"
    for config in [Path(model, n) for n in ("tokenizer_config.json", "special_tokens_map.json") if hf]:
        try:  # transformers' own message would not name the file
            json.loads(config.read_text(encoding="utf-8")) if config.is_file() else None
        except (OSError, ValueError) as e:
            raise ValueError(f"--tokenizer-model {config}: unreadable JSON ({e}); fix or remove the file") from None
    try:
        megatron = megatron_package().core.tokenizers.utils.build_tokenizer.build_tokenizer(args)
    except Exception as e:  # megatron-core and the libraries under it raise assertions, ValueErrors, OSErrors
        where = "--vocab-size" if kind == "NullTokenizer" else f"--tokenizer-model {model}"
        hint = _LOAD_HINTS[kind].format(type=kind)
        raise ValueError(f"{where}: {hint} ({type(e).__name__}: {_short(e)})") from None
    return Tokenizer(megatron, _identity(args, megatron, [model] if model else []))


def _short(error: BaseException) -> str:
    return " ".join(str(error).split())[:200]


def _special_id(megatron: Any, name: str) -> int | None:
    try:
        value = getattr(megatron, name)
    except AttributeError:  # megatron-core's legacy SentencePiece wrapper has neither: the model's own ids
        model = megatron._tokenizer.tokenizer
        value = model.eos_id() if name == "eod" else model.pad_id()
    return value if value is not None and value >= 0 else None


def _identity(args: argparse.Namespace, megatron: Any, files: list[str]) -> dict:
    """What a manifest records; options appear only where they differ from Megatron-LM's defaults."""
    kind = args.tokenizer_type
    hf = kind in ("HuggingFaceTokenizer", "GPT2BPETokenizer")
    if kind == "HuggingFaceTokenizer":
        folder = Path(files[0])
        files = [folder / "tokenizer.json" if folder.is_dir() else folder]
    options = {
        "special_tokens": args.special_tokens if args.special_tokens and kind != "NullTokenizer" else None,
        "include_special_tokens": False if hf and args.tokenizer_hf_no_include_special_tokens else None,
        "sentencepiece_legacy": True if kind in SP_TYPES and args.tokenizer_sentencepiece_legacy else None,
        "sentencepiece_ignore_extra_whitespaces":
            False if kind in SP_TYPES and not args.tokenizer_sentencepiece_ignore_extra_whitespaces else None,
    }
    identity = {
        "type": kind,
        "model": None if not files else [str(Path(f).resolve()) for f in files] if kind == "GPT2BPETokenizer"
        else str(Path(args.tokenizer_model).resolve()),
        "sha256": file_sha256(*files) if files else None,
        "vocab_size": megatron.vocab_size,
        "eod": _special_id(megatron, "eod"),
    }
    if any(v is not None for v in options.values()):
        identity["options"] = {k: v for k, v in options.items() if v is not None}
    if kind == "HuggingFaceTokenizer" and getattr(megatron._tokenizer.tokenizer, "split_special_tokens", False):
        identity["split_special_tokens"] = True
    if kind == "NullTokenizer" and args.null_tokenizer_pad_id not in (None, -1):
        identity["pad"] = args.null_tokenizer_pad_id
    return identity


class Tokenizer:
    """megatron-core's tokenizer (`megatron`) plus a manifest identity and an exact fast engine (`backend` names
    it, or says why there is none); `processor`, `model_file`, `special_tokens`, `encoding` and
    `backend_tokenizer()` are what convert needs to write it as a Hugging Face tokenizer."""

    def __init__(self, megatron: Any, identity: dict) -> None:
        self.megatron, self.identity = megatron, identity
        self.vocab_size: int = megatron.vocab_size
        self.eod: int | None = _special_id(megatron, "eod")
        self.pad: int | None = _special_id(megatron, "pad")
        self.null = identity["type"] == "NullTokenizer"
        library = megatron._tokenizer
        self.processor = library.tokenizer if identity["type"] in SP_TYPES else None
        self.model_file = identity["model"]
        self.special_tokens = dict(getattr(library, "special_token_to_id", {}) or {})
        self.encoding = library.tokenizer if identity["type"] == "TikTokenizer" else None
        self._hf = library.tokenizer if identity["type"] in ("HuggingFaceTokenizer", "GPT2BPETokenizer") else None
        self._engine, self.backend = fast_bpe.engine_for(identity["type"], library, megatron.tokenize)

    def tokenize(self, text: str) -> list[int]:
        return self._engine.encode(text) if self._engine else list(self.megatron.tokenize(text))

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._engine.encode_batch(texts) if self._engine else [list(self.megatron.tokenize(t)) for t in texts]

    def tokenize_arrays(self, texts: list[str]) -> list[list[int] | np.ndarray]:
        """`tokenize_batch`'s ids, each a list or an int array (what preprocess writes; no conversion back)."""
        return self._engine.ids_batch(texts) if self._engine else [self.megatron.tokenize(t) for t in texts]

    def detokenize(self, ids: list[int]) -> str:
        return self.megatron.detokenize(list(ids), skip_special_tokens=False)

    def reject(self, text: str) -> str | None:
        """NullTokenizer: why `text` is not space-separated ids below the vocabulary size (Megatron-LM crashes
        on it, or writes ids past the vocabulary), else None."""
        if not self.null:
            return None
        try:
            ids = [int(x) for x in text.split(" ")]
        except ValueError:
            return "NullTokenizer needs space-separated integers"
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        return None if bad is None else f"id {bad} outside 0..{self.vocab_size - 1} (--vocab-size)"

    def backend_tokenizer(self) -> Any:
        """A copy of the `tokenizers.Tokenizer` that defines the ids (special tokens added; without its
        post-processor when the run leaves the post-processor's ids out), for an export."""
        from tokenizers import Tokenizer as HFTokenizer

        copy = HFTokenizer.from_str(self._hf.backend_tokenizer.to_str())
        if not self.megatron._tokenizer.include_special_tokens:
            copy.post_processor = None
        return copy


def _gpt2(args: argparse.Namespace) -> Tokenizer:
    """GPT2BPETokenizer over local files: the two files and gpt2's tokenizer class in a folder, loaded by
    megatron-core's HuggingFaceTokenizer (Megatron-LM's own path for this type fetches gpt2's config)."""
    files = [args.vocab_file, args.merge_file]
    for flag, value in zip(("--vocab-file", "--merge-file"), files):
        if not value or not Path(value).is_file():
            raise FileNotFoundError(f"GPT2BPETokenizer needs {flag} (GPT-2 vocab.json / merges.txt); got {value!r}")
    try:
        with tempfile.TemporaryDirectory() as folder:
            shutil.copy(args.vocab_file, Path(folder, "vocab.json"))
            shutil.copy(args.merge_file, Path(folder, "merges.txt"))
            Path(folder, "tokenizer_config.json").write_text('{"tokenizer_class": "GPT2Tokenizer"}')
            megatron = megatron_package().core.tokenizers.MegatronTokenizer.from_pretrained(
                tokenizer_path=folder, metadata_path={"library": "huggingface"},
                additional_special_tokens=args.special_tokens or [],
                include_special_tokens=not args.tokenizer_hf_no_include_special_tokens)
    except Exception as e:  # the `tokenizers` library raises its own exception types
        raise ValueError(f"--vocab-file {args.vocab_file} / --merge-file {args.merge_file}: not a GPT-2 vocab.json "
                         f"and merges.txt ({_short(e)})") from None
    return Tokenizer(megatron, _identity(args, megatron, files))


class _OpenAIEncoding:
    """An OpenAI `.tiktoken` encoding file in the shape of megatron-core's tokenizer (its own TikTokenizer
    reads only Megatron-LM's .json); the encoding's pattern and special tokens come from tiktoken's own
    constructor of that name, its ranks from the file (nothing is downloaded)."""

    def __init__(self, path: Path) -> None:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe
        from tiktoken_ext import openai_public

        if not hasattr(openai_public, path.stem):
            raise ValueError(f"--tokenizer-model {path}: unknown tiktoken encoding {path.stem!r}; name the file "
                             f"after one of {sorted(openai_public.ENCODING_CONSTRUCTORS)} or use Megatron-LM's "
                             "tiktoken .json")
        ranks = load_tiktoken_bpe(str(path))
        saved = openai_public.load_tiktoken_bpe  # the constructor reads its ranks through this name
        openai_public.load_tiktoken_bpe = lambda *_a, **_k: ranks
        try:
            spec = getattr(openai_public, path.stem)()
        finally:
            openai_public.load_tiktoken_bpe = saved
        self._tokenizer = self  # where megatron-core's tokenizer keeps its library object
        self.tokenizer = tiktoken.Encoding(**spec)
        self.vocab_size, self.eod, self.pad = self.tokenizer.n_vocab, self.tokenizer.eot_token, None

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, allowed_special="all", disallowed_special=())

    def detokenize(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids)


def _openai_tiktoken(path: Path) -> Tokenizer:
    if not path.is_file():
        raise FileNotFoundError(f"--tokenizer-model {path}: no such file (nothing is downloaded)")
    encoding = _OpenAIEncoding(path)
    identity = {"type": "TikTokenizer", "model": str(path.resolve()), "sha256": file_sha256(path),
                "vocab_size": encoding.vocab_size, "eod": encoding.eod}
    return Tokenizer(encoding, identity)
