"""`megatron-jreg <command> [flags]`: one console script; each command's `main(argv) -> int` is imported lazily, so a
light command never pays for importing megatron-core."""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("megatron_jreg.train", "Megatron-LM's pretrain_gpt.py with JREG (its flags, plus --jreg-*)"),
    "preprocess": ("megatron_jreg.data.preprocess", "FineWeb-Edu / JSONL / parquet -> indexed .bin/.idx"),
    "train-tokenizer": ("megatron_jreg.data.train_tokenizer", "train a SentencePiece or HF BPE tokenizer"),
    "merge-datasets": ("megatron_jreg.data.merge", "merge indexed dataset shards"),
    "prepare-chat": ("megatron_jreg.data.prepare_chat",
                     "check chat JSONL for --sft; a tokenizer copy with a chat template"),
    "analyze": ("megatron_jreg.analysis.cli", "measure Ψ and jump rates ζ of HF, GGUF or megatron models"),
    "convert": ("megatron_jreg.convert.cli", "convert checkpoints between megatron-jreg and Hugging Face"),
    "evaluate": ("megatron_jreg.evaluate.cli", "LAMBADA and lm-eval tasks on a checkpoint"),
    "compare": ("megatron_jreg.evaluate.compare", "paired t-test of baseline vs JREG result files"),
    "generate": ("megatron_jreg.generate.cli", "chat answers to MT-bench-format questions, for FastChat's judge"),
    "lm-eval": ("megatron_jreg.evaluate.lm_eval_model", "lm-eval's own CLI with --model megatron-jreg registered"),
}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    from megatron_jreg import __version__

    try:
        core = installed("megatron-core")
    except PackageNotFoundError:
        core = "not installed"
    return f"megatron-jreg {__version__} (megatron-core {core})"


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: megatron-jreg <command> [flags]   (megatron-jreg <command> --help; megatron-jreg --version)",
             "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "example:", "  megatron-jreg analyze --model path/to/hf-model --output jump_analysis"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run one command; its stdout failing (`| head`, a full disk) does not stop it (`errors.keep_output`)."""
    from megatron_jreg.errors import keep_output, output_code

    argv = list(sys.argv[1:] if argv is None else argv)
    keep_output(f"megatron-jreg {argv[0]}" if argv and argv[0] in COMMANDS else "megatron-jreg")
    try:
        return output_code(_dispatch(argv))
    except SystemExit as e:  # argparse's --help and usage errors
        if isinstance(e.code, int) or e.code is None:
            raise SystemExit(output_code(e.code or 0)) from None
        raise


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(version())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        near = difflib.get_close_matches(name, COMMANDS, n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        print(f"megatron-jreg: unknown command {name!r}{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
