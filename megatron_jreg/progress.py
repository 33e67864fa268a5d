"""The progress bar every command shows on stderr (tqdm, as Megatron-LM's tools and lm-eval's models do)."""

from __future__ import annotations

import sys
from typing import Any


def show_progress(flag: bool | None) -> bool:
    """--progress/--no-progress, or by default whether stderr is a terminal (a bar redrawn into a log file only
    grows it)."""
    return sys.stderr.isatty() if flag is None else flag


def progress_bar(total: int, desc: str, unit: str, enabled: bool) -> Any:
    """A tqdm bar on stderr with its rate and time left (a no-op one when not `enabled`); use as a context
    manager, `update(n)` per step."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, disable=not enabled, file=sys.stderr,
                dynamic_ncols=True)
