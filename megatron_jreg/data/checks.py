"""Bad input ends in one line naming the file or flag and the fix, before any work where possible: the error
type, up-front checks and skip summaries the data commands share (the exit codes: megatron_jreg.errors).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import warnings
from pathlib import Path
from typing import Any

from megatron_jreg.errors import JregError
from megatron_jreg.fileio import check_output_folder


class DataError(JregError, ValueError):
    """Bad input or configuration; the message names the file or flag and the fix."""


def check_positive(flag: str, value: float | None, minimum: float = 1, allow_none: bool = True) -> None:
    """`value` is a finite number >= `minimum` (None allowed when `allow_none`), else a DataError naming `flag`."""
    if value is None and allow_none:
        return
    if value is None or isinstance(value, bool) or not math.isfinite(value) or value < minimum:
        raise DataError(f"{flag} must be a finite number >= {minimum:g}, got {value}")


def check_output_prefix(prefix: str, flag: str = "--output-prefix", what: str = "a path prefix",
                        example: str = "name") -> Path:
    """The folder the file (or files) `prefix` names go into, created and proven writable before any work."""
    path = Path(prefix)
    if not prefix or prefix.endswith(("/", os.sep)) or path.is_dir():
        raise DataError(f"{flag} {prefix!r} is a folder; give {what} inside it, e.g. {path / example}")
    return check_output_folder(path.parent, f"{flag} {prefix}", create=True)


def describe_skips(skipped: dict[str, int], examples: dict[str, list[str]]) -> str:
    """`skipped: reason n (e.g. file:line); ...` on one line: a command's summary of the records it skipped."""
    if not skipped:
        return "skipped: none"
    return "skipped: " + "; ".join(f"{r} {n:,} (e.g. {examples[r][0]})" for r, n in sorted(skipped.items()))


def skip_counts(skipped: dict[str, int]) -> str:
    """`reason n, ...` (or "no records"), for the error of a run that found nothing usable."""
    return ", ".join(f"{r} {n:,}" for r, n in sorted(skipped.items())) or "no records"


@functools.cache
def megatron_package() -> Any:
    """The `megatron` package (megatron-core's tokenizers and indexed datasets), imported once without the
    notices megatron-core gives without CUDA, Transformer Engine or Apex: a command's output stays its own."""
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime is found"
    logging.getLogger("megatron.core.datasets.indexed_dataset").setLevel(logging.WARNING)  # a line per index read
    warnings.filterwarnings("ignore", "Could not determine rank", UserWarning)  # a lone process: rank 0, rightly
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.datasets.indexed_dataset
        import megatron.core.tokenizers.utils.build_tokenizer

    return megatron
