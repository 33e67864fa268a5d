"""The progress bar every command shows on stderr (tqdm, as Megatron-LM's tools and lm-eval's models do)."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any


def show_progress(flag: bool | None) -> bool:
    """--progress/--no-progress, or by default whether stderr is a terminal (a bar in a log file only grows it)."""
    return sys.stderr.isatty() if flag is None else flag


def progress_bar(total: int, desc: str, unit: str, enabled: bool) -> Any:
    """A tqdm bar on stderr with its rate and time left (a no-op one when not `enabled`), a context manager."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, disable=not enabled, file=sys.stderr,
                dynamic_ncols=True)


@contextlib.contextmanager
def library_bars(enabled: bool) -> Iterator[None]:
    """transformers' own bars while a model loads only when `enabled`: its weight-loading bar and GGUF
    de-quantizing bar, a plain tqdm that `disable_progress_bar` does not reach (so swapped for a disabled one)."""
    if enabled:
        yield
        return
    from transformers.utils import logging as hf_logging

    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # a transformers without GGUF support draws no such bar
        gguf_utils = None
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if shown:
            hf_logging.enable_progress_bar()
