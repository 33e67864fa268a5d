"""`megatron-jreg train`: the same run at every layout, exact resume, resharded checkpoints, clear errors."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests._train_runs import TINY, records, single_rank_runs, two_rank_runs
from tests.distributed import run_ranks

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO / "examples" / "data" / "wikitext-2" / "valid.txt"
RTOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_jreg.data.train_tokenizer import train_tokenizer

    text = tmp / "text.txt"
    text.write_text(WIKITEXT.read_text(encoding="utf-8")[:20000], encoding="utf-8")
    tokenizer = train_tokenizer([str(text)], str(tmp / "tok"), 300, kind="hf-bpe")
    bad = tmp / "bad_text_document"  # token ids up to 1000 > vocabulary 300
    builder = IndexedDatasetBuilder(str(bad) + ".bin", dtype=np.uint16)
    import torch

    builder.add_document(torch.arange(0, 1001, dtype=torch.int64), [1001])
    builder.finalize(str(bad) + ".idx")
    two = run_ranks(two_rank_runs, 2, str(tmp))[0]
    one = run_ranks(single_rank_runs, 1, str(tmp), tokenizer, str(bad))[0]
    return {"tmp": tmp, "two": two, "one": one}


def train_losses(path):
    return [(r["iteration"], r["lm_loss"], r["jreg_loss"]) for r in records(path) if "lm_loss" in r]


def val_loss(path):
    return [r["val_loss"] for r in records(path) if "val_loss" in r][-1]


@pytest.mark.parametrize("layout", ["tp2", "tp2-sp", "pp2", "dp2", "dp2-distopt", "dp2-overlap"])
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
    for key in ("iteration", "lm_loss", "jreg_loss", "psi", "zeta_L", "zeta_L-1", "zeta_L-2", "lr", "grad_norm",
                "tokens_per_sec"):
        assert key in train_rec, key
    assert len(train_rec["psi"]) == 4
    assert "val_loss" in rec[-1] and rec[-1]["iteration"] == 4


def test_tensorboard_scalars_and_psi_per_layer(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(runs["tmp"] / "tb"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    assert {"train/lm_loss", "train/jreg_loss", "train/zeta_L", "train/lr", "validation/lm_loss"} <= scalars
    assert {f"psi/layer_{ell:03d}" for ell in range(1, 5)} <= scalars
    assert [e.step for e in acc.Scalars("train/lm_loss")] == [1, 2, 3, 4]
    assert "psi/per_layer" in acc.Tags()["histograms"]


@pytest.mark.parametrize("name,reference", [("resumed", "single"), ("dp2-resumed", "dp2-distopt")])
def test_resume_continues_exactly(runs, name, reference):
    assert runs["one"]["exit"] == 0 and runs["one"]["resume"] == 0
    assert runs["two"]["distopt-exit"] == 0 and runs["two"]["distopt-resume"] == 0
    ref = {it: (lm, j) for it, lm, j in train_losses(runs["tmp"] / f"{reference}.jsonl")}
    got = train_losses(runs["tmp"] / f"{name}.jsonl")
    assert [it for it, _, _ in got] == [1, 2, 3, 4]  # 1-2 before the exit, 3-4 after the resume
    for it, lm, j in got:
        assert lm == pytest.approx(ref[it][0], rel=1e-6) and j == pytest.approx(ref[it][1], rel=1e-6)


def test_checkpoint_saved_at_tp2_loads_at_pp2_and_one_rank(runs):
    assert runs["two"]["pp2-from-tp2"] == 0 and runs["one"]["one-from-tp2"] == 0
    ref = val_loss(runs["tmp"] / "tp2.jsonl")
    assert val_loss(runs["tmp"] / "pp2-from-tp2.jsonl") == pytest.approx(ref, rel=RTOL)
    assert val_loss(runs["tmp"] / "one-from-tp2.jsonl") == pytest.approx(ref, rel=RTOL)


def test_distributed_optimizer_refuses_other_layout_with_advice(runs):
    rc, err = runs["two"]["distopt-other-layout"]
    assert rc == 2 and "--no-load-optim" in err and "TP=1 PP=2" in err


def test_crash_during_save_leaves_previous_checkpoint_current(runs):
    crash = runs["one"]["crash"]
    assert "simulated crash" in crash["error"]
    assert crash["tracker"] == 1
    assert "iter_0000002" not in crash["dirs"] and "iter_0000001" in crash["dirs"]
    assert crash["resume"] == 0


def test_nan_stops_with_iteration_and_last_checkpoint(runs):
    rc, err = runs["one"]["nan"]
    assert rc == 3
    assert "NaN/inf" in err and "at iteration" in err and "Last good checkpoint:" in err and "iter_" in err


@pytest.mark.parametrize(
    "case,needle",
    [
        ("global-batch", "--global-batch-size"),
        ("negative-lambda", "--jreg-lambda"),
        ("unknown-preset", "--model-preset"),
        ("missing-data", "--data-path"),
        ("vocab", "largest token id 1000"),
        ("fp8", "--fp8-format"),
        ("wandb", "--wandb-project"),
    ],
)
def test_bad_configuration_fails_before_work_naming_the_flag(runs, case, needle):
    rc, err = runs["one"]["errors"][case]
    assert rc != 0
    assert needle in err
    assert "Traceback" not in err


def test_layers_not_divisible_by_pipeline_stages(runs):
    rc, err = runs["two"]["bad-pp-split"]
    assert rc == 2 and "--num-layers 3" in err and "--pipeline-model-parallel-size" in err


def test_sigterm_saves_and_exits(tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = TINY + ["--train-iters", "100000", "--save", str(ckpt)]  # the last value of a flag wins
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
    assert proc.returncode == 0, "".join(lines)
    text = "".join(lines)
    assert "SIGTERM received" in text
    iteration = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert iteration >= 2 and (ckpt / f"iter_{iteration:07d}" / "metadata.json").is_file()
