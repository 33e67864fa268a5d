"""Bad input ends in one line: the checks and the error handling the data commands share.

preprocess, train-tokenizer, merge-datasets and prepare-chat answer bad input with one line on stderr that
names the file or flag and the fix, and exit status 2 (as argparse for a bad flag), never a traceback; a
failure of the machine rather than the input (a full disk, an I/O error) exits 1. They check what they can
(flags, the output folder) before any work. `DataError` is what the library raises for such input,
`OneLineParser` makes argparse's usage errors one line too, `run_command` turns the expected exceptions
into that line, and `check_output_prefix` / `check_positive` are the shared up-front checks.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


class DataError(ValueError):
    """Bad input or configuration; the message names the file or flag and the fix."""


class OneLineParser(argparse.ArgumentParser):
    """argparse with usage errors on one line (`prog: error: ... (see --help)`), exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def one_line(message: str) -> str:
    """A message with any line breaks (e.g. from a library) folded into one line."""
    return " | ".join(part.strip() for part in str(message).splitlines() if part.strip())


INPUT_OS_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def run_command(prog: str, body: Callable[[], int]) -> int:
    """Run a command body; expected failures become `prog: error: <one line>`: exit status 2 for bad input
    (a usage error, as argparse's), 1 when the machine failed (a full disk, an I/O error)."""
    status = 2
    try:
        return body()
    except ValueError as e:
        message = str(e)
    except OSError as e:  # name the file
        message = f"{e.filename}: {e.strerror}" if e.filename else str(e)
        status = 2 if isinstance(e, INPUT_OS_ERRORS) else 1
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
    return status


def check_positive(flag: str, value: float | None, minimum: float = 1, allow_none: bool = True) -> None:
    """`value` is a finite number >= `minimum` (None allowed when `allow_none`), else a DataError naming `flag`."""
    if value is None and allow_none:
        return
    if value is None or isinstance(value, bool) or not math.isfinite(value) or value < minimum:
        raise DataError(f"{flag} must be a finite number >= {minimum:g}, got {value}")


def check_output_prefix(prefix: str, flag: str = "--output-prefix") -> Path:
    """The folder `prefix` writes into, created and proven writable before any work starts."""
    path = Path(prefix)
    if not prefix or prefix.endswith(("/", os.sep)) or path.is_dir():
        raise DataError(f"{flag} {prefix!r} is a folder; give a path prefix inside it, e.g. {path / 'name'}")
    return check_output_folder(path.parent, f"{flag} {prefix}")


def check_output_folder(folder: Path, what: str) -> Path:
    """Create `folder` if needed and write a probe file there; a DataError names `what` otherwise."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise DataError(f"{what}: {existing} is a file, not a folder; choose another output path")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as e:
        raise DataError(
            f"{what}: cannot write in {folder} ({e.strerror}); choose a writable folder or fix its permissions"
        ) from None
    return folder
