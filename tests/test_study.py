"""examples/study.py: the --quick study end to end (real trainings, analyses, evaluations, report), its
resume (finished runs skipped, an interrupted run continued from its checkpoint), refused settings, and
the significance step on known numbers."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from scipy import stats

ROOT = Path(__file__).resolve().parent.parent
STUDY = ROOT / "examples" / "study.py"
sys.path.insert(0, str(ROOT / "examples"))

import study  # noqa: E402
import study_report  # noqa: E402

ARMS = ("baseline", "jreg-a0", "jreg-a1")


def _study(out: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(STUDY), "--quick", "--output", str(out), *flags],
                          capture_output=True, text=True, timeout=600)


def _attempts(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("study") / "quick"
    return out, _study(out)


def test_quick_study_writes_every_output(quick):
    out, proc = quick
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[study] 3 runs (1 seed(s) × baseline + α ∈ {0, 1}, 6 steps, --jobs 2); 0 already done" in proc.stdout
    results = json.loads((out / "results.json").read_text())
    runs = {r["arm"]: r for r in results["runs"]}
    assert sorted(runs) == sorted(ARMS)
    for arm, run in runs.items():
        assert run["trained"] and run["analysed"], arm
        # the checkpoint series (every 3 steps) analysed: ζ_L at steps 3 and 6, Ψ for each of the 4 layers
        assert run["series"]["steps"] == [3, 6]
        assert all(isinstance(z, float) and z >= 0 for z in run["series"]["zeta_L"])
        assert [len(p) for p in run["series"]["psi"]] == [4, 4]
        assert run["train_curve"]["steps"] == [1, 2, 3, 4, 5, 6]
        final = run["final"]
        assert final["zeta_L"] == run["series"]["zeta_L"][-1] and final["psi"] == run["series"]["psi"][-1]
        for key in ("val_loss", "bits_per_byte", "word_perplexity", "lambada_acc", "lm_loss"):
            assert math.isfinite(final[key]), (arm, key)
        assert run["eval_samples"] == {"wikitext2_local": 8, "lambada": 8}
    # the same seed starts every arm from the same weights and batches: equal first-step losses
    first = {arm: json.loads((out / "runs" / arm / "seed-1" / "metrics.jsonl").read_text().splitlines()[0])
             for arm in ARMS}
    assert len({round(r["lm_loss"], 5) for r in first.values()}) == 1
    # Δ_ℓ is JREG − baseline of the same seed, layer by layer
    summary = results["summary"]
    for arm in ARMS[1:]:
        expected = [j - b for j, b in zip(runs[arm]["final"]["psi"], runs["baseline"]["final"]["psi"])]
        assert summary["delta"][arm]["seeds"]["1"] == pytest.approx(expected)
    # compare ran per α and metric; one seed gives differences but no t-test
    for arm in ARMS[1:]:
        for key in ("zeta_L", "val_loss", "bits_per_byte", "lambada_acc"):
            entry = results["compare"][arm][key]
            assert entry["n"] == 1 and entry["skipped"].startswith("fewer than 2 seed pairs")
            assert entry["diffs"] == pytest.approx([runs[arm]["final"][key] - runs["baseline"]["final"][key]])
    report = (out / "report.md").read_text()
    for heading in ("## What came out", "## ζ_L against training steps", "## Table 3 at this scale",
                    "## Table 5 at this scale", "## Table 13 at this scale", "## Setup"):
        assert heading in report
    assert "- command: `python examples/study.py --quick --output" in report
    assert "commit `" in report
    for name in ("zeta_steps", "psi", "delta", "weights"):
        assert (out / f"study_{name}.png").stat().st_size > 1000
        assert f"(study_{name}.png)" in report
    assert (out / ".gitignore").read_text() == "*\n"


def test_second_invocation_skips_finished_runs_and_resumes_an_interrupted_one(quick):
    out, proc = quick
    assert proc.returncode == 0
    # make jreg-a1 look interrupted after its first checkpoint: step 6 and everything after training gone
    run = out / "runs" / "jreg-a1" / "seed-1"
    shutil.rmtree(run / "checkpoints" / "iter_0000006")
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("3")
    for name in ("train.done", "post.done", "eval.json"):
        (run / name).unlink()
    shutil.rmtree(run / "analysis")
    before = {arm: len(_attempts(out / "runs" / arm / "seed-1")) for arm in ARMS}
    again = _study(out)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "2 already done" in again.stdout
    assert "jreg-a1/seed-1: resuming from its checkpoint at step 3" in again.stdout
    for arm in ARMS[:2]:  # finished: not touched
        assert len(_attempts(out / "runs" / arm / "seed-1")) == before[arm]
    new = _attempts(run)[before["jreg-a1"]:]
    assert [(a["kind"], a["from_iteration"], a["to_iteration"]) for a in new] == [("train", 3, 6), ("post", 0, 6)]
    results = json.loads((out / "results.json").read_text())
    resumed = next(r for r in results["runs"] if r["arm"] == "jreg-a1")
    assert resumed["resumed"] and resumed["series"]["steps"] == [3, 6]
    assert "- resumed from checkpoints: jreg-a1/seed-1" in (out / "report.md").read_text()
    lines = [json.loads(x) for x in (out / "invocations.jsonl").read_text().splitlines()]
    # each invocation is recorded when it starts (a killed one still shows) and again when it ends
    assert [x["wall_s"] is None for x in lines] == [True, False, True, False]
    assert len({x["start"] for x in lines}) == 2 and len(results["invocations"]) == 2


def test_other_settings_on_an_existing_output_are_refused(quick):
    out, _ = quick
    proc = _study(out, "--steps", "8")
    assert proc.returncode != 0
    assert "holds a run with other settings (" in proc.stderr and "steps: 6 there, 8 now" in proc.stderr


def test_train_command_carries_the_seed_jreg_setting_and_checkpoint_series(tmp_path):
    cfg = study.config_from(study.build_parser().parse_args(["--output", str(tmp_path), "--alphas", "0.3", "1"]))
    assert (cfg.seeds, cfg.alphas, cfg.steps, cfg.save_interval, cfg.jobs) == (3, (0.3, 1.0), 300, 30, 2)
    runs = study.plan(cfg)
    assert [r.name for r in runs[:3]] == ["baseline/seed-1", "jreg-a0.3/seed-1", "jreg-a1/seed-1"]
    assert len(runs) == 9
    cmd = study.train_command(cfg, runs[1], "TOK", tmp_path / "data")

    def last(flag: str) -> str:  # Megatron-LM's parser keeps a repeated flag's last value
        return cmd[len(cmd) - 1 - cmd[::-1].index(flag) + 1]

    assert last("--seed") == "1" and last("--init-mode") == "layout-independent"
    assert (last("--jreg-lambda"), last("--jreg-alpha"), last("--jreg-distance")) == ("1", "0.3", "angular")
    assert last("--save-interval") == "30" and last("--train-iters") == "300"
    assert last("--save") == last("--load") == str(runs[1].dir / "checkpoints")
    assert "--jreg-alpha" not in study.train_command(cfg, runs[0], "TOK", tmp_path / "data")


def test_compare_step_is_the_one_sided_paired_t_test_in_each_metrics_own_sense(tmp_path):
    cfg = study.StudyConfig(output=tmp_path, seeds=3, alphas=(1.0,))
    base_loss, jreg_loss = [4.90, 4.85, 4.95], [4.86, 4.84, 4.90]
    base_zeta, jreg_zeta = [2.4, 2.1, 2.8], [0.0, 0.0, 0.1]

    def record(arm: str, seed: int, loss: float, zeta: float) -> dict:
        final = {k: None for k in study_report.BY_KEY}
        final.update(val_loss=loss, zeta_L=zeta, bits_per_byte=loss / 2, lambada_acc=0.0)
        return {"arm": arm, "seed": seed, "final": final}

    records = [record("baseline", s + 1, base_loss[s], base_zeta[s]) for s in range(3)]
    records += [record("jreg-a1", s + 1, jreg_loss[s], jreg_zeta[s]) for s in range(3)]
    tests = study_report.run_compare(cfg, records, tmp_path)["jreg-a1"]
    for key, b, j in (("val_loss", base_loss, jreg_loss), ("zeta_L", base_zeta, jreg_zeta)):
        t = tests[key]
        reference = stats.ttest_rel(j, b, alternative="less")  # lower is better for both
        assert t["p_value"] == pytest.approx(reference.pvalue, rel=1e-9)
        assert t["diff"] == pytest.approx(sum(j) / 3 - sum(b) / 3)
        # with 95% confidence JREG − baseline lies below the bound (lower is better)
        assert t["bound"] == pytest.approx(reference.confidence_interval(0.95).high, rel=1e-9)
        assert t["jreg_better"] == (reference.pvalue < 0.05)
        assert Path(t["compare"]).exists()
    assert tests["lambada_acc"]["skipped"] == "LAMBADA top-1 is 0 in every run: nothing to test"
    files = sorted(p.name for p in (tmp_path / "compare" / "jreg-a1" / "val_loss").iterdir())
    assert files == ["baseline-seed-1.json", "baseline-seed-2.json", "baseline-seed-3.json", "compare.json",
                     "compare.txt", "jreg-seed-1.json", "jreg-seed-2.json", "jreg-seed-3.json"]
