"""One run's --save folder: one writer at a time, and a checkpoint's meaning kept across resumes (Megatron-LM mixes
two runs in one folder and takes a resume's changed flags silently; DEVELOPERS.md)."""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_jreg.checkpoints import (
    CheckpointError,
    install_safe_checkpoint_reader,
    load_metadata,
    read_sidecar,
    read_tracker,
    resolve,
    saved_iterations,
)
from megatron_jreg.checkpoints.files import TRACKER, check_storage_paths, read_legacy_state
from megatron_jreg.errors import UsageError

if TYPE_CHECKING:
    from megatron_jreg.plugin import JregConfig

LOCK = ".megatron_jreg.lock"  # in --save, while a run may write there
_HELD: set[str] = set()  # lock files this process holds (POSIX locks never exclude their own process)
_ACTIVE: list[RunFolder] = []  # the run in progress in this process (its save wrapper reads it)


@dataclass(frozen=True)
class Start:
    """The checkpoint a run starts from, resolved once and handed down; `root`: the folder Megatron-LM loads."""

    root: str
    option: str  # "--load" or "--pretrained-checkpoint"
    ckpt: Path
    iteration: int
    sidecar: dict


def _has_checkpoint(root: str | None) -> bool:
    try:
        return root is not None and Path(root).is_dir() and read_tracker(root) is not None
    except CheckpointError:
        return True  # a damaged tracker: reported when it is resolved


def find_start(args: argparse.Namespace) -> Start | None:
    """The checkpoint Megatron-LM will load (--load's, else --pretrained-checkpoint's), checked safe to read before
    any work (Megatron-LM exits 0 on a bad tracker; torch unpickles `.metadata`); None: a fresh start."""
    install_safe_checkpoint_reader()
    pretrained = args.pretrained_checkpoint is not None and not _has_checkpoint(args.load)
    root, option = (args.pretrained_checkpoint, "--pretrained-checkpoint") if pretrained else (args.load, "--load")
    if pretrained and not _has_checkpoint(root):
        raise UsageError(f"--pretrained-checkpoint {root}: no checkpoint there (a folder with "
                         "latest_checkpointed_iteration.txt, as --save writes)")
    if root is None or not Path(root).is_dir():
        return None
    try:
        if read_tracker(root) is None and args.ckpt_step is None:
            return None  # Megatron-LM: "could not find the metadata file ... will start from random"
        ckpt, iteration = resolve(root, args.ckpt_step)
        if (ckpt / ".metadata").is_file():
            check_storage_paths(load_metadata(ckpt / ".metadata"), ckpt)
        return Start(root, option, ckpt, iteration, read_sidecar(ckpt) or {})
    except CheckpointError as e:
        raise UsageError(f"{option}: {e}") from None


def tracked(root: str | None) -> int | str | None:
    """The iteration a folder's tracker names; None without one (or an unreadable one)."""
    try:
        return read_tracker(root) if root else None
    except CheckpointError:
        return None


def resume_hint(args: argparse.Namespace) -> str:
    """Where a run that stopped resumes from: its --save's last checkpoint and the command, or that there is none."""
    save, last = args.save, tracked(args.save)
    if not save:
        return "no --save: nothing was saved, a rerun starts over"
    if last is None:
        return f"no checkpoint in --save {save} yet, a rerun starts over"
    again = "the same command" if args.load == save else f"the same command with --load {save}"
    return f"last checkpoint: iteration {last} in {save}; to resume, rerun {again}"


def active() -> RunFolder | None:
    """The RunFolder of the run in progress in this process (None outside `megatron-jreg train`)."""
    return _ACTIVE[-1] if _ACTIVE else None


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
        try:
            if os.fstat(self._fd).st_ino == os.stat(self.path).st_ino:
                self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self._fd)  # closing drops the lock
        self._fd = -1


def _holder(fd: int) -> str:
    """Who the lock file names: "pid P on host H since T"."""
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode() or "null")
        return f"pid {record['pid']} on host {record['host']} since {record['started']}"
    except (OSError, ValueError, TypeError, KeyError, UnicodeDecodeError):
        return "holder unknown"


def run_settings(args: argparse.Namespace, jreg: JregConfig) -> dict:
    """What a checkpoint's meaning depends on, as this run sets it (megatron_jreg.json's `run`)."""
    from megatron.training import get_tokenizer

    from megatron_jreg.training.data import tokenizer_sha256

    return {"padded_vocab_size": args.padded_vocab_size, "vocab_size": get_tokenizer().vocab_size,
            "tokenizer_sha256": tokenizer_sha256(args), "global_batch_size": args.global_batch_size,
            "rampup_batch_size": args.rampup_batch_size, "seq_length": args.seq_length, "seed": args.seed,
            "layernorm_scaling": bool(args.layernorm_scaling), "jreg": jreg.record()}


def _settings_from_args(saved: argparse.Namespace) -> dict:
    """run_settings' fields from the Megatron-LM args a checkpoint saved (one without megatron_jreg.json)."""
    from megatron_jreg.plugin import JregConfig

    names = ("padded_vocab_size", "global_batch_size", "rampup_batch_size", "seq_length", "seed")
    settings = {name: getattr(saved, name, None) for name in names}
    settings["vocab_size"] = getattr(saved, "vocab_size", None)  # --vocab-size when given (NullTokenizer)
    settings["layernorm_scaling"] = bool(getattr(saved, "layernorm_scaling", False))
    if getattr(saved, "jreg_lambda", None) is not None:
        settings["jreg"] = JregConfig.from_args(saved).record()
    return settings


def saved_settings(ckpt: Path) -> dict | None:
    """run_settings of the run that saved `ckpt`: its megatron_jreg.json, else the args Megatron-LM saved (its own
    checkpoints), read weights-only; None when neither is readable."""
    recorded = (read_sidecar(ckpt) or {}).get("run")
    if isinstance(recorded, dict):
        return recorded
    if not (ckpt / ".metadata").is_file():
        legacy = read_legacy_state(ckpt)
        saved = legacy.get("args") if legacy is not None else None
        return _settings_from_args(saved) if isinstance(saved, argparse.Namespace) else None
    from megatron.core import dist_checkpointing
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()
    try:
        common = dist_checkpointing.load_common_state_dict(str(ckpt))  # no_dist: no process group needed
    except Exception:  # noqa: BLE001 - an unreadable common state is reported by the load itself
        return None
    saved = common.get("args") if isinstance(common, dict) else None
    return _settings_from_args(saved) if isinstance(saved, argparse.Namespace) else None


# flag, why a resume must keep it
_KEPT_ON_RESUME = {
    "global_batch_size": ("--global-batch-size", "the iteration count and the data order are in its samples"),
    "rampup_batch_size": ("--rampup-batch-size", "the consumed samples follow its ramp"),
    "seq_length": ("--seq-length", "the data's samples and positions are cut at it"),
}
_RECORDED = {"seed": "--seed", "layernorm_scaling": "--layernorm-scaling"}  # and every JREG setting (`_flag`)


def _flag(key: str) -> str:
    """The flag of a flattened setting: "jreg.min-weight" → "--jreg-min-weight" (JregConfig.record's keys)."""
    return _RECORDED.get(key) or "--" + key.replace(".", "-").replace("_", "-")


def _flat(settings: dict) -> dict:
    return {**{k: v for k, v in settings.items() if k != "jreg"},
            **{f"jreg.{k}": v for k, v in (settings.get("jreg") or {}).items()}}


def _value(value: object) -> str:
    if value is None:
        return "(not set)"
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def _with(flag: str, value: object) -> str:
    """"--flag V", or "no --flag" for a flag not given."""
    return f"no {flag}" if value is None else f"{flag} {_value(value)}"


class RunFolder:
    """This run's --save folder and what its checkpoints record (module docstring)."""

    def __init__(self, args: argparse.Namespace, jreg: JregConfig, lock: SaveLock | None, start: Start | None,
                 settings: dict | None = None, history: list[dict] | None = None) -> None:
        self.args, self.jreg, self.lock, self.start, self.history = args, jreg, lock, start, history or []
        self._settings = settings
        self.base = start.sidecar if start else {}  # the megatron_jreg.json of the checkpoint this run starts from
        self.loop_fields: Callable[[], dict] | None = None  # what the training loop adds to each sidecar

    @classmethod
    def open(cls, args: argparse.Namespace, jreg: JregConfig, start: Start | None) -> RunFolder:
        """Lock --save and check the checkpoint this run starts from, before any work (UsageError); Megatron-LM's
        own --verify-integrity goes off (checkpointing.py digests on every rank)."""
        args.verify_integrity = False
        lock = SaveLock.acquire(args.save) if args.save and args.rank == 0 else None
        try:
            folder = cls._open(args, jreg, lock, start)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        _ACTIVE.append(folder)
        return folder

    @classmethod
    def _open(cls, args: argparse.Namespace, jreg: JregConfig, lock: SaveLock | None, start: Start | None) -> RunFolder:
        from megatron.training import print_rank_0

        if args.save:
            _refuse_foreign(args, start.root if start else None)
        if start is None:
            return cls(args, jreg, lock, None)
        settings = run_settings(args, jreg)
        # Megatron-LM's load_checkpoint starts a release checkpoint (an import, a published model) at iteration 0,
        # as --finetune does: its batch and sequence length are not a resume's to keep
        fresh = bool(args.finetune) or start.option == "--pretrained-checkpoint" or start.ckpt.name == "release"
        first = 0 if fresh else start.iteration  # the iteration this run's steps count from
        vocab_flag = (f"--vocab-size {args.vocab_size}" if args.vocab_size is not None
                      else f"--tokenizer-model {args.tokenizer_model}")
        try:
            saved = saved_settings(start.ckpt) or {}
        except CheckpointError as e:
            raise UsageError(f"{start.option}: {e}") from None
        changes = _compare(start.ckpt, saved, settings, fresh, vocab_flag)
        same_folder = args.save is not None and Path(args.save).resolve() == Path(start.root).resolve()
        history = list(start.sidecar.get("history") or [])
        if changes or not same_folder:
            history.append({"iteration": first, "from": str(start.ckpt), "changes": changes})
        if changes:
            what = ", ".join(f"{_flag(k)} {_value(old)} → {_value(new)}"
                             for k, (old, new) in changes.items())
            print_rank_0(f"megatron-jreg: {start.ckpt} (iteration {start.iteration}) continues with changed settings "
                         f"from iteration {first}: {what}; recorded in each checkpoint's megatron_jreg.json `history`")
        return cls(args, jreg, lock, start, settings, history)

    @property
    def settings(self) -> dict:
        """run_settings of this run (computed when first needed: a run that neither loads nor saves needs none)."""
        if self._settings is None:
            self._settings = run_settings(self.args, self.jreg)
        return self._settings

    def sidecar(self, torch_adam_step: int | None) -> dict:
        """The megatron_jreg.json of a save of this run."""
        return {"torch_adam_step": torch_adam_step, "jreg": self.settings["jreg"], "run": self.settings,
                "history": self.history, **(self.loop_fields() if self.loop_fields is not None else {})}

    def close(self) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def _refuse_foreign(args: argparse.Namespace, root: str | None) -> None:
    """UsageError when --save holds another run's checkpoints that this run does not continue (`root`: the folder
    it loads); with --overwrite-save they are moved aside instead."""
    save = Path(args.save)
    continuing = root is not None and (Path(root).resolve() == save.resolve()
                                       or save.resolve() in Path(root).resolve().parents)
    if continuing and getattr(args, "jreg_overwrite_save", False):
        raise UsageError(f"--overwrite-save with --load {root}, inside --save {args.save}: the run would load the "
                         "checkpoint that --overwrite-save moves aside first; drop --overwrite-save to continue that "
                         "run, or load another folder to start over in this one")
    found = saved_iterations(save)
    tracker = _tracker_text(save)
    if not found and tracker is None:
        return
    if continuing:
        return  # continuing that folder (its tracker, or one of its iterations)
    shown = ", ".join(map(str, found[-6:])) if found else "none complete"
    if getattr(args, "jreg_overwrite_save", False):
        if getattr(args, "rank", 0) == 0:
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
    """The iter_*/release folders and tracker of `save` renamed into `save`/overwritten-DATE/ (nothing lost)."""
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


def _tracker_text(save: Path) -> str | None:
    try:
        found = read_tracker(save)
    except CheckpointError:
        return "a damaged tracker"
    return None if found is None else f"tracker at {found}"


def _compare(ckpt: Path, saved: dict, now: dict, fresh: bool, vocab_flag: str) -> dict:
    """UsageError for a setting that must not change; {setting: [checkpoint's, this run's]} for those recorded."""
    old, new = _flat(saved), _flat(now)

    def known(key: str) -> bool:
        return old.get(key) is not None and new.get(key) is not None and old[key] != new[key]

    if known("padded_vocab_size") or known("vocab_size"):
        raise UsageError(f"{vocab_flag}: this run's vocabulary is {new['vocab_size']} tokens (embedding "
                         f"{new['padded_vocab_size']} rows), {ckpt}'s {old.get('vocab_size') or '?'} "
                         f"({old.get('padded_vocab_size')} rows): Megatron-LM would load the embedding partly and "
                         "train on; give the checkpoint's tokenizer (or --vocab-size)")
    if known("tokenizer_sha256"):
        raise UsageError(f"--tokenizer-model: this run's tokenizer (sha256 {new['tokenizer_sha256'][:12]}…) is not the "
                         f"one {ckpt} was trained with ({old['tokenizer_sha256'][:12]}…): its embedding rows would "
                         "mean other tokens; give that tokenizer")
    changes = {}
    was, now_ = bool(old.get("layernorm_scaling")), bool(new.get("layernorm_scaling"))  # absent: saved before it
    if was != now_:
        if not fresh:
            raise UsageError(f"{'--layernorm-scaling' if now_ else 'no --layernorm-scaling'}: {ckpt} was trained "
                             f"{'with' if was else 'without'} it and a resume must keep it (every layer's norm "
                             f"outputs scaled by 1/√ℓ or not: another model); {'add' if was else 'leave out'} "
                             "--layernorm-scaling, or start a new run from its weights with --finetune")
        changes["layernorm_scaling"] = [was, now_]
    for key, (flag, why) in _KEPT_ON_RESUME.items():
        if old.get(key) != new.get(key) and key in saved:
            if not fresh:
                was = old.get(key)
                trained, keep = ((f"without {flag}", f"leave out {flag}") if was is None
                                 else (f"with {flag} {_value(was)}", f"give {flag} {_value(was)}"))
                raise UsageError(f"{_with(flag, new.get(key))}: {ckpt} was trained {trained} and a resume must keep "
                                 f"it ({why}): {keep}, or start a new run from its weights with --finetune")
            changes[key] = [old.get(key), new.get(key)]
    for key in [*_RECORDED, *(k for k in old if k.startswith("jreg."))]:  # every JREG setting the checkpoint kept
        if key in old and old[key] != new.get(key):
            changes[key] = [old[key], new.get(key)]
    return changes
