"""`megatron-jreg preprocess` / `tools/preprocess_data.py`: the command line over `preprocess()`.

Every flag of Megatron-LM's tools/preprocess_data.py (core_v0.19.0: its tokenizer group and its own
options) is accepted with its meaning and default, in its argument groups; megatron-jreg's own flags
follow. Two defaults are relaxed, not changed: `--workers` is optional (1) and `--input` takes several
files, directories or globs. Bad input ends in one line (see `megatron_jreg.data.checks`).
"""

from __future__ import annotations

import argparse
import sys

from megatron_jreg.data.manifest import manifest_path
from megatron_jreg.data.preprocess.config import TRIAL_DOCUMENTS, PreprocessConfig
from megatron_jreg.data.preprocess.driver import describe_skips, preprocess
from megatron_jreg.data.preprocess.optimal_workers import describe, find_optimal_num_workers
from megatron_jreg.data.tokenizers import MEGATRON_TOKENIZER_TYPES
from megatron_jreg.errors import run_command
from megatron_jreg.usage import OneLineParser, example

PROG = "megatron-jreg preprocess"


def _add_megatron_tokenizer_flags(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's tokenizer group (megatron.training.config.TokenizerConfig), same names and defaults."""
    g = p.add_argument_group("tokenizer")
    g.add_argument("--vocab-size", type=int, default=None, help="TikTokenizer/NullTokenizer vocabulary size")
    g.add_argument("--padded-vocab-size", type=int, default=None, help="training only: no effect on data")
    g.add_argument(
        "--no-pad-vocab-size",
        "--disable-pad-vocab-size",
        dest="pad_vocab_size",
        action="store_false",
        help="training only: no effect on data",
    )
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer merges.txt")
    g.add_argument("--vocab-extra-ids", type=int, default=0, help="T5 training only: no effect on data")
    g.add_argument("--tokenizer-type", required=True, choices=MEGATRON_TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", default=None, help=".model file, HF folder, or tiktoken file")
    g.add_argument(
        "--tokenizer-metadata",
        default=None,
        help="Megatron-LM tokenizer metadata JSON; its library must match --tokenizer-type",
    )
    g.add_argument(
        "--tokenizer-special-tokens",
        nargs="+",
        default=None,
        help="HF/GPT-2: added special tokens; TikTokenizer: the special list; SentencePiece: with legacy",
    )
    g.add_argument("--tiktoken-pattern", choices=("v1", "v2"), default=None, help="TikTokenizer pattern (v2)")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)
    g.add_argument(
        "--tokenizer-sentencepiece-legacy",
        action="store_true",
        help="SentencePiece: Megatron-LM's legacy wrapper (special tokens inside the text)",
    )
    g.add_argument(
        "--no-tokenizer-sentencepiece-ignore-extra-whitespaces",
        "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces",
        dest="tokenizer_sentencepiece_ignore_extra_whitespaces",
        action="store_false",
        help="SentencePiece: keep runs of spaces the model would collapse",
    )
    g.add_argument("--tokenizer-hf-no-use-fast", action="store_true", help="no effect with transformers 5")
    g.add_argument(
        "--tokenizer-hf-no-include-special-tokens",
        action="store_true",
        help="HF: leave out post-processor ids such as a BOS",
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted; a tokenizer with its own Python code is refused (never run)",
    )
    g.add_argument("--null-tokenizer-eod-id", type=int, default=None, help="NullTokenizer eod (vocab_size - 1)")
    g.add_argument("--null-tokenizer-pad-id", type=int, default=-1, help="NullTokenizer pad (-1: none)")
    g.add_argument("--chat-template", default=None, help="chats only: no effect on documents")


class _RenamedFlag(argparse.Action):
    """`--max-docs` (megatron-jreg 0.1) is `--max-documents`, Megatron-LM's name for the same count: one
    flag in --help, and 0.1 command lines still run, with a note (to be removed in 0.2)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        print(f"note: {option_string} is deprecated: use --max-documents (Megatron-LM's name)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=PROG,
        description="Tokenize FineWeb-Edu parquet, HF dataset folders or JSONL(.gz/.zst) into megatron-core "
        "indexed datasets (PREFIX_text_document.bin/.idx), like Megatron-LM's tools/preprocess_data.py.",
        **example("megatron-jreg preprocess --input wikitext.jsonl --output-prefix data/wikitext --tokenizer-type "
                  "HuggingFaceTokenizer \\\n    --tokenizer-model data/bpe4k --append-eod --workers 2"),
    )
    _add_megatron_tokenizer_flags(p)
    g = p.add_argument_group("input data")
    g.add_argument("--input", nargs="+", required=True, help="file(s), directories or globs")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys (parquet columns) to tokenize")
    g.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (nltk Punkt)")
    g.add_argument("--keep-newlines", action="store_true", help="keep newlines between split sentences")
    g.add_argument("--hf-split", default=None, help="split of a saved HF DatasetDict folder (default train)")
    g.add_argument("--punkt-model", default=None, help="punkt_tab/<lang> folder (or an nltk_data root)")
    g.add_argument(
        "--punkt-train-chars",
        type=int,
        default=1_000_000,
        help="without a Punkt model: train Punkt on this many input characters",
    )
    g = p.add_argument_group("tokenization process")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each doc")
    g.add_argument("--lang", default="english", help="Punkt model language to look up in nltk's data path")
    g = p.add_argument_group("filters")
    g.add_argument(
        "--min-int-score", type=int, default=None, help="keep FineWeb-Edu docs with int_score >= N"
    )
    g.add_argument("--min-chars", type=int, default=0, help="skip documents shorter than N characters")
    g.add_argument("--max-docs", type=int, dest="max_documents", action=_RenamedFlag, help=argparse.SUPPRESS)
    g.add_argument(
        "--on-error",
        choices=("skip", "fail"),
        default="skip",
        help="bad records: skip and count (default) or stop naming file and line",
    )
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="path prefix, no suffix")
    g.add_argument(
        "--output-shards", type=int, default=1, help="write N shards (groups of whole input files)"
    )
    g.add_argument(
        "--shard-ids", type=int, nargs="+", default=None, help="only these shards (split a run across nodes)"
    )
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes (use the number of cores)")
    g.add_argument(
        "--find-optimal-num-workers",
        action="store_true",
        help="only measure: time --workers-to-check on --max-documents documents and rank them",
    )
    g.add_argument("--workers-to-check", nargs="+", type=int, default=[16, 32, 64])
    g.add_argument("--max-documents", type=int, default=None,
                   help="stop after N kept documents, in input order (default: all); with "
                   f"--find-optimal-num-workers: documents per trial (default {TRIAL_DOCUMENTS:,}, as Megatron-LM)")
    g.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="Megatron-LM's document order for N partitions (records dealt round-robin)",
    )
    g.add_argument("--log-interval", type=int, default=1000, help="progress line every N documents")
    g.add_argument(
        "--keep-sequential-samples", action="store_true", help="with --partitions: keep the input order"
    )
    g.add_argument("--block-mb", type=float, default=1.0, help="JSONL work unit size in MB")
    return p


def config_from_args(args: argparse.Namespace) -> PreprocessConfig:
    names = PreprocessConfig.__dataclass_fields__
    return PreprocessConfig(**{k: v for k, v in vars(args).items() if k in names})


def _run(cfg: PreprocessConfig) -> int:
    cfg.validate()
    for note in cfg.notes():
        print(note, file=sys.stderr)
    if cfg.find_optimal_num_workers:
        print("\n".join(describe(find_optimal_num_workers(cfg))))
        print("(measured only: nothing was written at --output-prefix; run again with the best --workers)")
        return 0
    summary = preprocess(cfg)
    print(
        f"done: {summary['documents']:,} documents, {summary['tokens']:,} tokens ({summary['dtype']}, "
        f"{summary['level']} level, tokenizer backend {summary['tokenizer_backend']}) "
        f"in {summary['elapsed_s']:.1f}s "
        f"({summary['text_mb_per_s']:.2f} MB/s text, {summary['tokens_per_s'] / 1e6:.2f}M tokens/s)"
    )
    print(describe_skips(summary["skipped"], summary["skipped_examples"]))
    if summary["sentence_splitter"]:
        print(f"sentence splitter: {summary['sentence_splitter']['source']}")
    for prefix in summary["outputs"]:
        print(f"output: {prefix}.bin/.idx (manifest {manifest_path(prefix)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(PROG, lambda: _run(config_from_args(args)))
