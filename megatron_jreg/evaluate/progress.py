"""The progress bar evaluate and generate show on stderr (tqdm, as train, analyze and lm-eval's own models do)."""

from __future__ import annotations

import sys
from typing import Any


def show_progress(flag: bool | None) -> bool:
    """--progress/--no-progress, or by default whether stderr is a terminal (a bar redrawn into a log file only
    grows it)."""
    return sys.stderr.isatty() if flag is None else flag


def progress_bar(total: int, desc: str, unit: str, enabled: bool) -> Any:
    """A tqdm bar on stderr (a no-op one when not `enabled`); use as a context manager, `update(n)` per step."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, file=sys.stderr, dynamic_ncols=True)
