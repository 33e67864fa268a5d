"""Megatron-LM args of a model, parsed and validated by its own code with failures as one line: every command
rebuilds a model from a checkpoint's args, and convert makes them from flags (`model_args`)."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from megatron_jreg import layer_spec
from megatron_jreg.errors import UsageError
from megatron_jreg.plugin import JregConfig


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_model_flags(group: argparse._ArgumentGroup) -> None:
    """The flags of ours a checkpoint's args keep."""
    JregConfig.add_flags(group)
    layer_spec.add_flag(group)


def _model_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's parser with `add_model_flags`; its errors a UsageError (not its 800-flag usage)."""

    def error(message: str) -> None:
        raise UsageError(message)

    parser.error = error  # type: ignore[method-assign]
    add_model_flags(parser.add_argument_group("megatron-jreg"))
    return parser


def assertion_text(e: BaseException, args: argparse.Namespace | None = None) -> str:
    """One line for an exception from Megatron-LM's validation: a bare `assert` as its check, names as flags."""
    import traceback

    text = " ".join(str(e).split())
    if text:
        if args is not None:
            text = re.sub(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b",
                          lambda m: flag(m.group(0)) if hasattr(args, m.group(0)) else m.group(0), text)
        return text
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return type(e).__name__
    frame = frames[-1]
    check = re.sub(r"^assert\s+", "", (frame.line or "").strip())
    check = re.sub(r"args\.([a-z0-9_]+)", lambda m: flag(m.group(1)), check)
    return f"Megatron-LM's argument check `{check}` failed ({Path(frame.filename).name}:{frame.lineno})"


def check_model_config(args: argparse.Namespace) -> None:
    """megatron-core's TransformerConfig checks, which Megatron-LM's validate_args leaves to the model build."""
    from megatron.training.argument_utils import core_transformer_config_from_args

    try:
        core_transformer_config_from_args(args)
    except (AssertionError, ValueError, TypeError) as e:
        raise UsageError(assertion_text(e, args)) from None


def model_args(argv: list[str], vocab_size: int, world_size: int = 1) -> argparse.Namespace:
    """A checkpoint's `args` for a model described by flags alone (an import); `world_size`: TP×PP to check against."""
    import contextlib
    import io
    from unittest import mock

    import torch
    from megatron.training import arguments
    from megatron.training.vocab_utils import calculate_padded_vocab_size

    from megatron_jreg.compat import apply_cpu_training_compat

    # validation checks the layout against a world of TP×PP ranks, as a training launch sets it up
    launch = {"RANK": "0", "WORLD_SIZE": str(world_size), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    try:
        with mock.patch.dict(os.environ, launch):
            # Megatron-LM's validation asks for a micro-batch size even when nothing trains.
            argv = ["megatron-jreg", "--micro-batch-size", "1", *argv, "--vocab-size", str(vocab_size),
                    "--transformer-impl", "local"]
            with mock.patch.object(sys, "argv", argv):  # Megatron-LM's parse_args reads sys.argv
                args = arguments.parse_args(extra_args_provider=_model_parser)
            if not torch.cuda.is_available():
                apply_cpu_training_compat(args)
            with contextlib.redirect_stdout(io.StringIO()):
                arguments.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
            check_model_config(args)
    except (AssertionError, ValueError, TypeError) as e:
        raise UsageError(assertion_text(e)) from None
    args.padded_vocab_size = calculate_padded_vocab_size(
        vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size, logging_enabled=False)
    return args
