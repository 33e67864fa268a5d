"""A checkpoint folder on disk without training: the iteration a reader asks for, the integrity manifest digested
by several ranks (or one process) and verified the same way, and the lock on a run's --save folder (the records a
run writes beside them: tests/test_train_records.py).

Unit tier: plain files and processes that import nothing heavy (the lock holder is a `python -c` with fcntl)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests._train_runs import hold_lock


def _iteration(root: Path, it: int, files: dict[str, bytes] | None = None) -> Path:
    """A complete iter_* folder (torch_dist's metadata.json) holding `files`."""
    ckpt = root / f"iter_{it:07d}"
    ckpt.mkdir(parents=True)
    (ckpt / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    for name, data in (files or {}).items():
        (ckpt / name).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / name).write_bytes(data)
    return ckpt


def test_an_iteration_that_does_not_exist_lists_those_that_do(tmp_path):
    """convert --iteration 150 (issue 33, 6): the iterations there, not "fix the tracker"."""
    from megatron_jreg.checkpoints import CheckpointError, resolve

    for it in (50, 100):
        _iteration(tmp_path, it)
    (tmp_path / "iter_0000120").mkdir()  # an interrupted save: not complete, not listed
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("100")
    with pytest.raises(CheckpointError) as e:
        resolve(tmp_path, 150)
    assert str(e.value) == (f"{tmp_path}: no iteration 150 (iter_0000150 does not exist); complete iterations "
                            "there: 50, 100")
    assert "tracker" not in str(e.value)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("99")  # a tracker that is wrong is still named
    with pytest.raises(CheckpointError, match="names iteration 99 .* fix the tracker .*complete iterations there: 50"):
        resolve(tmp_path)


def test_every_file_falls_to_exactly_one_rank():
    from megatron_jreg.checkpoints.files import share

    names = [".metadata", "__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp", "__2_0.distcp",
             "__3_0.distcp", "megatron_jreg.json", "metadata.json"]
    for world in (1, 2, 3, 4, 8):
        shares = [share(names, rank, world) for rank in range(world)]
        assert sorted(n for s in shares for n in s) == sorted(names), world
    assert share(names, 1, 4)[:2] == ["__1_0.distcp", "__1_1.distcp"]  # the shards rank 1 wrote itself
    assert set(share(names, 0, 2)) >= {"__0_0.distcp", "__0_1.distcp"} and "__2_0.distcp" not in share(names, 1, 4)


def test_manifest_by_ranks_equals_one_process_and_names_a_corrupt_file(tmp_path):
    """Digests gathered from shares = write_integrity's own (the function convert's import calls); files in
    subfolders (the legacy torch format's mp_rank_*/) included; every share verifies, and the rank holding a
    damaged file names it."""
    from megatron_jreg.checkpoints import CheckpointError, verify_integrity, write_integrity
    from megatron_jreg.checkpoints.files import checkpoint_files, digest_files, share

    files = {f"__{r}_{i}.distcp": os.urandom(70_000 + 1000 * r + i) for r in range(3) for i in range(2)}
    files.update({".metadata": b"m", "megatron_jreg.json": b"{}", "mp_rank_00/model_optim_rng.pt": os.urandom(5000)})
    ckpt = _iteration(tmp_path, 7, files)
    names = checkpoint_files(ckpt)
    assert "mp_rank_00/model_optim_rng.pt" in names and "integrity.json" not in names
    gathered = {}
    for rank in range(3):
        gathered.update(digest_files(ckpt, share(names, rank, 3), threads=2))
    assert write_integrity(ckpt, gathered) == len(names) == len(files) + 1
    by_ranks = json.loads((ckpt / "integrity.json").read_text())
    assert write_integrity(ckpt) == len(names)
    assert json.loads((ckpt / "integrity.json").read_text()) == by_ranks
    assert by_ranks["algorithm"] == "sha256"
    assert sum(verify_integrity(ckpt, rank, 2) for rank in range(2)) == len(names) == verify_integrity(ckpt)
    data = bytearray((ckpt / "__1_0.distcp").read_bytes())
    data[100] ^= 1
    (ckpt / "__1_0.distcp").write_bytes(bytes(data))
    assert verify_integrity(ckpt, 0, 2) is not None  # rank 0's share does not hold it
    with pytest.raises(CheckpointError, match=r"__1_0.distcp: contents differ from the digest recorded at save"):
        verify_integrity(ckpt, 1, 2)
    (ckpt / "mp_rank_00/model_optim_rng.pt").unlink()
    with pytest.raises(CheckpointError, match="model_optim_rng.pt: listed in integrity.json but missing"):
        verify_integrity(ckpt)


def test_a_file_the_manifest_does_not_list_is_refused(tmp_path):
    """issue 46.10: a shard left out of integrity.json (or a file added after the save) loaded unchecked under
    "verified 3 file(s)"; every file of the checkpoint must be listed, on every rank's verification."""
    from megatron_jreg.checkpoints import CheckpointError, verify_integrity, write_integrity

    ckpt = _iteration(tmp_path, 3, {".metadata": b"m", "__0_0.distcp": b"shard", "mp_rank_00/extra.pt": b"x"})
    write_integrity(ckpt)
    assert verify_integrity(ckpt) == 4
    manifest = json.loads((ckpt / "integrity.json").read_text())
    del manifest["files"]["__0_0.distcp"]
    (ckpt / "integrity.json").write_text(json.dumps(manifest))
    for rank in (0, 1):
        with pytest.raises(CheckpointError, match=r"iter_0000003/__0_0.distcp: not listed in integrity.json, so it "
                                                  r"cannot be verified .*delete integrity.json to load it unverified"):
            verify_integrity(ckpt, rank, 2)
    write_integrity(ckpt)
    (ckpt / "later.bin").write_bytes(b"y")
    (ckpt / "mp_rank_00" / "later.pt").write_bytes(b"z")
    with pytest.raises(CheckpointError, match=r"later.bin: not listed in integrity.json \(and 1 more\)"):
        verify_integrity(ckpt)


def test_a_manifest_naming_files_outside_the_checkpoint_is_refused(tmp_path):
    from megatron_jreg.checkpoints import CheckpointError, verify_integrity

    ckpt = _iteration(tmp_path, 1)
    (ckpt / "integrity.json").write_text(json.dumps({"algorithm": "sha256", "files": {"../../etc/passwd": "0"}}))
    with pytest.raises(CheckpointError, match="not a file name inside the checkpoint"):
        verify_integrity(ckpt)


def test_a_second_writer_is_refused_naming_the_holder_and_a_killed_one_leaves_no_stale_lock(tmp_path, capsys):
    from megatron_jreg.errors import UsageError
    from megatron_jreg.training.run_folder import LOCK, SaveLock

    save = tmp_path / "run"
    save.mkdir()
    proc = hold_lock(save / LOCK)
    try:
        with pytest.raises(UsageError) as e:
            SaveLock.acquire(str(save))
        assert str(e.value) == (f"--save {save}: another run is writing there (pid {proc.pid} on host node7 since "
                                "2026-01-01T00:00:00); wait for it to end, or give this run another --save")
    finally:
        proc.send_signal(signal.SIGKILL)  # kill -9: no clean-up ran, the record stays
        proc.wait()
    assert (save / LOCK).is_file()
    lock = SaveLock.acquire(str(save))
    try:
        taken = capsys.readouterr().out
        assert f"the lock of a run that ended without releasing it (pid {proc.pid} on host node7" in taken
        with pytest.raises(UsageError, match="this process already runs a training that writes there"):
            SaveLock.acquire(str(save))
        record = json.loads((save / LOCK).read_text())
        assert record["pid"] == os.getpid()
    finally:
        lock.release()
    assert not (save / LOCK).exists()
    SaveLock.acquire(str(save)).release()  # free again


def test_the_lock_is_released_when_its_holder_process_ends_however_it_ends(tmp_path):
    from megatron_jreg.training.run_folder import LOCK, SaveLock

    save = tmp_path / "run"
    save.mkdir()
    proc = hold_lock(save / LOCK)
    proc.terminate()
    proc.wait()
    deadline = time.monotonic() + 30  # a guard, not a timing claim
    while True:
        try:
            SaveLock.acquire(str(save)).release()
            break
        except Exception:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_a_foreign_save_is_refused_unless_loaded_or_overwrite_save(tmp_path, capsys):
    """--save holding another run's checkpoints: refused in one line naming --overwrite-save; allowed when the run
    loads that folder (or one of its iterations) or says --overwrite-save (the flag Megatron-LM's parser accepts
    through ours), which moves that run's iterations, complete or not, and its tracker into overwritten-DATE/
    (rank 0 only; a second overwrite in the same second gets a folder of its own)."""
    import argparse

    from megatron_jreg.errors import UsageError
    from megatron_jreg.training.run_folder import _refuse_foreign

    _iteration(tmp_path, 8, {"__0_0.distcp": b"x"})
    (tmp_path / "iter_0000010").mkdir()  # an interrupted save
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("8")
    args = argparse.Namespace(save=str(tmp_path), jreg_overwrite_save=False)
    with pytest.raises(UsageError, match=r"holds the checkpoints of another run \(iterations 8.*or --overwrite-save"):
        _refuse_foreign(args, None)
    _refuse_foreign(args, str(tmp_path))  # continuing that run
    _refuse_foreign(args, str(tmp_path / "iter_0000008"))
    _refuse_foreign(argparse.Namespace(save=str(tmp_path), jreg_overwrite_save=True, rank=1), None)
    assert (tmp_path / "iter_0000008").is_dir() and not list(tmp_path.glob("overwritten-*"))  # rank 0 moves
    _refuse_foreign(argparse.Namespace(save=str(tmp_path), jreg_overwrite_save=True, rank=0), None)
    [aside] = tmp_path.glob("overwritten-*")
    assert sorted(p.name for p in aside.iterdir()) == ["iter_0000008", "iter_0000010",
                                                       "latest_checkpointed_iteration.txt"]
    assert (aside / "iter_0000008" / "__0_0.distcp").read_bytes() == b"x"
    assert sorted(p.name for p in tmp_path.iterdir()) == [aside.name]
    assert (f"--overwrite-save: the checkpoints of the run that wrote {tmp_path} before (iterations 8; tracker at 8) "
            f"moved to {aside}") in capsys.readouterr().out
    _iteration(tmp_path, 2)
    _refuse_foreign(argparse.Namespace(save=str(tmp_path), jreg_overwrite_save=True, rank=0), None)
    assert len(list(tmp_path.glob("overwritten-*"))) == 2 and not list(tmp_path.glob("iter_*"))


def test_overwrite_save_with_load_of_the_same_folder_is_refused(tmp_path):
    """issue 46.11: --overwrite-save beside --load of the same folder (or one of its iterations) was ignored without
    a word: the run continued the checkpoints the flag says to move aside. Nothing is moved."""
    import argparse

    from megatron_jreg.errors import UsageError
    from megatron_jreg.training.run_folder import _refuse_foreign

    _iteration(tmp_path, 8, {"__0_0.distcp": b"x"})
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("8")
    args = argparse.Namespace(save=str(tmp_path), jreg_overwrite_save=True, rank=0)
    for root in (tmp_path, tmp_path / "iter_0000008"):
        with pytest.raises(UsageError, match=rf"^--overwrite-save with --load {root}, inside --save {tmp_path}: the "
                                             "run would load the checkpoint that --overwrite-save moves aside"):
            _refuse_foreign(args, str(root))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000008", "latest_checkpointed_iteration.txt"]


def test_overwrite_save_is_a_train_flag():
    import argparse

    from megatron_jreg.training.flags import add_jreg_args

    parser = add_jreg_args(argparse.ArgumentParser())
    assert parser.parse_args(["--overwrite-save"]).jreg_overwrite_save is True
    assert parser.parse_args([]).jreg_overwrite_save is False
