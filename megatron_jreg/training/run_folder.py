"""One run's --save folder: one writer at a time (Megatron-LM mixes two runs' iterations in one folder), a foreign
run's checkpoints refused or moved aside, and where a stopped run resumes from."""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_jreg.checkpoints import CheckpointError, read_tracker, saved_iterations
from megatron_jreg.checkpoints.files import TRACKER
from megatron_jreg.errors import UsageError
from megatron_jreg.training.run_record import RunRecord, Start

if TYPE_CHECKING:
    from megatron_jreg.plugin import JregConfig

LOCK = ".megatron_jreg.lock"  # in --save, while a run may write there
_HELD: set[str] = set()  # lock files this process holds (POSIX locks never exclude their own process)


def tracked(root: str | None) -> int | str | None:
    try:
        return read_tracker(root) if root else None
    except CheckpointError:
        return None


def resume_hint(args: argparse.Namespace) -> str:
    save, last = args.save, tracked(args.save)
    if not save:
        return "no --save: nothing was saved, a rerun starts over"
    if last is None:
        return f"no checkpoint in --save {save} yet, a rerun starts over"
    again = "the same command" if args.load == save else f"the same command with --load {save}"
    return f"last checkpoint: iteration {last} in {save}; to resume, rerun {again}"


class SaveLock:
    """`--save`/.megatron_jreg.lock under POSIX `lockf`: the kernel drops it even on kill -9, forks do not inherit
    it, NFS honours it; the file names the holder for the refusal."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, save: str) -> SaveLock | None:
        """The lock, or UsageError naming its holder; None (with a warning) where the file system has no locks."""
        folder = Path(save)
        path = folder / LOCK
        try:  # a path the writability pre-check cannot judge (root under /proc, a read-only mount)
            folder.mkdir(parents=True, exist_ok=True)
            os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644))
        except OSError as e:
            raise UsageError(f"--save {save}: cannot write there ({e.strerror}); choose a writable directory") from None
        key = str(path.resolve())
        if key in _HELD:
            raise UsageError(f"--save {save}: this process already runs a training that writes there")
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _holder(fd)
                os.close(fd)
                if e.errno in (errno.EACCES, errno.EAGAIN):
                    raise UsageError(f"--save {save}: another run is writing there ({holder}); wait for it to end, "
                                     "or give this run another --save") from None
                print(f"megatron-jreg: warning: --save {save} cannot be locked ({e.strerror}): make sure no other "
                      "run writes there", flush=True)
                return None
            try:  # its previous holder may have removed the file between our open and our lock: lock the new one
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        stale = _holder(fd)
        if stale != "holder unknown":
            print(f"megatron-jreg: --save {save}: the lock of a run that ended without releasing it ({stale}; "
                  "killed?) is taken over", flush=True)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        _HELD.add(key)
        return cls(path, fd)

    def release(self) -> None:
        if self._fd < 0:
            return
        _HELD.discard(str(self.path.resolve()))
        with contextlib.suppress(FileNotFoundError):
            if os.fstat(self._fd).st_ino == os.stat(self.path).st_ino:
                self.path.unlink()
        os.close(self._fd)  # closing drops the lock
        self._fd = -1


def _holder(fd: int) -> str:
    """Who the lock file names: "pid P on host H since T"."""
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode() or "null")
        return f"pid {record['pid']} on host {record['host']} since {record['started']}"
    except (OSError, ValueError, TypeError, KeyError, UnicodeDecodeError):
        return "holder unknown"


class RunFolder:
    """This run's --save folder, locked, and the run record its saves write."""

    def __init__(self, lock: SaveLock | None, record: RunRecord) -> None:
        self.lock, self.record = lock, record

    @classmethod
    def open(cls, args: argparse.Namespace, jreg: JregConfig, start: Start | None) -> RunFolder:
        """Lock --save and check the starting checkpoint before any work; Megatron-LM's --verify-integrity goes off
        (checkpointing.py digests on every rank)."""
        args.verify_integrity = False
        lock = SaveLock.acquire(args.save) if args.save and args.rank == 0 else None
        try:
            if args.save:
                _refuse_foreign(args, start.root if start else None)
            return cls(lock, RunRecord(args, jreg, start))
        except BaseException:
            if lock is not None:
                lock.release()
            raise

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def _refuse_foreign(args: argparse.Namespace, root: str | None) -> None:
    """Refuse (or with --overwrite-save move aside) another run's checkpoints in --save that this run does not load."""
    save = Path(args.save)
    continuing = root is not None and (Path(root).resolve() == save.resolve()
                                       or save.resolve() in Path(root).resolve().parents)
    if continuing and args.jreg_overwrite_save:
        raise UsageError(f"--overwrite-save with --load {root}, inside --save {args.save}: the run would load the "
                         "checkpoint that --overwrite-save moves aside first; drop --overwrite-save to continue that "
                         "run, or load another folder to start over in this one")
    found = saved_iterations(save)
    try:
        tracker = None if (named := read_tracker(save)) is None else f"tracker at {named}"
    except CheckpointError:
        tracker = "a damaged tracker"
    if continuing or (not found and tracker is None):
        return  # continuing that folder (its tracker, or one of its iterations), or nothing there
    shown = ", ".join(map(str, found[-6:])) if found else "none complete"
    if args.jreg_overwrite_save:
        if args.rank == 0:
            aside = _move_aside(save)
            print(f"megatron-jreg: --overwrite-save: the checkpoints of the run that wrote {args.save} before "
                  f"(iterations {shown}; {tracker or 'no tracker'}) moved to {aside}, so that no reader mixes them "
                  "with this run's; delete that folder when it is no longer needed", flush=True)
        return
    loading = f"it loads {root}" if root is not None else "it has no --load"
    raise UsageError(f"--save {args.save} holds the checkpoints of another run (iterations {shown}; "
                     f"{tracker or 'no tracker'}) and this run would overwrite them ({loading}): add --load "
                     f"{args.save} to continue that run, give this run an empty --save, or --overwrite-save")


def _move_aside(save: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = save / f"overwritten-{stamp}", 1
    while aside.exists():
        aside, n = save / f"overwritten-{stamp}-{n}", n + 1
    aside.mkdir()
    if (save / TRACKER).exists():  # first: a tracker never names a folder already moved
        os.replace(save / TRACKER, aside / TRACKER)
    for path in sorted(save.iterdir()):
        if path.name == "release" or (path.name.startswith("iter_") and path.is_dir()):
            os.replace(path, aside / path.name)
    return aside
