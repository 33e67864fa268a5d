"""`PreprocessConfig`: every preprocess flag, Megatron-LM's and ours, checked once before any work. Megatron-LM's
keep their names, defaults and meaning (its tokenizer flags reach megatron-core's `build_tokenizer` as they are);
one that does nothing to the data gets a note, one megatron-jreg does not run is refused with the reason and fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_jreg.data.checks import DataError, check_positive
from megatron_jreg.data.tokenizer_flags import REFUSED_TYPES, SP_TYPES, megatron_args, tokenizer_defaults

HF_TYPES = ("HuggingFaceTokenizer", "GPT2BPETokenizer")
_TEXT = (*SP_TYPES, *HF_TYPES, "TikTokenizer")
# Megatron-LM's tokenizer flags (dest: flag, the types its build_tokenizer passes them to); elsewhere a note.
APPLIES = {
    "tokenizer_model": ("--tokenizer-model", (*SP_TYPES, "HuggingFaceTokenizer", "TikTokenizer")),
    "vocab_file": ("--vocab-file", HF_TYPES),
    "merge_file": ("--merge-file", HF_TYPES),
    "vocab_size": ("--vocab-size", ("TikTokenizer", "NullTokenizer")),
    "tiktoken_pattern": ("--tiktoken-pattern", ("TikTokenizer",)),
    "tiktoken_num_special_tokens": ("--tiktoken-num-special-tokens", ("TikTokenizer",)),
    "special_tokens": ("--tokenizer-special-tokens", _TEXT),
    "metadata_path": ("--tokenizer-metadata", _TEXT),
    "tokenizer_sentencepiece_legacy": ("--tokenizer-sentencepiece-legacy", SP_TYPES),
    "tokenizer_sentencepiece_ignore_extra_whitespaces": ("--no-tokenizer-sentencepiece-ignore-extra-whitespaces",
                                                         SP_TYPES),
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
    "tokenizer_hf_no_use_fast": ("--tokenizer-hf-no-use-fast", "with transformers 5 a tokenizer.json folder loads "
                                 "the same fast tokenizer either way"),
}
METADATA_LIBRARY = {**dict.fromkeys(SP_TYPES, "sentencepiece"), "HuggingFaceTokenizer": "huggingface",
                    "GPT2BPETokenizer": "megatron", "TikTokenizer": "tiktoken"}
METADATA_MODEL_TYPES = (None, "default-text", "gpt", "mamba", "bert", "t5")  # thin wrappers: same ids


@dataclass
class PreprocessConfig:
    """Everything `preprocess` needs; fields mirror the command-line flags (`--json-keys` -> json_keys), and
    `tokenizer` holds Megatron-LM's other tokenizer flags by their dest names (`special_tokens`, `vocab_file`)."""

    input: list[str]
    output_prefix: str
    tokenizer_type: str
    tokenizer_model: str | None = None
    tokenizer: dict[str, Any] = field(default_factory=dict)
    append_eod: bool = False
    # input data
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    hf_split: str | None = None
    split_sentences: bool = False
    keep_newlines: bool = False
    lang: str = "english"
    # filters
    min_int_score: int | None = None
    min_chars: int = 0
    max_documents: int | None = None  # Megatron-LM's flag (documents per worker trial); here: all when None
    on_error: str = "skip"
    # output
    output_shards: int = 1
    shard_ids: list[int] | None = None  # process only these shards (one node's share); None: all
    # runtime
    workers: int = 1
    log_interval: int = 1000
    block_mb: float = 1.0
    # Megatron-LM's flags that only refuse or note here
    partitions: int = 1
    keep_sequential_samples: bool = False
    find_optimal_num_workers: bool = False
    workers_to_check: list[int] = field(default_factory=lambda: [16, 32, 64])

    def validate(self) -> None:
        """Check the configuration once, with messages that name the flag and the fix."""
        tok = {**tokenizer_defaults(), **self.tokenizer}
        sp_specials = bool(tok["special_tokens"]) and self.tokenizer_type in SP_TYPES
        for flag, value, minimum, allow_none in (
            ("--workers", self.workers, 1, False),
            ("--log-interval", self.log_interval, 1, False),
            ("--min-chars", self.min_chars, 0, False),
            ("--max-documents", self.max_documents, 1, True),
            ("--output-shards", self.output_shards, 1, False),
            ("--partitions", self.partitions, 1, False),
            ("--block-mb", self.block_mb, 0.001, False),
            ("--vocab-size", tok["vocab_size"], 1, True),
            ("--padded-vocab-size", tok["padded_vocab_size"], 1, True),
            ("--vocab-extra-ids", tok["vocab_extra_ids"], 0, False),
            ("--tiktoken-num-special-tokens", tok["tiktoken_num_special_tokens"], 0, False),
            *(("--workers-to-check", n, 1, False) for n in self.workers_to_check or [None]),
        ):
            check_positive(flag, value, minimum, allow_none)
        checks = [
            (self.tokenizer_type is not None, "--tokenizer-type is required"),
            (self.tokenizer_type not in REFUSED_TYPES,
             f"--tokenizer-type {self.tokenizer_type}: {REFUSED_TYPES.get(self.tokenizer_type)}"),
            (bool(self.input), "--input is required (a file, directory or glob)"),
            (bool(self.output_prefix), "--output-prefix is required"),
            (bool(self.json_keys) and len(set(self.json_keys)) == len(self.json_keys),
             "--json-keys needs distinct key names"),
            (not self.shard_ids or all(0 <= i < self.output_shards for i in self.shard_ids),
             f"--shard-ids must lie in 0..{self.output_shards - 1} (--output-shards {self.output_shards})"),
            (not self.shard_ids or self.max_documents is None,
             "--max-documents counts documents across all shards in order; drop it or --shard-ids"),
            (self.on_error in ("skip", "fail"), f"--on-error must be skip or fail, got {self.on_error!r}"),
            (not self.keep_newlines or self.split_sentences, "--keep-newlines only applies with --split-sentences"),
            (all(tok["special_tokens"] or []), "--tokenizer-special-tokens: an empty token matches everywhere; "
             "remove it"),
            (not sp_specials or tok["tokenizer_sentencepiece_legacy"],
             "--tokenizer-special-tokens with a SentencePiece tokenizer needs --tokenizer-sentencepiece-legacy "
             "(Megatron-LM adds special tokens to a SentencePiece model only in its legacy mode)"),
            (not (tok["tokenizer_sentencepiece_legacy"] and self.append_eod and self.tokenizer_type in SP_TYPES),
             "--tokenizer-sentencepiece-legacy has no end-of-document token in Megatron-LM (--append-eod fails "
             "there); drop --append-eod or --tokenizer-sentencepiece-legacy"),
            (self.partitions == 1 or self.keep_sequential_samples,
             f"--partitions {self.partitions}: Megatron-LM deals the records round-robin over partition files to "
             "spread the work; here --workers spreads it (and --output-shards splits the output), keeping the input "
             "order: drop --partitions, or add --keep-sequential-samples (the input order)"),
            (not self.find_optimal_num_workers,
             "--find-optimal-num-workers: not run here; time short runs instead (--max-documents 100000 with a few "
             "--workers values: the done line prints MB/s and tokens/s)"),
        ]
        for ok, message in checks:
            if not ok:
                raise DataError(message)
        self._check_metadata(tok["metadata_path"])
        if tok["trust_remote_code"]:
            self._check_remote_code()

    def _check_metadata(self, metadata_path: str | None) -> None:
        """--tokenizer-metadata: readable, and naming the library --tokenizer-type builds (as Megatron-LM would)."""
        if not metadata_path or self.tokenizer_type not in METADATA_LIBRARY:
            return
        path = Path(metadata_path)
        try:
            metadata = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise DataError(f"--tokenizer-metadata {path}: unreadable ({e}); give Megatron-LM's tokenizer "
                            "metadata JSON") from None
        library = METADATA_LIBRARY[self.tokenizer_type]
        found = metadata.get("library") if isinstance(metadata, dict) else type(metadata).__name__
        if found != library:
            raise DataError(f"--tokenizer-metadata {path}: library {found!r}, but --tokenizer-type "
                            f"{self.tokenizer_type} is built with {library!r}; fix the file's \"library\" or the "
                            "--tokenizer-type")
        if metadata.get("tokenizer_class") or metadata.get("model_type") not in METADATA_MODEL_TYPES:
            raise DataError(f"--tokenizer-metadata {path}: a custom tokenizer class or model_type "
                            f"{metadata.get('model_type')!r} cannot be reproduced here; remove them from the file")

    def _check_remote_code(self) -> None:
        """--trust-remote-code: fine when the tokenizer has no code of its own; refused when it has."""
        if self.tokenizer_type != "HuggingFaceTokenizer" or not self.tokenizer_model:
            return
        folder = Path(self.tokenizer_model)
        config = folder / "tokenizer_config.json" if folder.is_dir() else folder.parent / "tokenizer_config.json"
        try:
            auto_map = json.loads(config.read_text(encoding="utf-8")).get("auto_map") or {}
        except (OSError, ValueError, AttributeError):
            return  # no config, or one the loader names itself
        if "AutoTokenizer" in auto_map:
            raise DataError(f"--trust-remote-code: {self.tokenizer_model} tokenizes with its own Python code "
                            f"({auto_map['AutoTokenizer']}), which megatron-jreg never runs; save it as a fast "
                            "tokenizer (tokenizer.json) and drop --trust-remote-code")

    def notes(self) -> list[str]:
        """One line per given flag that, as in Megatron-LM, changes nothing in the data."""
        defaults = tokenizer_defaults()
        given = {k: v for k, v in {**self.tokenizer, "tokenizer_model": self.tokenizer_model}.items()
                 if v != defaults.get(k)}
        notes = [f"note: {flag} does not apply to --tokenizer-type {self.tokenizer_type}: no effect"
                 for name, (flag, types) in APPLIES.items() if name in given and self.tokenizer_type not in types]
        notes += [f"note: {flag} {why}: no effect on the data (as in Megatron-LM)"
                  for name, (flag, why) in NO_EFFECT.items() if name in given]
        if given.get("trust_remote_code"):
            notes.append("note: --trust-remote-code: the tokenizer has no code of its own here: no effect")
        if self.partitions > 1:
            notes.append(f"note: --partitions {self.partitions} with --keep-sequential-samples keeps the input "
                         "order: no effect")
        if self.workers_to_check != [16, 32, 64]:
            notes.append("note: --workers-to-check is the list of --find-optimal-num-workers, not run here: no effect")
        return notes

    @property
    def level(self) -> str:
        return "sentence" if self.split_sentences else "document"

    def tokenizer_args(self) -> Any:
        """Megatron-LM's tokenizer args (an argparse Namespace), for megatron-core's `build_tokenizer`."""
        return megatron_args(self.tokenizer_type, self.tokenizer_model, **self.tokenizer)
