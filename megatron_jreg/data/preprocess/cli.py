"""`megatron-jreg preprocess` / `tools/preprocess_data.py`: Megatron-LM's tools/preprocess_data.py parser
(core_v0.19.0) plus megatron-jreg's flags, read and checked before torch and megatron-core load (the driver, which
loads them, is imported only to run), so that `--help` and a bad flag answer at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from megatron_jreg.data.checks import describe_skips
from megatron_jreg.data.preprocess.config import PreprocessConfig
from megatron_jreg.data.tokenizer_flags import add_tokenizer_args, tokenizer_defaults
from megatron_jreg.errors import Interrupted, run_command
from megatron_jreg.usage import OneLineParser, example

PROG = "megatron-jreg preprocess"


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
    add_tokenizer_args(p)
    g = p.add_argument_group("input data")
    g.add_argument("--input", nargs="+", required=True, help="file(s), directories or globs")
    g.add_argument("--json-keys", nargs="+", default=["text"],
        help="keys (parquet columns) to tokenize (default: %(default)s)")
    g.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (nltk Punkt)")
    g.add_argument("--keep-newlines", action="store_true", help="keep newlines between split sentences")
    g.add_argument("--hf-split", default=None, help="split of a saved HF DatasetDict folder (default train)")
    g = p.add_argument_group("tokenization process")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each doc")
    g.add_argument("--lang", default="english",
        help="nltk Punkt language, punkt_tab data in NLTK_DATA (default: %(default)s)")
    g = p.add_argument_group("filters")
    g.add_argument("--min-int-score", type=int, default=None,
        help="keep FineWeb-Edu docs with int_score >= N (default: all)")
    g.add_argument("--min-chars", type=int, default=0,
        help="skip documents shorter than N characters (default: %(default)s)")
    g.add_argument("--max-docs", type=int, dest="max_documents", action=_RenamedFlag, help=argparse.SUPPRESS)
    g.add_argument("--on-error", choices=("skip", "fail"), default="skip",
                   help="bad records: skip and count (default) or stop naming file and line")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="path prefix, no suffix")
    g.add_argument("--output-shards", type=int, default=1,
        help="write N shards, groups of whole input files (default: %(default)s)")
    g.add_argument("--shard-ids", type=int, nargs="+", default=None,
        help="only these shards, one node's share (default: all)")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1,
        help="tokenizer processes; use the number of cores (default: %(default)s)")
    g.add_argument("--find-optimal-num-workers", action="store_true", help="Megatron-LM's; refused here")
    g.add_argument("--workers-to-check", nargs="+", type=int, default=[16, 32, 64],
        help="Megatron-LM's; no effect (default: %(default)s)")
    g.add_argument("--max-documents", type=int, default=None,
                   help="stop after N kept documents, in input order (default: all)")
    g.add_argument("--partitions", type=int, default=1, help="Megatron-LM's; only 1 (or with "
                   "--keep-sequential-samples, which keeps the input order; default: %(default)s)")
    g.add_argument("--log-interval", type=int, default=1000,
        help="progress line every N documents (default: %(default)s)")
    g.add_argument("--keep-sequential-samples", action="store_true", help="with --partitions: the input order")
    g.add_argument("--block-mb", type=float, default=1.0, help="JSONL work unit size in MB (default: %(default)s)")
    return p


def config_from_args(args: argparse.Namespace) -> PreprocessConfig:
    """Our flags by field name; Megatron-LM's other tokenizer flags, where given, in `tokenizer`."""
    ours = {f.name for f in dataclasses.fields(PreprocessConfig)}
    defaults = tokenizer_defaults()
    tokenizer = {k: v for k, v in vars(args).items() if k in defaults and k not in ours and v != defaults[k]}
    return PreprocessConfig(**{k: v for k, v in vars(args).items() if k in ours}, tokenizer=tokenizer)


def _run(cfg: PreprocessConfig) -> int:
    cfg.validate()  # the flags are checked before torch and megatron-core load (with the driver)
    for note in cfg.notes():
        print(note, file=sys.stderr)
    from megatron_jreg.data.indexed import manifest_path
    from megatron_jreg.data.preprocess.driver import preprocess

    summary = preprocess(cfg)
    print(
        f"done: {summary['documents']:,} documents, {summary['tokens']:,} tokens ({summary['dtype']}, "
        f"{summary['level']} level, tokenizer backend {summary['tokenizer_backend']}) in {summary['elapsed_s']:.1f}s "
        f"({summary['text_mb_per_s']:.2f} MB/s text, {summary['tokens_per_s'] / 1e6:.2f}M tokens/s)"
    )
    print(describe_skips(summary["skipped"], summary["skipped_examples"]))
    if summary["sentence_splitter"]:
        print(f"sentence splitter: {summary['sentence_splitter']}")
    for prefix in summary["outputs"]:
        print(f"output: {prefix}.bin/.idx (manifest {manifest_path(prefix)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    def body() -> int:
        try:
            return _run(config_from_args(build_parser().parse_args(argv)))
        except KeyboardInterrupt:  # before any shard was started (the driver reports one during the work)
            raise Interrupted("interrupted before any output was written; run the command again") from None

    return run_command(PROG, body)
