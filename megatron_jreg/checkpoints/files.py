"""A Megatron-LM checkpoint on disk, found, checked and read without running its code: train --load, analyze,
evaluate and convert share these protections (layout and threats: DEVELOPERS.md)."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import io
import json
import os
import pickle
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from megatron_jreg import patches
from megatron_jreg.errors import JregError
from megatron_jreg.fileio import atomic_write
from megatron_jreg.model_files import NotRegularFile, open_regular, relative_name, special_kind

TRACKER = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"^iter_\d+$")
INTEGRITY = "integrity.json"  # megatron.core.dist_checkpointing's manifest name
_DISTCP = re.compile(r"^__(\d+)_\d+\.distcp$")  # a torch_dist shard: __RANK_INDEX.distcp, written by RANK


class CheckpointError(JregError, ValueError):
    """A checkpoint that cannot be used; the message names the file and the fix (one line)."""


def iteration_dir(root: str | Path, iteration: int | str) -> Path:
    name = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
    return Path(root) / name


def is_checkpoint_dir(path: Path) -> bool:
    """Written completely (torch_dist, or the legacy `--ckpt-format torch`)."""
    return ((path / "metadata.json").is_file() or (path / ".metadata").is_file()
            or any(path.glob("mp_rank_*/model_optim_rng.pt")))


def is_checkpoint(path: str | Path) -> bool:
    """Meant as a Megatron-LM checkpoint (a --save or iter_*/release folder), complete or not."""
    path = Path(path)
    if not path.is_dir() or (path / "config.json").exists():
        return False
    if (path / TRACKER).exists() or _ITER_DIR.match(path.name) or path.name == "release":
        return True
    return any(p.is_dir() and _ITER_DIR.match(p.name) for p in path.iterdir())


def read_tracker(root: str | Path) -> int | str | None:
    """The iteration (or "release") the tracker names; None when there is no tracker file."""
    tracker = Path(root) / TRACKER
    if not tracker.exists():
        return None
    try:
        with open_regular(tracker) as f:
            text = f.read().decode().strip()
    except NotRegularFile as e:
        raise CheckpointError(f"{e}: replace it with a text file holding the iteration to resume from") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{tracker}: unreadable ({e}); write the iteration to resume from into it") from None
    if text == "release":
        return text
    if not text.isdigit():
        found = sorted(p.name for p in Path(root).glob("iter_*") if is_checkpoint_dir(p))
        hint = f"; complete checkpoints here: {', '.join(found[-3:])}" if found else ""
        raise CheckpointError(f"{tracker}: expected an iteration number, found {text[:40]!r}: write the iteration "
                              f"of a complete iter_* directory into it{hint}")
    return int(text)


def resolve(path: str | Path, iteration: int | None = None) -> tuple[Path, int]:
    """(checkpoint directory, iteration) for a save dir (via its tracker) or an iter_*/release directory."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if path.is_file():
        raise CheckpointError(f"{path} is a file: give the checkpoint directory (holding {TRACKER}) or an "
                              "iter_* directory")
    if (path.name.startswith("iter_") or path.name == "release") and is_checkpoint_dir(path):
        found = 0 if path.name == "release" else int(path.name[5:])
        if iteration is not None and iteration != found:
            raise CheckpointError(f"{path} is iteration {found}, not {iteration}: give the run's directory to choose "
                                  "another iteration")
        return path, found
    found = iteration if iteration is not None else read_tracker(path)
    if found is None:
        raise CheckpointError(f"{path}: no {TRACKER}; not a Megatron-LM checkpoint directory (give the --save "
                              "directory of a run, or one of its iter_* directories)")
    ckpt = iteration_dir(path, found)
    if not ckpt.is_dir():
        if iteration is not None:  # asked for by the caller (--iteration, --ckpt-step): the tracker is not at fault
            raise CheckpointError(f"{path}: no iteration {iteration} ({ckpt.name} does not exist); "
                                  f"{_iterations_text(path)}")
        raise CheckpointError(f"{path / TRACKER} names iteration {found} but {ckpt} does not exist: fix the "
                              f"tracker or restore the directory ({_iterations_text(path)})")
    if not is_checkpoint_dir(ckpt):
        raise CheckpointError(f"{ckpt}: incomplete checkpoint (no metadata.json/.metadata; a save was "
                              "interrupted?): resume from an earlier iteration")
    check_files(ckpt)
    return ckpt, (0 if found == "release" else int(found))


def saved_iterations(root: str | Path) -> list[int]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in root.iterdir() if _ITER_DIR.match(p.name) and is_checkpoint_dir(p))


def _iterations_text(root: Path) -> str:
    found = saved_iterations(root)
    if not found:
        return "no complete iter_* folder there"
    shown = ", ".join(map(str, found[-12:]))
    return f"complete iterations there: {'..., ' if len(found) > 12 else ''}{shown}"


def check_files(ckpt: str | Path) -> None:
    """Every entry below an iteration folder is a regular file or folder inside it (a FIFO would block a reader)."""
    ckpt = Path(ckpt)
    root = ckpt.resolve()
    for folder, dirs, files in os.walk(ckpt):
        for name in sorted(dirs + files):
            path = Path(folder) / name
            if path.is_symlink() and not path.resolve().is_relative_to(root):
                raise CheckpointError(f"{path}: a symlink to {path.resolve()}, outside the checkpoint {ckpt}; "
                                      "readers open only files inside it: copy the file in")
            try:
                kind = special_kind(os.stat(path).st_mode)
            except OSError as e:
                raise CheckpointError(f"{path}: unreadable ({e.strerror}); restore it or resume from another "
                                      "iteration") from None
            if kind is not None:
                raise CheckpointError(f"{path} is {kind}, not a regular file (reading it could block forever): "
                                      "restore the checkpoint file or resume from another iteration")


def check_storage_paths(metadata, ckpt: str | Path) -> None:  # noqa: ANN001 - torch's Metadata
    """Every file a DCP `.metadata` names is a regular file inside `ckpt` (a crafted one could name a FIFO)."""
    ckpt = Path(ckpt)
    root = ckpt.resolve()
    storage = getattr(metadata, "storage_data", None)
    names = {getattr(info, "relative_path", None) for info in (storage.values() if isinstance(storage, dict) else [])}
    for name in sorted(names, key=str):
        where = f"{ckpt / '.metadata'}: storage entry {str(name)[:120]!r}"
        if not name or not relative_name(name):
            raise CheckpointError(f"{where} is not a file name inside {ckpt}; this checkpoint is damaged or crafted: "
                                  "do not use it")
        path = ckpt / name
        try:
            mode = os.stat(path).st_mode
        except OSError:
            raise CheckpointError(f"{where}: {path} is missing; the checkpoint is incomplete: resume from another "
                                  "iteration") from None
        if not path.resolve().is_relative_to(root) or special_kind(mode) is not None or not os.path.isfile(path):
            what = special_kind(mode) or "outside the checkpoint"
            raise CheckpointError(f"{where}: {path} is {what}, not a regular file inside it; this checkpoint is "
                                  "damaged or crafted: do not use it")


class UnsafeClass(pickle.UnpicklingError):
    """A pickle asks for a class outside the allow-list (what a crafted file does to run code)."""


def failure_text(e: BaseException) -> str:
    """One line for an exception from reading a checkpoint (DCP's carries a traceback per rank: its first)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        return f"{type(inner).__name__}: {' '.join(str(inner).split())[:200]}"
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a torch DCP `.metadata` file, building nothing but its own data classes."""

    _ALLOWED = {("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                *(("builtins", name) for name in ("set", "frozenset", "slice", "complex", "bytearray", "range")),
                *(("torch", name) for name in (
                    "Size", "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
                    "bool", "float8_e4m3fn", "float8_e5m2", "complex64", "complex128", "uint16", "uint32", "uint64"))}

    def find_class(self, module: str, name: str):  # noqa: ANN201
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module.startswith(("torch.distributed.checkpoint.", "torch.distributed.tensor._dtensor_spec")):
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module and (
                dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)
            ):
                return obj
        raise UnsafeClass(f"class {module}.{name} is not allowed in checkpoint metadata")


def load_metadata(path: str | Path):
    path = Path(path)
    try:
        with open_regular(path) as f:
            data = f.read()
        return MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeClass as e:
        raise CheckpointError(f"{path}: refused to load ({e}); this file could run code: do not use this "
                              "checkpoint") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            OSError) as e:
        raise CheckpointError(f"{path}: unreadable checkpoint metadata ({type(e).__name__}: {e}); the file is "
                              "truncated or corrupt: resume from another iteration") from None


def _read_metadata(self, *args, **kwargs):  # noqa: ANN001, ANN202 - torch's FileSystemReader.read_metadata
    from torch.distributed.checkpoint.metadata import StorageMeta

    path = Path(self._get_metadata_path(kwargs.get("rank")))
    metadata = load_metadata(path)
    check_storage_paths(metadata, path.parent)  # before the reader opens any of them
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


def _load_bytes(self, read_item, value: io.BytesIO) -> None:  # noqa: ANN001 - torch's DefaultLoadPlanner.load_bytes
    from torch.distributed.checkpoint import default_planner

    try:
        obj = torch.load(value, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"checkpoint object {read_item.dest_index.fqn!r}: refused to load "
                              f"({' '.join(str(e).split())[:200]}); this checkpoint could run code") from None
    if self.flatten_state_dict:
        default_planner.set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
    else:
        self.state_dict[read_item.dest_index.fqn] = obj


_READER = "torch.distributed.checkpoint.filesystem.FileSystemReader.read_metadata"


def install_safe_checkpoint_reader() -> None:
    """torch's DCP reader and load planner unpickle only allowed classes, process-wide (rows of PATCHES)."""
    if patches.is_applied(_READER):
        return
    from megatron.core.rerun_state_machine import Call, Caller
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()
    # the rerun state machine's record of the result it stopped on (saved with the checkpoint of a NaN exit, which
    # Megatron-LM resumes from to tell a fault from a divergence): two NamedTuples megatron-core's list lacks
    torch.serialization.add_safe_globals([Call, Caller])
    patches.apply_process({_READER: lambda _original: _read_metadata,
                           "torch.distributed.checkpoint.default_planner.DefaultLoadPlanner.load_bytes":
                               lambda _original: _load_bytes})


def refusal_text(e: BaseException) -> str:
    """One line of torch.load's weights_only refusal: it spans lines (and advises weights_only=False, which would run
    the file's code); the line naming what was refused is kept."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    named = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), None)
    return (named or (lines[0] if lines else type(e).__name__))[:200]


def read_legacy_state(ckpt: str | Path) -> dict | None:
    """A legacy `--ckpt-format torch` folder's first model_optim_rng.pt, weights-only; None for torch_dist."""
    found = sorted(Path(ckpt).glob("mp_rank_*/model_optim_rng.pt"))
    if not found:
        return None
    install_safe_checkpoint_reader()
    try:
        state = torch.load(found[0], map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{found[0]}: refused to load ({refusal_text(e)}); this file could run code: do not use "
                              "this checkpoint") from None
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise CheckpointError(f"{found[0]}: unreadable ({failure_text(e)}); the file is truncated or corrupt: resume "
                              "from another iteration") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{found[0]}: not a Megatron-LM checkpoint (a {type(state).__name__}, not a dict)")
    return state


def _sha256(path: Path) -> str:
    with open_regular(path) as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def checkpoint_files(ckpt: str | Path) -> list[str]:
    ckpt = Path(ckpt)
    names = (p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())
    return sorted(n for n in names if not n.startswith(INTEGRITY))


def share(names: list[str], rank: int, world: int) -> list[str]:
    """The files rank `rank` of `world` digests: the shards it wrote (in its page cache after a save), plus a
    round-robin share of the rest; every name falls to one rank."""
    mine, rest = [], []
    for name in names:
        writer = _DISTCP.match(name)
        if writer is not None and int(writer[1]) < world:
            if int(writer[1]) == rank:
                mine.append(name)
        else:
            rest.append(name)
    return mine + rest[rank::world]


def digest_files(ckpt: str | Path, names: list[str], threads: int | None = None) -> dict[str, str]:
    """SHA-256 of each named file, in threads (hashlib releases the GIL)."""
    ckpt = Path(ckpt)
    with ThreadPoolExecutor(max(1, min(len(names), threads or len(os.sched_getaffinity(0))))) as pool:
        return dict(zip(names, pool.map(lambda name: _sha256(ckpt / name), names), strict=True))


def write_integrity(ckpt: str | Path, digests: dict[str, str] | None = None) -> int:
    """`ckpt`/integrity.json in Megatron-LM's layout (`digests` from the ranks, or digested here); its file count."""
    ckpt = Path(ckpt)
    if digests is None:
        digests = digest_files(ckpt, checkpoint_files(ckpt))
    with atomic_write(ckpt / INTEGRITY) as f:
        f.write(json.dumps({"algorithm": "sha256", "files": dict(sorted(digests.items()))}, indent=2))
    return len(digests)


def read_integrity(ckpt: str | Path) -> dict[str, str] | None:
    manifest_path = Path(ckpt) / INTEGRITY
    if not manifest_path.is_file():
        return None
    try:
        with open_regular(manifest_path) as f:
            manifest = json.loads(f.read())
        files = manifest["files"]
        if manifest.get("algorithm", "sha256") != "sha256" or not isinstance(files, dict):
            raise ValueError("unexpected layout")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest_path}: unreadable integrity manifest ({e}); delete it to load the "
                              "checkpoint unverified") from None
    for name in files:
        if not relative_name(name):
            raise CheckpointError(f"{manifest_path}: entry {str(name)[:80]!r} is not a file name inside the "
                                  "checkpoint; the manifest is damaged or crafted: restore it or resume from another "
                                  "iteration")
    return files


def verify_integrity(ckpt: str | Path, rank: int = 0, world: int = 1, threads: int | None = None) -> int | None:
    """This rank's `share` checked against the manifest: how many, None without one. An unlisted file is refused
    too (it would load unchecked under "verified")."""
    ckpt = Path(ckpt)
    files = read_integrity(ckpt)
    if files is None:
        return None
    unlisted = sorted(set(checkpoint_files(ckpt)) - set(files))
    if unlisted:
        more = f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""
        raise CheckpointError(f"{ckpt / unlisted[0]}: not listed in {INTEGRITY}{more}, so it cannot be verified (a "
                              "file added after the save, or a manifest of another save): restore the checkpoint or "
                              f"resume from another iteration, or delete {INTEGRITY} to load it unverified")
    names = share(sorted(files), rank, world)
    for name in names:
        if not (ckpt / name).is_file():
            raise CheckpointError(f"{ckpt / name}: listed in {INTEGRITY} but missing: the checkpoint is incomplete; "
                                  "resume from another iteration")
    for name, digest in digest_files(ckpt, names, threads).items():
        if digest != files[name]:
            raise CheckpointError(f"{ckpt / name}: contents differ from the digest recorded at save (corrupted on "
                                  "disk or in transfer): restore the file or resume from another iteration")
    return len(names)
