"""`megatron-jreg train` is Megatron-LM's pretrain_gpt.py with JREG: its losses, its checkpoints, plus ours."""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests._terminal import sigint_default
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
    writes them): iterations 3-4 after the resume equal the uninterrupted run's, row for row."""
    one, two = runs["one"], runs["two"]
    assert one["exit"] == one["resume"] == one["mlm-exit"] == one["mlm-resume"] == 0
    assert two["distopt-exit"] == 0 and two["distopt-resume"] == 0
    ref = {it: (lm, j) for it, lm, j in train_losses(runs["tmp"] / f"{reference}.jsonl")}
    got = train_losses(runs["tmp"] / f"{name}.jsonl")
    assert [it for it, _, _ in got] == [1, 2, 3, 4]  # 1-2 before the exit, 3-4 after the resume
    for it, lm, j in got:
        assert lm == pytest.approx(ref[it][0], rel=1e-6) and j == pytest.approx(ref[it][1], rel=1e-6)


def test_metrics_file_of_a_resumed_run_equals_the_uninterrupted_run(runs):
    """Issue 32's check: --log-interval 1, 6 iterations straight vs 3 + resume + 3 (then replayed from 3: the next
    test), every row equal; at
    --log-interval 2 the row of iteration 4 covers iterations 3 and 4, across the resume (its window kept in the
    checkpoint), as Megatron-LM's float32 sum of the two."""
    import numpy as np

    one = runs["one"]
    assert one["straight6"] == 0 and one["split1"] == (0, 0) and one["split2"] == (0, 0)
    straight = {r["iteration"]: r for r in records(runs["tmp"] / "straight6.jsonl") if "lm_loss" in r}
    split = [r for r in records(runs["tmp"] / "split1.jsonl") if "lm_loss" in r]
    assert sorted(straight) == [r["iteration"] for r in split] == [1, 2, 3, 4, 5, 6]
    for row in split:
        for key in ("lm_loss", "grad_norm", "lr", "consumed_samples", "jreg_loss", "psi"):
            assert row[key] == straight[row["iteration"]][key], (row["iteration"], key)
    windows = {1: [1], 2: [1, 2], 4: [3, 4], 6: [5, 6]}  # after a fresh run's extra first row, not reset
    every2 = {r["iteration"]: r["lm_loss"] for r in records(runs["tmp"] / "split2.jsonl") if "lm_loss" in r}
    assert sorted(every2) == sorted(windows)
    for it, members in windows.items():
        total = np.float32(0)
        for m in members:
            total = np.float32(total + np.float32(straight[m]["lm_loss"]))
        assert every2[it] == float(total) / len(members), it


def test_a_resume_from_an_earlier_checkpoint_moves_the_lost_rows_aside(runs):
    """Run to 6, then resume from iteration 3 (--ckpt-step 3): the rows of 4-6 (and of the validation after training)
    move to PATH.replaced (one line says so) and the replayed ones take their place; both equal the uninterrupted
    run's, one row per iteration."""
    rc, out, err = runs["one"]["replay"]
    path = runs["tmp"] / "split1.jsonl"
    assert rc == 0, (out + err)[-3000:]
    assert (f"megatron-jreg: --metrics-file {path}: 5 row(s) after iteration 3 (not in the checkpoint this run starts "
            f"from) moved to {path}.replaced") in out
    straight = {r["iteration"]: r for r in records(runs["tmp"] / "straight6.jsonl") if "lm_loss" in r}
    rows = [r for r in records(path) if "lm_loss" in r]
    moved = [r for r in records(f"{path}.replaced") if "lm_loss" in r]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5, 6] and [r["iteration"] for r in moved] == [4, 5, 6]
    for row in rows + moved:
        for key in ("lm_loss", "grad_norm", "lr", "consumed_samples", "jreg_loss", "psi"):
            assert row[key] == straight[row["iteration"]][key], (row["iteration"], key)


def test_a_second_run_from_the_first_runs_checkpoint_records_what_changed(runs):
    """Another λ and seed from the first run's iteration 2: printed, and in every later checkpoint's history."""
    rc, out, err = runs["one"]["second"]
    source = runs["tmp"] / "ckpt" / "iter_0000002"
    assert rc == 0, (out + err)[-3000:]
    assert (f"megatron-jreg: {source} (iteration 2) continues with changed settings from iteration 2: --seed 1234 → 7, "
            "--jreg-lambda 1.0 → 0.5") in out
    sidecar = json.loads((runs["tmp"] / "second" / "iter_0000003" / "megatron_jreg.json").read_text())
    first = {"iteration": 2, "from": str(source), "changes": {"seed": [1234, 7], "jreg.lambda": [1.0, 0.5]}}
    assert sidecar["history"] == [first]
    assert sidecar["jreg"]["lambda"] == 0.5 and sidecar["run"]["seed"] == 7


def test_jreg_settings_changed_resuming_in_the_same_folder_are_printed_and_appended(runs):
    """λ, α, the distance, the layers and the minimum weight changed on a resume of the same --save (from its
    iteration 3): one line, and the change appended to the history the checkpoint carried, with the iteration it
    took effect."""
    rc, out, err = runs["one"]["second-changed"]
    source = runs["tmp"] / "second" / "iter_0000003"
    assert rc == 0, (out + err)[-3000:]
    assert (f"megatron-jreg: {source} (iteration 3) continues with changed settings from iteration 3: "
            "--jreg-lambda 0.5 → 0.25, --jreg-alpha 1.0 → 2.0, --jreg-distance angular → cosine, "
            "--jreg-layers (not set) → 2 3, --jreg-min-weight 0.0 → 0.01; recorded in each checkpoint's "
            "megatron_jreg.json `history`") in out
    sidecar = json.loads((runs["tmp"] / "second" / "iter_0000004" / "megatron_jreg.json").read_text())
    assert sidecar["history"][0]["iteration"] == 2 and len(sidecar["history"]) == 2
    assert sidecar["history"][1] == {"iteration": 3, "from": str(source), "changes": {
        "jreg.lambda": [0.5, 0.25], "jreg.alpha": [1.0, 2.0], "jreg.distance": ["angular", "cosine"],
        "jreg.layers": [None, [2, 3]], "jreg.min-weight": [0.0, 0.01]}}
    assert sidecar["jreg"] == {"lambda": 0.25, "alpha": 2.0, "distance": "cosine", "layers": [2, 3],
                               "min-weight": 0.01}


def test_overwrite_save_moves_the_earlier_runs_checkpoints_aside(runs):
    """--overwrite-save into a finished run's folder (iterations 2 and 4, tracker at 4) by a run that saves only
    iteration 2: the earlier run's iterations and tracker move, untouched, into overwritten-DATE/, so --save holds
    this run's alone (before: its iteration 4 stayed beside the new run's 2, the tracker naming 2)."""
    from megatron_jreg.checkpoints import verify_integrity

    rc, out, err = runs["one"]["overwrite"]
    save = runs["tmp"] / "overwrite"
    assert rc == 0, (out + err)[-3000:]
    [aside] = save.glob("overwritten-*")
    assert (f"megatron-jreg: --overwrite-save: the checkpoints of the run that wrote {save} before (iterations 2, 4; "
            f"tracker at 4) moved to {aside}, so that no reader mixes them with this run's") in out
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000002"]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert sorted(p.name for p in aside.iterdir()) == ["iter_0000002", "iter_0000004",
                                                       "latest_checkpointed_iteration.txt"]
    assert (aside / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    for it in ("iter_0000002", "iter_0000004"):  # the earlier run's files as they were
        assert verify_integrity(aside / it) == len(json.loads((aside / it / "integrity.json").read_text())["files"])
    assert verify_integrity(save / "iter_0000002") is not None


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


def _nonfinite_tensors(ckpt: Path) -> list[str]:
    """Names of the tensors of a torch_dist checkpoint that hold NaN/Inf (read through torch's own converter),
    leaving out the rerun state machine's record of the NaN result it stopped on (its own diagnostics)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    def tensors(obj, prefix=""):
        if isinstance(obj, torch.Tensor):
            yield prefix, obj
        elif isinstance(obj, dict):
            for key, value in obj.items():
                yield from tensors(value, f"{prefix}.{key}")
        elif isinstance(obj, list | tuple):
            for i, value in enumerate(obj):
                yield from tensors(value, f"{prefix}.{i}")

    with tempfile.TemporaryDirectory() as folder:
        dcp_to_torch_save(ckpt, f"{folder}/state.pt")
        state = torch.load(f"{folder}/state.pt", weights_only=False)  # our own test checkpoint
    found = list(tensors(state))
    assert found
    return [name for name, t in found if t.is_floating_point() and not bool(torch.isfinite(t).all())
            and not name.startswith(".rerun_state_machine")]


def test_nan_stops_with_iteration_and_last_checkpoint(runs):
    rc, out, err = runs["one"]["nan"]
    assert rc in (16, 17)  # Megatron-LM's rerun machine: checkpoint-and-resume to disambiguate, or confirmed
    text = out + err
    assert "NaN/Inf loss or gradient at iteration" in text and "last good checkpoint:" in text
    assert "nan (iteration" in text and f"exit {rc}" in text and "Traceback" not in text
    for ckpt in sorted((runs["tmp"] / "nan").glob("iter_*")):  # what "resume with --load" loads is finite
        assert _nonfinite_tensors(ckpt) == [], ckpt


def test_nan_exit_resumes_from_its_checkpoint(runs):
    """Exit 16's resume loads the checkpoint it saved (its rerun state holds megatron-core's Call/Caller tuples,
    which our weights-only reader once refused): Megatron-LM's rerun machine then decides again (16 or 17)."""
    rc, out, err = runs["one"]["nan-resume"]
    text = out + err
    assert rc in (16, 17), text[-2000:]
    assert "could not load" not in text and "Traceback" not in text
    assert "NaN/Inf loss or gradient at iteration" in text


def test_nan_without_save_is_one_line(runs):
    """Megatron-LM's NaN exit saves a checkpoint even without --save (a TypeError traceback after the line)."""
    rc, out, err = runs["one"]["nan-nosave"]
    text = out + err
    assert rc in (16, 17) and "Traceback" not in text, text[-3000:]
    assert "last good checkpoint: none" in text and "no --save, so nothing to resume from" in text


def test_non_finite_weights_are_never_saved(runs):
    """With Megatron-LM's NaN check off, training goes on from NaN weights: those saves do not happen (one line
    each), the tracker keeps the last finite checkpoint, and the metrics file says which values were NaN."""
    rc, out, err = runs["one"]["nan-weights"]
    root = runs["tmp"] / "nan-weights"
    skipped = [line for line in (out + err).splitlines() if "not saved:" in line]
    last = int((root / "latest_checkpointed_iteration.txt").read_text())
    assert rc == 0 and skipped and last < 6 and "Traceback" not in out + err, (out + err)[-3000:]
    assert re.search(r"\d+ weight tensor\(s\)( and \d+ optimizer state tensor\(s\))? hold NaN/Inf \(first: module\.",
                     skipped[0]), skipped[0]
    assert f"still names iteration {last}" in skipped[-1]
    assert sorted(int(p.name[5:]) for p in root.glob("iter_*")) == list(range(1, last + 1))
    for ckpt in root.glob("iter_*"):
        assert _nonfinite_tensors(ckpt) == [], ckpt
    rows = [r for r in records(runs["tmp"] / "nan-weights.jsonl") if "lm_loss" in r]
    assert any(r["lm_loss"] is None and "lm_loss" in r.get("nonfinite", []) for r in rows)
    nan_psi = [r for r in rows if None in r["psi"]]
    assert nan_psi  # JREG names the layer where the states turn non-finite (Ψ before it finite)
    for r in nan_psi:
        first = r["first_nonfinite_layer"]
        assert r["psi"][first - 1] is None and None not in r["psi"][:first - 1], r


def test_non_finite_optimizer_state_is_never_saved(runs):
    """Adam's exp_avg_sq turned inf after step 3, the weights still finite: the saves of iterations 3 and 4 do not
    happen (one line each, naming the state), the tracker keeps iteration 2 (before: saved, tracker at 4)."""
    (rc, out, err), steps = runs["one"]["optimizer-inf"]
    root = runs["tmp"] / "optimizer-inf"
    skipped = [line for line in (out + err).splitlines() if "not saved:" in line]
    assert rc == 0 and steps == 4 and "Traceback" not in out + err, (out + err)[-3000:]
    assert [line.split(" not saved:")[0] for line in skipped] == [f"megatron-jreg train: iteration {it}"
                                                                  for it in (3, 4)]
    for line in skipped:
        assert "not saved: 1 optimizer state tensor(s) hold NaN/Inf (first: optimizer exp_avg_sq of module." in line
        assert f"latest_checkpointed_iteration.txt in {root} still names iteration 2" in line
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_0000001", "iter_0000002"]
    for ckpt in root.glob("iter_*"):
        assert _nonfinite_tensors(ckpt) == [], ckpt


def test_skipped_iterations_are_written_as_skipped(runs):
    """Megatron-LM's fp16 loss scaler skips an iteration whose scaled gradients overflow (its console line then has
    no grad norm): that row's lm_loss is null with skipped_iterations 1 (was 0.0), the others' the loss."""
    rc, out, err = runs["one"]["fp16-scale"]
    assert rc == 0, (out + err)[-3000:]
    lines = {int(m[1]): m[0] for m in re.finditer(r"iteration +(\d+)/ +\d+ \|.*", out)}
    skipped = {it: "grad norm:" not in line for it, line in lines.items()}
    assert sorted(skipped) == [1, 2, 3] and any(skipped.values()) and not all(skipped.values()), lines
    rows = {r["iteration"]: r for r in records(runs["tmp"] / "fp16-scale.jsonl") if "lm_loss" in r}
    assert sorted(rows) == [1, 2, 3]
    for it, was_skipped in skipped.items():
        row = rows[it]
        if was_skipped:
            assert row["lm_loss"] is None and row["skipped_iterations"] == 1 and row["grad_norm"] is None, row
            assert "nonfinite" not in row  # skipped, not NaN
        else:
            assert isinstance(row["lm_loss"], float) and "skipped_iterations" not in row, row


def test_a_float16_forward_overflow_is_skipped_and_named_where_it_starts(runs):
    """Hidden states beyond float16 in the forward: Megatron-LM skips every iteration; each row says so (lm_loss
    null, skipped_iterations = its window's iterations) and Ψ is NaN (null) from the first layer whose states
    overflowed, named in the row and on the console line, finite before it; ζ and L_cos NaN (never 0 or 0.5)."""
    rc, out, err = runs["one"]["fp16-overflow"]
    assert rc == 0, (out + err)[-3000:]
    named = {int(m[1]): int(m[2]) for m in re.finditer(r"iteration +(\d+)/ +\d+ \|.*first non-finite layer: (\d+) \|",
                                                       out)}
    rows = [r for r in records(runs["tmp"] / "fp16-overflow.jsonl") if "lm_loss" in r]
    assert [r["iteration"] for r in rows] == [1, 2, 4] and sorted(named) == [1, 2, 4], out[-3000:]
    for row, window in zip(rows, (1, 2, 2), strict=True):  # --log-interval 2, after a fresh run's first row
        first = row["first_nonfinite_layer"]
        assert row["lm_loss"] is None and row["skipped_iterations"] == window and row["grad_norm"] is None, row
        assert "lm_loss" not in row["nonfinite"] and first == named[row["iteration"]], row
        assert row["psi"][first - 1] is None and None not in row["psi"][:first - 1], row
        assert row["jreg_loss"] is None and row["zeta_L"] is None, row


def test_a_legacy_checkpoint_of_megatron_lm_itself_is_checked_by_its_saved_args(runs):
    """--ckpt-format torch saved without megatron_jreg.json (as Megatron-LM writes it): the args inside its
    model_optim_rng.pt, read weights-only, refuse a changed global batch, vocabulary or sequence length in one line
    (before: resumed, exit 0), and record a changed λ."""
    cases = runs["one"]["legacy-mlm"]
    ckpt = runs["tmp"] / "legacy-mlm" / "iter_0000002"
    for name, needle in (
            ("global-batch", f"--global-batch-size 8: {ckpt} was trained with --global-batch-size 4 and a resume must "
                             "keep it"),
            ("vocab", f"--vocab-size 1024: this run's vocabulary is 1024 tokens (embedding 1024 rows), {ckpt}'s 512 "
                      "(512 rows)"),
            ("seq-length", f"--seq-length 16: {ckpt} was trained with --seq-length 32")):
        rc, out, err = cases[name]
        lines = [line for line in err.splitlines() if line.startswith("megatron-jreg train: error:")]
        assert rc == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in err, (name, err[-2000:])
    rc, out, err = cases["same"]
    assert rc == 0, (out + err)[-3000:]
    assert (f"megatron-jreg: {ckpt} (iteration 2) continues with changed settings from iteration 2: --jreg-lambda "
            "1.0 → 0.5") in out


def test_legacy_torch_checkpoint_format_saves_verifies_and_resumes(runs):
    """--ckpt-format torch: Megatron-LM's manifest refuses it (every run crashed); ours covers its mp_rank_*/."""
    exit_rc, (rc, out, err) = runs["one"]["legacy"]
    assert exit_rc == 0 and rc == 0 and "Traceback" not in err, (out + err)[-3000:]
    assert f"megatron-jreg: verified 2 file(s) of {runs['tmp'] / 'legacy' / 'iter_0000002'}" in out
    manifest = json.loads((runs["tmp"] / "legacy" / "iter_0000004" / "integrity.json").read_text())
    assert set(manifest["files"]) == {"megatron_jreg.json", "mp_rank_00/model_optim_rng.pt"}


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


def test_two_ranks_digest_their_own_shards_and_one_process_verifies_them(runs):
    """The manifest of a 2-rank save holds both ranks' shards (each digested by its writer) and checks out whole."""
    from megatron_jreg.checkpoints import verify_integrity

    ckpt = runs["tmp"] / "distopt-ckpt" / "iter_0000004"
    files = json.loads((ckpt / "integrity.json").read_text())["files"]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "metadata.json", "megatron_jreg.json"} <= set(files)
    assert verify_integrity(ckpt) == len(files)


def _train_process(argv: list[str], **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "megatron_jreg.train", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, preexec_fn=sigint_default, **kwargs)


def test_ctrl_c_is_one_line_naming_the_checkpoint_to_resume(tmp_path):
    """Ctrl-C (SIGINT to the process group, data workers included): the step ends, then one line; exit 130."""
    ckpt = tmp_path / "ckpt"
    argv = TINY + ["--train-iters", "100000", "--save", str(ckpt), "--save-interval", "2", "--eval-interval",
                   "100000", "--num-workers", "2"]
    proc = _train_process(argv, cwd=tmp_path, start_new_session=True)
    lines = []
    deadline = time.time() + 240
    for line in proc.stdout:
        lines.append(line)
        if "iteration        3/" in line:
            os.killpg(proc.pid, signal.SIGINT)
            break
        assert time.time() < deadline, "".join(lines)
    out, _ = proc.communicate(timeout=240)
    text = "".join(lines) + out
    errors = [line for line in text.splitlines() if line.startswith("megatron-jreg train: error:")]
    assert proc.returncode == 130 and len(errors) == 1 and "Traceback" not in text, text[-3000:]
    found = re.fullmatch(rf"megatron-jreg train: error: interrupted \(Ctrl-C\) at iteration (\d+); last checkpoint: "
                         rf"iteration (\d+) in {re.escape(str(ckpt))}; to resume, rerun the same command with --load "
                         rf"{re.escape(str(ckpt))}", errors[0])
    assert found and int(found[2]) < int(found[1]), errors[0]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == found[2]


def test_two_runs_on_one_save_the_second_stops_and_the_first_finishes_verified(tmp_path):
    """Issue 32's check: a second run started on a --save that a running run writes to stops in one line naming
    it; the first finishes, its checkpoints verify, its lock is gone."""
    import socket

    from megatron_jreg.checkpoints import verify_integrity
    from megatron_jreg.training.run_folder import LOCK

    save = tmp_path / "ckpt"
    argv = TINY + ["--train-iters", "30", "--save", str(save), "--save-interval", "10", "--eval-interval", "1000"]
    first = _train_process(argv, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 240  # a guard against a hang, not a timing claim
        while not ((save / LOCK).is_file() and "pid" in (save / LOCK).read_text()):  # written once the lock is held
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-3000:]
            time.sleep(0.2)
        os.kill(first.pid, signal.SIGSTOP)  # the first holds its lock while the second starts, however slow that is
        try:
            second = _train_process(argv, cwd=tmp_path)
            out2, _ = second.communicate(timeout=600)
            running = first.poll() is None
        finally:
            os.kill(first.pid, signal.SIGCONT)
    finally:
        out1, _ = first.communicate(timeout=900)
    errors = [line for line in out2.splitlines() if line.startswith("megatron-jreg train: error:")]
    assert second.returncode == 2 and len(errors) == 1 and "Traceback" not in out2, out2[-3000:]
    assert f"--save {save}: another run is writing there (pid {first.pid} on host {socket.gethostname()}" in errors[0]
    assert running  # refused while the first still ran
    assert first.returncode == 0, out1[-3000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "30"
    for it in (10, 20, 30):
        ckpt = save / f"iter_{it:07d}"
        assert verify_integrity(ckpt) == len(json.loads((ckpt / "integrity.json").read_text())["files"])
    assert not (save / LOCK).exists()
