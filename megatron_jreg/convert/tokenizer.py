"""The run's tokenizer in an exported Hugging Face folder, checked id for id as transformers loads it: a Megatron-LM
option transformers cannot reproduce would otherwise feed the model other ids, silently (docs/convert.md)."""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_jreg.checkpoints.model import run_tokenizer_type, tokenizer_options  # the run's, as the loaders read them
from megatron_jreg.convert.hf_io import ConversionError
from megatron_jreg.data.tokenizers import PROBE_TEXT, SP_TYPES, TOKENIZER_TYPES, Tokenizer, build_tokenizer

CHECK_PASSAGES = 200  # LAMBADA passages in the id check (with the probe texts: ~60k tokens, < 1 s)
# Files a Hugging Face tokenizer folder may hold; copied as they are.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
_NO_TOKENIZER = "or pass --no-tokenizer to export the weights without a tokenizer"
V5_ONLY_CLASS = "TokenizersBackend"  # transformers 5's name of PreTrainedTokenizerFast, unknown to 4.x


@dataclass
class TokenizerSource:
    """A tokenizer by Megatron-LM's flags and the run's tokenizer options (`build_tokenizer` keywords)."""

    type: str
    model: str | None
    vocab_file: str | None = None
    merge_file: str | None = None
    options: dict = field(default_factory=dict)
    where: str = ""  # "--tokenizer-model PATH" or "the run's tokenizer PATH", for messages

    def build(self) -> Tokenizer:
        try:
            return build_tokenizer(self.type, self.model, self.vocab_file, self.merge_file, **self.options)
        except (ValueError, OSError, KeyError) as e:
            raise ConversionError(f"{self.where}: {e}") from None


def infer_type(path: Path) -> str:
    if (path.is_dir() and (path / "tokenizer.json").is_file()) or path.name == "tokenizer.json":
        return "HuggingFaceTokenizer"
    if path.is_file() and path.suffix == ".model":
        return "SentencePieceTokenizer"
    if path.is_file() and path.suffix in (".tiktoken", ".json"):
        return "TikTokenizer"
    if path.is_dir() and (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
        return "GPT2BPETokenizer"
    raise ConversionError(f"--tokenizer-model {path}: not a tokenizer megatron-jreg can export (a folder with "
                          "tokenizer.json, a SentencePiece .model, a tiktoken .json/.tiktoken, or a folder with "
                          f"vocab.json and merges.txt); name its type with --tokenizer-type, {_NO_TOKENIZER}")


def resolve_source(
    args, tokenizer_model: str | None, tokenizer_type: str | None, no_tokenizer: bool  # noqa: ANN001
) -> tuple[TokenizerSource | None, str]:
    """(the tokenizer to write next to the weights or None, a note), checked before anything is loaded."""
    if no_tokenizer:
        if tokenizer_model:
            raise ConversionError("--no-tokenizer and --tokenizer-model contradict each other: give one of them")
        return None, "no tokenizer written (--no-tokenizer)"
    run_type = run_tokenizer_type(args)
    if tokenizer_model is None:
        if run_type in (None, "NullTokenizer"):
            return None, ("no tokenizer written: the run used NullTokenizer (its text was token ids); give "
                          "--tokenizer-model with the tokenizer that made those ids")
        if run_type == "GPT2BPETokenizer":
            files = [getattr(args, "vocab_file", None), getattr(args, "merge_file", None)]
            missing = [f for f in files if not f or not Path(f).is_file()]
            if missing:
                raise ConversionError(
                    f"the run's GPT2BPETokenizer files {missing} (recorded in the checkpoint) do not exist: pass "
                    f"--tokenizer-model DIR with its vocab.json and merges.txt, {_NO_TOKENIZER}")
            return (TokenizerSource(run_type, None, *files, tokenizer_options(args), f"the run's {run_type}"),
                    f"tokenizer from {files[0]} and {files[1]}")
        model = getattr(args, "tokenizer_model", None)
        if not model or not Path(model).exists():
            raise ConversionError(
                f"the run's tokenizer {model} ({run_type}, recorded in the checkpoint) does not exist: pass "
                f"--tokenizer-model with its current location, {_NO_TOKENIZER}")
        return (TokenizerSource(run_type, model, options=tokenizer_options(args), where=f"the run's tokenizer {model}"),
                f"tokenizer from {model}")
    path = Path(tokenizer_model)
    if not path.exists():
        raise ConversionError(f"--tokenizer-model {path} does not exist: pass an existing tokenizer, {_NO_TOKENIZER}")
    ttype = tokenizer_type or infer_type(path)
    if ttype not in TOKENIZER_TYPES or ttype == "NullTokenizer":
        raise ConversionError(f"--tokenizer-type {ttype}: cannot be written as a Hugging Face tokenizer; export "
                              f"one of {', '.join(t for t in TOKENIZER_TYPES if t != 'NullTokenizer')}")
    folder = path if path.is_dir() else path.parent
    gpt2 = ttype == "GPT2BPETokenizer"
    files = (None, str(folder / "vocab.json"), str(folder / "merges.txt")) if gpt2 else (str(path), None, None)
    options = tokenizer_options(args) if ttype == run_type else {}
    return TokenizerSource(ttype, *files, options, f"--tokenizer-model {path}"), f"tokenizer from {path}"


# Does the tokenizer belong to the checkpoint?
def recorded_vocabulary(args) -> tuple[str, int, int | None, int | None] | None:  # noqa: ANN001
    """(what, vocabulary size, end-of-document id, pad id) the run recorded: its tokenizer on disk, else its data's
    preprocess manifests, else NullTokenizer's flags."""
    run_type = run_tokenizer_type(args)
    if run_type == "NullTokenizer":
        vocab = getattr(args, "vocab_size", None)
        eod = getattr(args, "null_tokenizer_eod_id", None)  # only explicit ones say anything
        pad = getattr(args, "null_tokenizer_pad_id", -1)
        if not vocab:
            return None
        return "the run's NullTokenizer (--vocab-size)", int(vocab), eod, None if pad in (None, -1) else pad
    try:
        source, _ = resolve_source(args, None, None, False)
    except ConversionError:
        source = None
    if source is not None:
        tok = source.build()
        return f"the run's {run_type} {source.model or source.vocab_file}", tok.vocab_size, tok.eod, tok.pad
    from megatron_jreg.data.manifest import read_manifest
    from megatron_jreg.training.data import data_prefixes

    try:
        prefixes = data_prefixes(args)
    except Exception:  # noqa: BLE001 - a recorded data path we cannot parse only means no manifest to read
        prefixes = []
    for _, prefix in prefixes:
        identity = (read_manifest(prefix) or {}).get("tokenizer") or {}
        if isinstance(identity.get("vocab_size"), int):
            what = f"the tokenizer that prepared {prefix} (its manifest)"
            return what, identity["vocab_size"], identity.get("eod"), identity.get("pad")
    return None


def check_fits_checkpoint(tok: Tokenizer, source: TokenizerSource, args) -> None:  # noqa: ANN001
    """Refuse, with the numbers, a tokenizer that is not the one the run used."""
    from megatron.training.vocab_utils import calculate_padded_vocab_size

    problems = []
    divisible, tp = int(args.make_vocab_size_divisible_by), int(args.tensor_model_parallel_size)
    padded = calculate_padded_vocab_size(tok.vocab_size, divisible, tp, logging_enabled=False)
    if padded != int(args.padded_vocab_size):
        problems.append(f"its {tok.vocab_size} tokens pad to {padded} embedding rows (multiple of "
                        f"{divisible} × TP {tp}), the checkpoint has {args.padded_vocab_size}")
    recorded = None if source.where.startswith("the run's") else recorded_vocabulary(args)
    if recorded is not None:
        what, vocab, eod, pad = recorded
        if vocab != tok.vocab_size:
            problems.append(f"{tok.vocab_size} tokens, {what} has {vocab}")
        if eod is not None and tok.eod != eod:
            problems.append(f"end-of-document id {tok.eod}, {what} has {eod}")
        if pad is not None and tok.pad is not None and tok.pad != pad:
            problems.append(f"pad id {tok.pad}, {what} has {pad}")
    if problems:
        raise ConversionError(
            f"{source.where} ({source.type}) is not the tokenizer this checkpoint was trained with: "
            f"{'; '.join(problems)}. Pass the run's tokenizer, {_NO_TOKENIZER}")


# Writing it.
def _token_text(tok: Tokenizer, token_id: int | None) -> str | None:
    """The text of one token id (a SentencePiece control piece such as "</s>" decodes to nothing)."""
    if token_id is None:
        return None
    processor = getattr(tok, "processor", None)
    if processor is not None and token_id < processor.get_piece_size():
        return processor.id_to_piece(token_id)
    return tok.detokenize([token_id]) or None


def _save_fast(backend: Any, folder: Path, specials: dict[str, str | None], context_length: int,
               extra: dict | None = None) -> None:
    """A `tokenizers.Tokenizer` saved as a transformers fast tokenizer folder (4.x and 5.x both load its class)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=context_length,
                                   **{f"{k}_token": v for k, v in specials.items() if v is not None})
    fast.save_pretrained(str(folder))
    _patch_config(folder, {"tokenizer_class": "PreTrainedTokenizerFast", **(extra or {})})


def _patch_config(folder: Path, updates: dict, unless_set: dict | None = None) -> None:
    """tokenizer_config.json with `updates`, `unless_set` where unset, the class by a name transformers 4.x knows."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    config.update(updates)
    config.update({k: v for k, v in (unless_set or {}).items() if v and not config.get(k)})
    if config.get("tokenizer_class") == V5_ONLY_CLASS:
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _sentencepiece(tok: Any, folder: Path, context_length: int) -> None:
    """transformers' SentencePiece conversion, as `AutoTokenizer` does it for a folder holding only a .model."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # transformers 4.x converts SentencePiece models through LlamaTokenizer's rules only
        raise ConversionError("converting a SentencePiece model exactly needs transformers >= 5 (TokenizersBackend); "
                              f"upgrade it, {_NO_TOKENIZER}") from None
    sp = tok.processor
    piece = {k: sp.id_to_piece(i) if i >= 0 else None
             for k, i in (("bos", sp.bos_id()), ("eos", sp.eos_id()), ("unk", sp.unk_id()), ("pad", sp.pad_id()))}
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(tok.model_file, Path(tmp) / "tokenizer.model")
        fast = TokenizersBackend.from_pretrained(tmp, local_files_only=True, trust_remote_code=False)
    if tok.special_tokens:  # Megatron-LM's legacy special tokens: those the model lacks get the next ids
        fast.add_tokens(list(tok.special_tokens), special_tokens=True)
    specials = {**piece, "pad": piece["pad"] or piece["eos"]}
    _save_fast(fast.backend_tokenizer, folder, specials, context_length,
               {} if tok.special_tokens else {"split_special_tokens": True})
    shutil.copy(tok.model_file, folder / "tokenizer.model")  # for readers that want the SentencePiece model


def _tiktoken_backend(encoding: Any) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` for a tiktoken encoding, its special tokens at their own ids."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _EncodingConverter(TikTokenConverter):
        def load_tiktoken_bpe(self, _url: str) -> dict[bytes, int]:
            return encoding._mergeable_ranks

        def extract_vocab_merges_from_model(self, url: str):
            vocab, merges = super().extract_vocab_merges_from_model(url)
            vocab.update(encoding._special_tokens)  # existing ids are kept when the specials are added
            return vocab, merges

    converter = _EncodingConverter(pattern=encoding._pat_str, extra_special_tokens=list(encoding._special_tokens))
    return converter.converted()


def write_tokenizer(tok: Tokenizer, source: TokenizerSource, folder: Path, context_length: int) -> list[str]:
    before = {p.name for p in folder.iterdir()}
    eos = _token_text(tok, tok.eod)
    pad = _token_text(tok, tok.pad) or eos
    default = not source.options.get("special_tokens") and source.options.get("include_special_tokens", True)
    if source.type == "HuggingFaceTokenizer" and default:
        path = Path(source.model)
        origin = path if path.is_dir() else path.parent
        for name in TOKENIZER_FILES:
            if (origin / name).is_file():
                shutil.copy2(origin / name, folder / name)
        _patch_config(folder, {"model_max_length": context_length}, {"pad_token": pad, "eos_token": eos})
    elif source.type in ("HuggingFaceTokenizer", "GPT2BPETokenizer"):
        _save_fast(tok.backend_tokenizer(), folder, {"eos": eos, "pad": pad}, context_length)
    elif source.type in SP_TYPES:
        _sentencepiece(tok, folder, context_length)
    elif source.type == "TikTokenizer":
        _save_fast(_tiktoken_backend(tok.encoding), folder, {"eos": eos, "pad": pad}, context_length)
    else:
        raise ConversionError(f"{source.where}: {source.type} cannot be written as a Hugging Face tokenizer")
    return sorted({p.name for p in folder.iterdir()} - before)


def check_texts(tok: Tokenizer) -> list[str]:
    """The id check's sample: a probe text, each special token's text inside a sentence (Megatron-LM's SentencePiece
    reads it literally, other tokenizers as the special id), and the first CHECK_PASSAGES LAMBADA passages."""
    from megatron_jreg.data.text import lambada_passages

    specials = {_token_text(tok, i) for i in (tok.eod, tok.pad) if i is not None}
    specials |= set(getattr(tok, "special_tokens", {}) or {})
    probes = [f"before{t}after and {t} {t}" for t in sorted(s for s in specials if s)]
    return [PROBE_TEXT, *probes, *lambada_passages()[:CHECK_PASSAGES]]


def check_written(tok: Tokenizer, source: TokenizerSource, folder: Path, vocab_size: int) -> Any:
    """The written tokenizer as transformers loads it, checked to give `tok`'s ids and fit the embedding."""
    from transformers import AutoTokenizer

    if tok.vocab_size > vocab_size:
        raise ConversionError(
            f"{source.where} has {tok.vocab_size} tokens but the model's vocabulary is {vocab_size}: ids past the "
            f"embedding would be undefined; pass the tokenizer the model was trained with, {_NO_TOKENIZER}")
    try:
        theirs = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConversionError(f"{source.where}: transformers cannot load the tokenizer written from it ({e}); "
                              f"{_NO_TOKENIZER}") from None
    texts = check_texts(tok)
    for n, text in enumerate(texts):
        expected, got = tok.tokenize(text), list(theirs(text, verbose=False)["input_ids"])
        if got != expected:
            at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
            raise ConversionError(
                f"{source.where} ({source.type}), as transformers loads it from the exported folder, gives other "
                f"ids than the run's tokenizer on sample {n} of the id check (token {at}: {got[at:at + 3]} instead "
                f"of {expected[at:at + 3]}; e.g. a Megatron-LM tokenizer option transformers cannot reproduce); "
                f"{_NO_TOKENIZER}")
    return theirs
