"""Every command's errors: one base class, one exit-code convention (2 bad input, 1 run failed, 130 Ctrl-C), one line
naming the flag or file and the fix; a failing stdout is not an error of the run (DEVELOPERS.md, "Errors")."""

from __future__ import annotations

import errno
import io
import os
import sys
from collections.abc import Callable
from typing import Any

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


def ignore_further_interrupts() -> None:
    """Once a command stops for a Ctrl-C, a further Ctrl-C is ignored until it exits: raised as KeyboardInterrupt it
    would land in the teardown or in torch's DataLoader shutdown at exit, each a traceback after the command's own
    line ("Exception ignored in ... __del__"), or kill it before that line (the main thread only: signals)."""
    import signal
    import threading
    import traceback

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    previous = sys.excepthook
    if getattr(previous, "quiet_resource_sharer", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        # silent: multiprocessing's resource-sharer thread reporting a data worker that ended mid-way through handing
        # over a shared tensor (a ConnectionResetError traceback after the command's own line; its batch is not needed)
        sharer = any(f.filename.endswith("resource_sharer.py") for f in traceback.extract_tb(tb))
        if not (sharer and issubclass(kind, ConnectionError | EOFError)):
            previous(kind, value, tb)

    hook.quiet_resource_sharer = True  # type: ignore[attr-defined]
    sys.excepthook = hook


class ModelFileError(JregError, ValueError):
    """A model on disk that cannot be used as it is; the message is one line naming the path and the fix."""


class IncompleteWeightsError(ModelFileError):
    """A model folder whose weight files do not match its architecture (missing or unexpected tensors)."""


class BadConfigError(ModelFileError):
    """A config.json that is not JSON, or not a model config."""


class Failed(JregError):
    """The run or the machine failed (not the input given): one line naming what and where to resume (exit 1)."""

    exit_code = FAILED


class LimitReached(Failed):
    """A process limit of the machine (`ulimit -n`, `ulimit -f`) stopped the run; one line naming it and the fix."""


# A process limit: (errno, what libraries print for it, the resource, its shell name, what it bounds, unit in the shell)
_LIMITS = ((errno.EMFILE, ("Too many open files",), "RLIMIT_NOFILE", "ulimit -n", "open files", 1),
           (errno.EFBIG, ("File too large", "File size limit exceeded"), "RLIMIT_FSIZE", "ulimit -f",
            "the size of a file it writes", 1024))


def limit_reached(error: BaseException) -> LimitReached | None:
    """LimitReached when `error`, or an error behind it (its cause, its context, a library's message quoting it),
    is this process running into `ulimit -n` or `ulimit -f`, which libraries report in tracebacks far from it."""
    import resource

    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        for code, phrases, name, shell, what, unit in _LIMITS:
            if getattr(error, "errno", None) == code or any(p in text for p in phrases):
                soft = resource.getrlimit(getattr(resource, name))[0]
                value = "unlimited" if soft == resource.RLIM_INFINITY else str(soft // unit)
                example = "65536" if unit == 1 else "unlimited"
                return LimitReached(f"the process limit on {what} stopped the run ({one_line(text, 160)}): it is "
                                    f"`{shell} {value}` here; raise it (e.g. `{shell} {example}` in the job script)")
        error = error.__cause__ or error.__context__
    return None


def one_line(message: object, limit: int | None = None) -> str:
    """A message (or an exception's) folded into one line, cut to `limit` characters: library errors span pages."""
    text = " | ".join(part.strip() for part in str(message).splitlines() if part.strip())
    if not text and isinstance(message, BaseException):
        text = type(message).__name__
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."


INPUT_OS_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def exit_code(error: BaseException) -> int:
    """A JregError's own code; other ValueErrors and unreadable inputs: USAGE; any other OSError: FAILED."""
    if isinstance(error, JregError):
        return error.exit_code
    if isinstance(error, OSError) and not isinstance(error, INPUT_OS_ERRORS):
        return FAILED
    return USAGE


def report(prog: str, error: BaseException, debug: bool = False) -> int:
    """Print `prog: error: <one line>`, an OSError naming its file (after the traceback behind it, with `debug`), on
    stderr; return `exit_code`."""
    if debug:
        import traceback

        traceback.print_exception(error.__cause__ or error, file=sys.stderr)
    named = isinstance(error, OSError) and not isinstance(error, JregError) and error.filename
    print(f"{prog}: error: {one_line(f'{error.filename}: {error.strerror}' if named else str(error))}", file=sys.stderr)
    return exit_code(error)


def run_command(prog: str, body: Callable[[], int]) -> int:
    """Run a command body with `keep_output`, `report`ing expected failures (JregError, ValueError, OSError)."""
    keep_output(prog)
    try:
        code = body()
    except (JregError, ValueError, OSError) as e:
        code = report(prog, e)
    return output_code(code)


_STREAMS = {1: "stdout", 2: "stderr"}
_lost: dict[int, OSError] = {}  # fd -> the write error that sent it to /dev/null
_prog = ["megatron-jreg"]  # the command named in the line a failed stdout gets


class _KeptFile(io.FileIO):
    """fd 1 or 2 whose first failed write (EPIPE, ENOSPC, EFBIG, EIO) is remembered and points the descriptor at
    /dev/null, so that every later write by anyone holding it succeeds; a non-blocking EAGAIN is the caller's."""

    def write(self, data) -> int:  # noqa: ANN001 - bytes-like
        try:
            return super().write(data)
        except BlockingIOError:
            raise
        except OSError as e:
            fd = self.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)
            if fd not in _lost:
                _lost[fd] = e
                if fd == 1 and e.errno != errno.EPIPE:
                    print(f"{_prog[0]}: {_STREAMS[fd]}: {e.strerror or e} ([Errno {e.errno}]): the command goes on "
                          "without its printed output and writes its files", file=sys.stderr, flush=True)
            return memoryview(data).nbytes


def keep_output(prog: str) -> None:
    """sys.stdout and sys.stderr rebuilt over `_KeptFile` (same descriptors, encoding, errors and buffering), once
    per process; streams redirected in-process (a test's StringIO) are left as they are."""
    _prog[0] = prog
    for fd, name in _STREAMS.items():
        stream = getattr(sys, name)
        if stream is None or stream is not getattr(sys, f"__{name}__"):
            continue
        try:
            if stream.fileno() != fd:
                continue
            stream.flush()
        except (OSError, ValueError):  # closed, or already failing: Python's own stream is left as it is
            continue
        raw = _KeptFile(fd, "w", closefd=False)
        buffered = isinstance(stream.buffer, io.BufferedWriter)
        kept = io.TextIOWrapper(io.BufferedWriter(raw) if buffered else raw, encoding=stream.encoding,
                                errors=stream.errors, line_buffering=stream.line_buffering,
                                write_through=stream.write_through)
        setattr(sys, name, kept)


def output_code(code: int) -> int:
    """The command's exit code after `keep_output`: 1 (FAILED) instead of 0 when its stdout failed other than by
    its reader closing the pipe (the line was printed when it happened)."""
    lost = _lost.get(1)
    return FAILED if code == 0 and lost is not None and lost.errno != errno.EPIPE else code
