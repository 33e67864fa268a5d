"""train's flags: Megatron-LM's own parser plus ours through its `extra_args_provider`, so every pretrain_gpt.py
flag keeps its meaning; `--model-preset` expands before the user's flags, which override it."""

from __future__ import annotations

import argparse
import collections
import re
import sys
from unittest import mock

from megatron_jreg import layer_spec
from megatron_jreg.errors import UsageError
from megatron_jreg.plugin import JregConfig

PROG = "megatron-jreg train"

# Llama architecture flags common to the presets (RoPE, RMSNorm, SwiGLU, no biases, no dropout).
_LLAMA = ("--position-embedding-type rope --normalization RMSNorm --norm-epsilon 1e-5 --swiglu "
          "--disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02 "
          "--group-query-attention")
# The paper gives layers × hidden (12×768, 16×2048, 30×3072) and the names 170M/1B/3.4B. Heads, query
# groups, FFN width, RoPE base and tied embeddings are our choice, following Llama-3.2 (1B: 16×2048, 32
# heads, 8 KV heads, FFN 8192; 3B: 24 heads, 8 KV heads, FFN 8192). The vocabulary comes from the tokenizer,
# so the parameter count does too (tied embeddings): with the Llama-3 tokenizer (128,256 tokens) 174.0M,
# 1.24B and 3.41B, matching the paper's names; with the 32,000-token SentencePiece model the docs' recipe
# trains, 100.1M, 1.04B and 3.12B (docs/results/preset_params.txt, from benchmarks/preset_params.py).
PRESETS: dict[str, str] = {
    "tiny": "--num-layers 4 --hidden-size 128 --ffn-hidden-size 352 --num-attention-heads 4 --num-query-groups 2 "
            "--seq-length 128 --max-position-embeddings 128 --rotary-base 10000",
    "llama-170m": "--num-layers 12 --hidden-size 768 --ffn-hidden-size 2048 --num-attention-heads 12 "
                  "--num-query-groups 4 --seq-length 2048 --max-position-embeddings 2048 --rotary-base 500000",
    "llama-1b": "--num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 32 "
                "--num-query-groups 8 --seq-length 2048 --max-position-embeddings 2048 --rotary-base 500000",
    "llama-3.4b": "--num-layers 30 --hidden-size 3072 --ffn-hidden-size 8192 --num-attention-heads 24 "
                  "--num-query-groups 8 --seq-length 2048 --max-position-embeddings 2048 --rotary-base 500000",
}


def preset_flags(name: str) -> list[str]:
    return (PRESETS[name] + " " + _LLAMA).split()


def expand_preset(argv: list[str]) -> list[str]:
    for i, arg in enumerate(argv):
        if arg.startswith("--model-preset=") or (arg == "--model-preset" and i + 1 < len(argv)):
            name = arg.split("=", 1)[1] if "=" in arg else argv[i + 1]
            if name not in PRESETS:
                raise UsageError(f"--model-preset {name!r} is unknown: choose one of {', '.join(PRESETS)}")
            return preset_flags(name) + argv
    return argv


EXAMPLE = ("megatron-jreg train --model-preset tiny --transformer-impl local --mock-data --tokenizer-type "
           "NullTokenizer --vocab-size 512 \\\n    --micro-batch-size 2 --global-batch-size 8 --train-iters 20 "
           "--lr 1e-3 --eval-interval 10 --eval-iters 2 --jreg-lambda 1")


def add_jreg_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's `extra_args_provider`: our flags, one-line argparse errors, a help that prints."""
    from megatron_jreg.usage import example

    parser.prog = PROG
    for action in parser._actions:  # a bare `%` in a help text (megatron-core 0.19.2 has one) makes --help raise
        if isinstance(action.help, str):
            try:
                action.help % collections.defaultdict(str)
            except (ValueError, TypeError, KeyError):
                action.help = re.sub(r"%%|%\(\w+\)[a-z]|%", lambda m: m[0] if len(m[0]) > 1 else "%%", action.help)
    for key, value in example(EXAMPLE).items():
        setattr(parser, key, value)

    def error(message: str) -> None:  # argparse would print Megatron-LM's 800-flag usage first
        raise UsageError(message)

    parser.error = error  # type: ignore[method-assign]
    g = parser.add_argument_group("megatron-jreg", "JREG and what megatron-jreg adds to Megatron-LM")
    JregConfig.add_flags(g)  # with --layernorm-scaling, what a checkpoint's args keep (checkpoints/args.py)
    layer_spec.add_flag(g)
    g.add_argument("--model-preset", choices=sorted(PRESETS), default=None,
                   help="the paper's architectures (Llama-3.2 proportions) as flags; explicit flags override")
    g.add_argument("--metrics-file", default=None,
                   help="append one JSON object per logged iteration and validation (Ψ, ζ, losses) here")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar on stderr, its rate Megatron-LM's elapsed time per iteration (default: when "
                        "stderr is a terminal and --log-interval > 1)")
    g.add_argument("--init-mode", choices=["megatron", "layout-independent"], default="megatron",
                   help="layout-independent: draw every weight from its global tensor, so one seed gives one "
                        "model at every TP/PP/VPP layout (default: Megatron-LM's own init)")
    g.add_argument("--no-exit-signal-handler", dest="jreg_no_exit_signal_handler", action="store_true",
                   help="SIGTERM kills the run (default here: save a checkpoint and exit 0, Megatron-LM's "
                        "--exit-signal-handler, for Slurm preemption)")
    g.add_argument("--allow-cpu", action="store_true",
                   help="train on the CPU (gloo) when CUDA is not usable, also where a GPU is expected (NVIDIA "
                        "devices, CUDA_VISIBLE_DEVICES, a Slurm GPU allocation, several nodes), which is refused "
                        "otherwise; a machine with no sign of a GPU trains on the CPU without it")
    g.add_argument("--no-verify-integrity", dest="jreg_no_verify_integrity", action="store_true",
                   help="do not record SHA-256 digests at save nor verify them at load (default here: every rank "
                        "digests the files it wrote before the tracker names the save, and verifies its share at "
                        "load)")
    g.add_argument("--overwrite-save", dest="jreg_overwrite_save", action="store_true",
                   help="write into a --save folder that holds another run's checkpoints without --load of it "
                        "(refused otherwise): its iter_* folders and tracker are first moved into "
                        "SAVE/overwritten-DATE/")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    argv = expand_preset(list(argv))
    if any(a == "--yaml-cfg" or a.startswith("--yaml-cfg=") for a in argv):  # Megatron-LM loads it while parsing
        raise UsageError("--yaml-cfg is not supported by megatron-jreg train: give the flags on the command line")
    from megatron.training import arguments

    with mock.patch.object(sys, "argv", [PROG, *argv]):  # Megatron-LM's parse_args reads sys.argv
        return arguments.parse_args(extra_args_provider=add_jreg_args)
