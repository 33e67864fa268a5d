"""Writing files so that a crash or a reader never sees half of one, and reading JSON lines with the line named: every
promised output goes through `atomic_write`/`atomic_folder`, every JSONL reader through `read_jsonl`."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def _partial(path: Path) -> Path:
    """A unique hidden sibling of `path`: the rename stays within one file system, two writers never share it."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.partial")


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "w", *, fsync: bool = True) -> Iterator[IO[Any]]:
    """A temporary sibling of `path`, renamed over it on a clean exit (fsynced), removed on an error; a plain open,
    so it gets the umask's mode (not mkstemp's 0600)."""
    path = Path(path)
    tmp = _partial(path)
    try:
        with open(tmp, mode.replace("w", "x"), encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def check_output_folder(folder: str | Path, what: str, *, create: bool = False, empty: bool = False) -> Path:
    """Refuse before any work an output folder that is a file, holds files (`empty`), or lies where nothing can be
    written (a ValueError naming `what`), proven by writing a probe file; created when `create`."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{what}: {folder} is a file, not a folder; choose another output path")
    if empty and folder.exists() and any(folder.iterdir()):
        raise ValueError(f"{what} exists and is not empty: remove it or choose another folder")
    existing = next(p for p in (folder.absolute(), *folder.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{what}: {existing} is a file, not a folder; choose another output path")
    probed = folder if create else existing
    try:
        probed.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=probed, prefix=".write-check-"):
            pass
    except OSError as e:
        raise ValueError(f"{what}: cannot write in {probed} ({e.strerror}); choose a writable folder or fix its "
                         "permissions") from None
    return folder


def write_json(path: str | Path, obj: Any, *, indent: int | None = 2) -> None:
    with atomic_write(path) as f:
        json.dump(obj, f, indent=indent, ensure_ascii=False)
        f.write("\n")


@contextlib.contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """A temporary sibling folder that replaces `path` on a clean exit, removed on an error."""
    path = Path(path)
    tmp = _partial(path)
    tmp.mkdir(parents=False)
    try:
        yield tmp
        if path.is_dir():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


class JsonlError(ValueError):
    """A line of a JSONL file that is not a JSON object; `path`, `line` and `reason` let a caller word its own error."""

    def __init__(self, path: Path, line: int, reason: str) -> None:
        super().__init__(f"{path}: line {line} {reason}")
        self.path, self.line, self.reason = path, line, reason


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line of `path`."""
    path = Path(path)
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise JsonlError(path, number, f"is not a JSON line ({e})") from None
            if not isinstance(obj, dict):
                raise JsonlError(path, number, f"is a JSON {type(obj).__name__}, not an object")
            yield number, obj
