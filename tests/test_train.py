"""`megatron-jreg train` is Megatron-LM's pretrain_gpt.py with JREG: its losses, its checkpoints, plus ours."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests._train_runs import MEGATRON_LM_LOSSES, MEGATRON_LM_MTP_LOSSES, TINY, records, single_rank_runs, two_rank_runs
from tests.distributed import run_ranks

pytestmark = pytest.mark.multirank

RTOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    two = run_ranks(two_rank_runs, 2, str(tmp), timeout=1800)
    one = run_ranks(single_rank_runs, 1, str(tmp), timeout=1800)[0]
    return {"tmp": tmp, "two": two[1], "one": one}


def train_losses(path):
    return [(r["iteration"], r["lm_loss"], r["jreg_loss"]) for r in records(path) if "lm_loss" in r]


def val_loss(path, split="valid"):
    """The first validation of a run: at iteration 4 in training, the only one with --skip-train (Megatron-LM
    evaluates the first validation samples again after loading)."""
    return [r["val_loss"] for r in records(path) if r.get("split") == split][0]


@pytest.mark.parametrize("layout", ["one", "tp2", "pp2", "mtp-one", "mtp-pp2"])
def test_megatron_lm_launch_flags_give_megatron_lm_losses(runs, layout):
    """Megatron-LM's Llama-3 8B example flags (shrunk) with --jreg-lambda 0: every console loss equals
    Megatron-LM's own pretrain_gpt.py on the same arguments (recorded, see _train_runs.py), with
    multi-token prediction too (its `mtp_1 loss`, at one rank and with the MTP layer on the last stage)."""
    rc, losses, mtp = runs["one"][f"mlm-{layout}"] if layout in ("one", "mtp-one") else runs["two"][f"mlm-{layout}"]
    assert rc == 0
    assert losses == pytest.approx(MEGATRON_LM_LOSSES[layout], rel=2e-6)
    assert mtp == pytest.approx(MEGATRON_LM_MTP_LOSSES.get(layout, []), rel=2e-6)


def test_jreg_appends_psi_and_zeta_to_megatron_lm_console_line(runs):
    rc, stdout = runs["two"]["pp2-jreg-console"]
    assert rc == 0
    line = next(line for line in stdout.splitlines() if "iteration        2/" in line)
    assert line.index("lm loss:") < line.index("jreg loss:")  # Megatron-LM's fields first, unchanged
    for field in ("zeta_L:", "zeta_L-1:", "zeta_L-2:", "psi:"):
        assert field in line
    assert len(line.split("psi: ")[1].split(" |")[0].split(",")) == 4
    assert "validation JREG at iteration 4" in stdout


@pytest.mark.parametrize("layout", ["tp2", "dp2-distopt"])
def test_same_losses_and_jreg_at_every_layout(runs, layout):
    assert runs["one"]["single"] == 0 and runs["two"][layout] == 0
    ref = train_losses(runs["tmp"] / "single.jsonl")
    got = train_losses(runs["tmp"] / f"{layout}.jsonl")
    assert [r[0] for r in got] == [1, 2, 3, 4]
    for (_, lm_ref, j_ref), (_, lm, j) in zip(ref, got):
        assert lm == pytest.approx(lm_ref, rel=RTOL)
        assert j == pytest.approx(j_ref, rel=RTOL)


def test_metrics_file_fields(runs):
    rec = records(runs["tmp"] / "single.jsonl")
    train_rec = rec[0]
    for key in ("iteration", "consumed_samples", "lm_loss", "jreg_loss", "psi", "zeta_L", "zeta_L-1", "zeta_L-2",
                "lr", "grad_norm", "iteration_ms", "tokens_per_sec", "tflops_per_rank"):
        assert key in train_rec, key
    assert len(train_rec["psi"]) == 4 and train_rec["consumed_samples"] == 4
    val = [r for r in rec if "val_loss" in r]
    assert val[0]["iteration"] == 4 and val[0]["split"] == "valid" and len(val[0]["psi"]) == 4
    assert {r["split"] for r in val} == {"valid", "test"}


def test_tensorboard_has_megatron_lm_scalars_and_jreg(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(runs["tmp"] / "tb"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "lm loss validation"} <= scalars  # Megatron-LM's own
    assert {"jreg/jreg_loss", "jreg/zeta_L", "jreg-validation/zeta_L", "jreg-validation-final/zeta_L"} <= scalars
    assert {f"jreg/psi_layer_{ell:03d}" for ell in range(1, 5)} <= scalars
    assert [e.step for e in acc.Scalars("jreg/jreg_loss")] == [1, 2, 3, 4]
    assert "jreg/psi_per_layer" in acc.Tags()["histograms"]


@pytest.mark.parametrize("name,reference", [("resumed", "single"), ("mlm-resumed", "single"),
                                            ("dp2-resumed", "dp2-distopt")])
def test_resume_continues_exactly(runs, name, reference):
    """Plain and distributed optimizer, and a checkpoint without megatron-jreg's files (as Megatron-LM
    writes them): iterations 3-4 after the resume equal the uninterrupted run's.

    lm_loss is Megatron-LM's console window, which its first line of a run does not reset: at --log-interval 1
    the line after the first covers two iterations (2 = {1, 2} in both runs; after the resume 4 = {3, 4})."""
    one, two = runs["one"], runs["two"]
    assert one["exit"] == one["resume"] == one["mlm-exit"] == one["mlm-resume"] == 0
    assert two["distopt-exit"] == 0 and two["distopt-resume"] == 0
    ref = {it: (lm, j) for it, lm, j in train_losses(runs["tmp"] / f"{reference}.jsonl")}
    got = train_losses(runs["tmp"] / f"{name}.jsonl")
    assert [it for it, _, _ in got] == [1, 2, 3, 4]  # 1-2 before the exit, 3-4 after the resume
    for it, lm, j in got:
        window = (ref[3][0] + ref[4][0]) / 2 if it == 4 else ref[it][0]
        assert lm == pytest.approx(window, rel=1e-6) and j == pytest.approx(ref[it][1], rel=1e-6)


def test_megatron_lm_checkpoint_layout(runs):
    files = runs["one"]["mlm-files"]
    assert "metadata.json" in files and any(f.endswith(".distcp") for f in files)
    assert "integrity.json" not in files and "megatron_jreg.json" not in files
    ckpt = runs["tmp"] / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    names = {p.name for p in (ckpt / "iter_0000004").iterdir()}
    assert {"integrity.json", "megatron_jreg.json", "metadata.json"} <= names


def test_checkpoint_saved_at_tp2_loads_at_pp2_and_one_rank(runs):
    assert runs["two"]["pp2-from-tp2"] == 0 and runs["one"]["one-from-tp2"] == 0
    for split in ("valid", "test"):
        ref = val_loss(runs["tmp"] / "tp2.jsonl", split)
        assert val_loss(runs["tmp"] / "pp2-from-tp2.jsonl", split) == pytest.approx(ref, rel=RTOL)
        assert val_loss(runs["tmp"] / "one-from-tp2.jsonl", split) == pytest.approx(ref, rel=RTOL)


def test_use_checkpoint_args_rebuilds_the_model_from_the_checkpoint(runs):
    """Megatron-LM's --use-checkpoint-args: no architecture flag given, the same model and validation."""
    assert runs["one"]["checkpoint-args"] == 0
    got = [r for r in records(runs["tmp"] / "checkpoint-args.jsonl") if r.get("split") == "valid"][0]
    assert len(got["psi"]) == 4
    assert got["val_loss"] == pytest.approx(val_loss(runs["tmp"] / "resumed.jsonl"), rel=RTOL)


def test_crash_during_save_leaves_previous_checkpoint_current(runs):
    crash = runs["one"]["crash"]
    assert "simulated crash" in crash["error"]
    assert crash["tracker"] == 1
    assert crash["resume"] == 0 and crash["tracker_after"] == 4


def test_nan_stops_with_iteration_and_last_checkpoint(runs):
    rc, out, err = runs["one"]["nan"]
    assert rc in (16, 17)  # Megatron-LM's rerun machine: checkpoint-and-resume to disambiguate, or confirmed
    text = out + err
    assert "NaN/Inf loss or gradient at iteration" in text and "last good checkpoint:" in text
    assert "nan (iteration" in text and f"exit {rc}" in text


def test_sigterm_saves_and_exits_zero(tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = TINY + ["--train-iters", "100000", "--save", str(ckpt), "--save-interval", "100000",
                   "--eval-interval", "100000"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "megatron_jreg.train", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    lines = []
    deadline = time.time() + 240
    for line in proc.stdout:
        lines.append(line)
        if "iteration        2/" in line:
            proc.send_signal(signal.SIGTERM)
            break
        assert time.time() < deadline, "".join(lines)
    out, _ = proc.communicate(timeout=240)
    lines.append(out)
    text = "".join(lines)
    assert proc.returncode == 0, text[-3000:]
    assert "exiting program after receiving SIGTERM" in text
    iteration = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert iteration >= 2 and (ckpt / f"iter_{iteration:07d}" / "metadata.json").is_file()
