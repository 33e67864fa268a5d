"""Every command's errors: one base class, one exit-code convention, one way to print them.

Bad input (a flag, a file, a model folder, a checkpoint) raises a `JregError` whose message is one line naming
the flag or file and the fix; `exit_code` is 2 for usage and input errors (argparse's convention, in every
command) and 1 when the run or the machine failed (a full disk, a lost rank). `error_line` formats any error
the same way, and `report` (through `run_command`, or the train entry's per-rank handler) is the one place where
a command turns them into that line and its exit code.
The layer below every other module: it imports nothing from megatron_jreg.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

USAGE = 2  # bad flag or input: the message names it and the fix
FAILED = 1  # the run or the machine failed (full disk, a lost rank, a verification that did not pass)
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, the shell's convention)


class JregError(Exception):
    """Base of megatron-jreg's own errors: a one-line message and the exit code it ends the command with."""

    exit_code: int = USAGE


class UsageError(JregError, ValueError):
    """A bad flag or input; the message names it and the fix (printed as one line, exit 2)."""


class Interrupted(JregError):
    """Ctrl-C, reported as one line saying where the run stopped and how to resume it (exit 130)."""

    exit_code = INTERRUPTED


class ModelFileError(JregError, ValueError):
    """A model on disk that cannot be used as it is; the message is one line naming the path and the fix."""


class IncompleteWeightsError(ModelFileError):
    """A model folder whose weight files do not match its architecture (missing or unexpected tensors)."""


class BadConfigError(ModelFileError):
    """A config.json that is not JSON, or not a model config."""


def one_line(message: object, limit: int | None = None) -> str:
    """A message (or an exception's) with any line breaks from a library folded into one line, optionally
    shortened to `limit` characters: library errors can span pages."""
    text = " | ".join(part.strip() for part in str(message).splitlines() if part.strip())
    if not text and isinstance(message, BaseException):
        text = type(message).__name__
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."


INPUT_OS_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def exit_code(error: BaseException) -> int:
    """The convention: a JregError's own code; other ValueErrors and unreadable inputs are input errors (2);
    any other OSError is the machine's (1)."""
    if isinstance(error, JregError):
        return error.exit_code
    if isinstance(error, OSError) and not isinstance(error, INPUT_OS_ERRORS):
        return FAILED
    return USAGE


def error_line(prog: str, error: BaseException) -> str:
    """`prog: error: <one line>`; an OSError names its file."""
    if isinstance(error, OSError) and not isinstance(error, JregError) and error.filename:
        message = f"{error.filename}: {error.strerror}"
    else:
        message = str(error)
    return f"{prog}: error: {one_line(message)}"


def report(prog: str, error: BaseException, debug: bool = False) -> int:
    """Print `error_line` (after the traceback behind it, with `debug`) on stderr; return `exit_code`."""
    if debug:
        import traceback

        traceback.print_exception(error.__cause__ or error, file=sys.stderr)
    print(error_line(prog, error), file=sys.stderr)
    return exit_code(error)


def run_command(prog: str, body: Callable[[], int]) -> int:
    """Run a command body; expected failures (JregError, ValueError, OSError) are `report`ed."""
    try:
        return body()
    except (JregError, ValueError, OSError) as e:
        return report(prog, e)
