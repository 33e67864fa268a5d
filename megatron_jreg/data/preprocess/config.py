"""`PreprocessConfig`: every preprocess flag, Megatron-LM's and ours, checked once before any work.

Megatron-LM's tools/preprocess_data.py flags keep their names, defaults and meaning. Its parser also takes
the training tokenizer group, some of whose flags do nothing to the data there (`--padded-vocab-size`, a
`--vocab-file` next to a SentencePiece model, ...): they are accepted so that shared argument lists work, and
`notes()` says in one line each that they have no effect. What Megatron-LM would do but megatron-jreg cannot
(BERT WordPiece from the Hub, a tokenizer's own Python code) is refused with the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from megatron_jreg.data.checks import DataError, check_positive
from megatron_jreg.data.tokenizers import MEGATRON_TOKENIZER_TYPES, REFUSED_TYPES, SP_TYPES, tokenizer_config

HF_TYPES = ("HuggingFaceTokenizer", "GPT2BPETokenizer")
TRIAL_DOCUMENTS = 100_000  # Megatron-LM's --max-documents default: documents per --find-optimal-num-workers trial
# --tokenizer-metadata "library" each type is built with in Megatron-LM.
METADATA_LIBRARY = {
    **dict.fromkeys(SP_TYPES, "sentencepiece"),
    "HuggingFaceTokenizer": "huggingface",
    "GPT2BPETokenizer": "megatron",
    "TikTokenizer": "tiktoken",
}
METADATA_MODEL_TYPES = (None, "default-text", "gpt", "mamba", "bert", "t5")  # thin wrappers: same ids
# Tokenizer flags and the types Megatron-LM uses them for: elsewhere they do nothing (a note says so).
TYPE_SPECIFIC = {
    "tokenizer_model": ("--tokenizer-model", (*SP_TYPES, "HuggingFaceTokenizer", "TikTokenizer")),
    # HuggingFaceTokenizer passes these to transformers, which uses the folder's tokenizer.json instead
    "vocab_file": ("--vocab-file", ("GPT2BPETokenizer",)),
    "merge_file": ("--merge-file", ("GPT2BPETokenizer",)),
    "vocab_size": ("--vocab-size", ("TikTokenizer", "NullTokenizer")),
    "tiktoken_pattern": ("--tiktoken-pattern", ("TikTokenizer",)),
    "tiktoken_num_special_tokens": ("--tiktoken-num-special-tokens", ("TikTokenizer",)),
    "tokenizer_special_tokens": ("--tokenizer-special-tokens", (*SP_TYPES, *HF_TYPES, "TikTokenizer")),
    "tokenizer_metadata": ("--tokenizer-metadata", tuple(METADATA_LIBRARY)),
    "tokenizer_sentencepiece_legacy": ("--tokenizer-sentencepiece-legacy", SP_TYPES),
    "tokenizer_sentencepiece_ignore_extra_whitespaces": (
        "--no-tokenizer-sentencepiece-ignore-extra-whitespaces",
        SP_TYPES,
    ),
    "tokenizer_hf_no_include_special_tokens": ("--tokenizer-hf-no-include-special-tokens", HF_TYPES),
    "null_tokenizer_eod_id": ("--null-tokenizer-eod-id", ("NullTokenizer",)),
    "null_tokenizer_pad_id": ("--null-tokenizer-pad-id", ("NullTokenizer",)),
}
# Flags Megatron-LM's tool accepts and never uses for the data, with why.
NO_EFFECT = {
    "padded_vocab_size": ("--padded-vocab-size", "sizes the model's embedding at training time"),
    "pad_vocab_size": ("--no-pad-vocab-size", "sizes the model's embedding at training time"),
    "vocab_extra_ids": ("--vocab-extra-ids", "Megatron-LM's tool resets it to 0; extra ids are a T5 training option"),
    "chat_template": ("--chat-template", "formats chats; plain documents are tokenized without it"),
    "tokenizer_hf_no_use_fast": (
        "--tokenizer-hf-no-use-fast",
        "with transformers 5 a tokenizer.json folder loads the same fast tokenizer either way",
    ),
}


@dataclass
class PreprocessConfig:
    """Everything `preprocess` needs; fields mirror the command-line flags (`--json-keys` -> json_keys)."""

    input: list[str]
    output_prefix: str
    tokenizer_type: str
    # input data
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    hf_split: str | None = None
    split_sentences: bool = False
    keep_newlines: bool = False
    lang: str = "english"
    punkt_model: str | None = None
    punkt_train_chars: int = 1_000_000
    # tokenizer: Megatron-LM's flags
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None
    tiktoken_pattern: str | None = None  # None: v2, Megatron-LM's default
    tiktoken_num_special_tokens: int = 1000
    tokenizer_special_tokens: list[str] | None = None
    tokenizer_metadata: str | None = None
    tokenizer_sentencepiece_legacy: bool = False
    tokenizer_sentencepiece_ignore_extra_whitespaces: bool = True
    tokenizer_hf_no_use_fast: bool = False
    tokenizer_hf_no_include_special_tokens: bool = False
    trust_remote_code: bool = False
    null_tokenizer_eod_id: int | None = None
    null_tokenizer_pad_id: int = -1
    padded_vocab_size: int | None = None
    pad_vocab_size: bool = True
    vocab_extra_ids: int = 0
    chat_template: str | None = None
    append_eod: bool = False
    # filters
    min_int_score: int | None = None
    min_chars: int = 0
    max_documents: int | None = None  # Megatron-LM's flag; None: all (TRIAL_DOCUMENTS per worker-count trial)
    on_error: str = "skip"
    # output
    output_shards: int = 1
    shard_ids: list[int] | None = None  # process only these shards (one node's share); None: all
    partitions: int = 1
    keep_sequential_samples: bool = False
    # runtime
    workers: int = 1
    log_interval: int = 1000
    block_mb: float = 1.0
    find_optimal_num_workers: bool = False
    workers_to_check: list[int] = field(default_factory=lambda: [16, 32, 64])

    def validate(self) -> None:
        """Check the configuration once, with messages that name the flag and the fix."""
        if isinstance(self.input, str):
            self.input = [self.input]
        if isinstance(self.json_keys, str):
            self.json_keys = [self.json_keys]
        if self.tokenizer_type in REFUSED_TYPES:
            raise DataError(f"--tokenizer-type {self.tokenizer_type}: {REFUSED_TYPES[self.tokenizer_type]}")
        for flag, value, minimum, allow_none in (
            ("--workers", self.workers, 1, False),
            ("--log-interval", self.log_interval, 1, False),
            ("--min-chars", self.min_chars, 0, False),
            ("--max-documents", self.max_documents, 1, True),
            ("--output-shards", self.output_shards, 1, False),
            ("--partitions", self.partitions, 1, False),
            ("--punkt-train-chars", self.punkt_train_chars, 1000, False),
            ("--block-mb", self.block_mb, 0.001, False),
            ("--vocab-size", self.vocab_size, 1, True),
            ("--padded-vocab-size", self.padded_vocab_size, 1, True),
            ("--vocab-extra-ids", self.vocab_extra_ids, 0, False),
            ("--tiktoken-num-special-tokens", self.tiktoken_num_special_tokens, 0, False),
        ):
            check_positive(flag, value, minimum, allow_none)
        for i in self.workers_to_check or [None]:
            check_positive("--workers-to-check", i, 1, allow_none=False)
        checks = [
            (bool(self.input), "--input is required (a file, directory or glob)"),
            (bool(self.output_prefix), "--output-prefix is required"),
            (
                self.tokenizer_type in MEGATRON_TOKENIZER_TYPES,
                f"--tokenizer-type {self.tokenizer_type!r}: choose one of {', '.join(MEGATRON_TOKENIZER_TYPES)}",
            ),
            (
                bool(self.json_keys) and len(set(self.json_keys)) == len(self.json_keys),
                "--json-keys needs distinct key names",
            ),
            (
                not self.shard_ids or all(0 <= i < self.output_shards for i in self.shard_ids),
                f"--shard-ids must lie in 0..{self.output_shards - 1} (--output-shards {self.output_shards})",
            ),
            (
                not self.shard_ids or self.max_documents is None or self.find_optimal_num_workers,
                "--max-documents counts documents across all shards in order; drop it or --shard-ids",
            ),
            (self.on_error in ("skip", "fail"), f"--on-error must be skip or fail, got {self.on_error!r}"),
            (
                not self.keep_newlines or self.split_sentences,
                "--keep-newlines only applies with --split-sentences",
            ),
            (
                self.tiktoken_pattern in (None, "v1", "v2"),
                f"--tiktoken-pattern must be v1 or v2, got {self.tiktoken_pattern!r}",
            ),
            (
                all(self.tokenizer_special_tokens or []),
                "--tokenizer-special-tokens: an empty token matches everywhere; remove it",
            ),
            (
                self.reorders() is None or self.output_shards == 1,
                f"--partitions {self.partitions} deals records round-robin over the whole input; it cannot be "
                "combined with --output-shards (add --keep-sequential-samples, or drop one of them)",
            ),
            (
                not (self.tokenizer_sentencepiece_legacy and self.append_eod and self.tokenizer_type in SP_TYPES),
                "--tokenizer-sentencepiece-legacy has no end-of-document token in Megatron-LM (--append-eod fails "
                "there); drop --append-eod or --tokenizer-sentencepiece-legacy",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise DataError(message)
        self._check_metadata()
        self._check_remote_code()

    def _check_metadata(self) -> None:
        """--tokenizer-metadata: readable, and naming the library --tokenizer-type builds (as Megatron-LM would)."""
        if not self.tokenizer_metadata or self.tokenizer_type not in METADATA_LIBRARY:
            return
        path = Path(self.tokenizer_metadata)
        try:
            metadata = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise DataError(
                f"--tokenizer-metadata {path}: unreadable ({e}); give Megatron-LM's tokenizer metadata JSON"
            ) from None
        library = METADATA_LIBRARY[self.tokenizer_type]
        if not isinstance(metadata, dict) or metadata.get("library") != library:
            found = metadata.get("library") if isinstance(metadata, dict) else type(metadata).__name__
            raise DataError(
                f"--tokenizer-metadata {path}: library {found!r}, but --tokenizer-type {self.tokenizer_type} is "
                f"built with {library!r}; fix the file's \"library\" or the --tokenizer-type"
            )
        if metadata.get("tokenizer_class") or metadata.get("model_type") not in METADATA_MODEL_TYPES:
            raise DataError(
                f"--tokenizer-metadata {path}: a custom tokenizer class or model_type "
                f"{metadata.get('model_type')!r} cannot be reproduced here; remove them from the file"
            )

    def _check_remote_code(self) -> None:
        """--trust-remote-code: fine when the tokenizer has no code of its own; refused when it has."""
        if not self.trust_remote_code or self.tokenizer_type != "HuggingFaceTokenizer" or not self.tokenizer_model:
            return
        folder = Path(self.tokenizer_model)
        auto_map = tokenizer_config(folder if folder.is_dir() else folder.parent).get("auto_map") or {}
        if "AutoTokenizer" in auto_map:
            raise DataError(
                f"--trust-remote-code: {self.tokenizer_model} tokenizes with its own Python code "
                f"({auto_map['AutoTokenizer']}), which megatron-jreg never runs; save it as a fast tokenizer "
                "(tokenizer.json) and drop --trust-remote-code"
            )

    def notes(self) -> list[str]:
        """One line per given flag that, as in Megatron-LM, changes nothing in the data."""
        notes = []
        defaults = PreprocessConfig(input=[], output_prefix="", tokenizer_type="")
        for name, (flag, types) in TYPE_SPECIFIC.items():
            if getattr(self, name) != getattr(defaults, name) and self.tokenizer_type not in types:
                notes.append(f"note: {flag} does not apply to --tokenizer-type {self.tokenizer_type}: no effect")
        for name, (flag, why) in NO_EFFECT.items():
            if getattr(self, name) != getattr(defaults, name):
                notes.append(f"note: {flag} {why}: no effect on the data (as in Megatron-LM)")
        if self.trust_remote_code:
            notes.append("note: --trust-remote-code: the tokenizer has no code of its own here: no effect")
        if not self.find_optimal_num_workers and self.workers_to_check != defaults.workers_to_check:
            notes.append("note: --workers-to-check only applies with --find-optimal-num-workers")
        return notes

    def reorders(self) -> int | None:
        """N when Megatron-LM's --partitions N changes the document order (round-robin), else None."""
        return self.partitions if self.partitions > 1 and not self.keep_sequential_samples else None

    @property
    def level(self) -> str:
        return "sentence" if self.split_sentences else "document"

    def tokenizer_kwargs(self) -> dict:
        """Arguments of `build_tokenizer` (picklable: worker processes build their own tokenizer)."""
        return {
            "tokenizer_type": self.tokenizer_type,
            "tokenizer_model": self.tokenizer_model,
            "vocab_file": self.vocab_file,
            "merge_file": self.merge_file,
            "tiktoken_pattern": self.tiktoken_pattern,
            "tiktoken_num_special_tokens": self.tiktoken_num_special_tokens,
            "vocab_size": self.vocab_size,
            "special_tokens": self.tokenizer_special_tokens,
            "include_special_tokens": not self.tokenizer_hf_no_include_special_tokens,
            "sentencepiece_legacy": self.tokenizer_sentencepiece_legacy,
            "sentencepiece_ignore_extra_whitespaces": self.tokenizer_sentencepiece_ignore_extra_whitespaces,
            "null_eod_id": self.null_tokenizer_eod_id,
            "null_pad_id": self.null_tokenizer_pad_id,
        }
