"""experiments/study/study.py: the --quick study end to end (real trainings at one token budget, measurements, SFT, raw
files, report), its resume, the pilot gate, refused settings; the report as a function of the raw files alone
(the committed experiments/study/report_v2.md against experiments/study/raw_v2); the statistics against scipy."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STUDY = ROOT / "experiments" / "study" / "study.py"
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "experiments" / "study")]

import study  # noqa: E402
import study_report  # noqa: E402

ARMS = ("baseline-large", "baseline-small", "jreg-a1")
SFT = ("sft-baseline-small", "sft-jreg-a1")


def _study(out: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(STUDY), "--quick", "--output", str(out), *flags],
                          capture_output=True, text=True, timeout=1200)


def _attempts(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("study") / "quick"
    return out, _study(out)


@pytest.mark.slow
def test_quick_study_writes_every_output(quick):
    out, proc = quick
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("[study] 6 pretraining runs (2 seed(s) × baseline-large, baseline-small, jreg-a1; 2,048 tokens each) "
            "+ 2 SFT runs, --jobs 2") in proc.stdout
    assert "[study] pilot gate passed: baseline-small/seed-1 final held-out ζ_L" in proc.stdout
    raw = out / "raw"
    names = sorted(p.name for p in raw.iterdir())
    assert names == sorted([f"{a}__seed-{s}.json" for a in ARMS for s in (1, 2)]
                           + [f"{a}__seed-1.json" for a in SFT] + ["study.json"])
    for arm in ARMS:
        for seed in (1, 2):
            rec = json.loads((raw / f"{arm}__seed-{seed}.json").read_text())
            assert rec["spec"]["tokens"] == 2048  # one token budget for every arm
            series = rec["measures"]["series"]
            assert [c["iteration"] for c in series] == [rec["spec"]["steps"] // 2, rec["spec"]["steps"]]
            final = series[-1]
            assert len(final["heldout"]["psi"]) == 4 and final["heldout"]["tokens"] > final["core"]["tokens"]
            assert final["train"]["tokens"] == 8 * 128 and final["heldout"]["ce"] > 0
            assert rec["command"].startswith("python -m megatron_jreg.train") and "$OUT/runs/" in rec["command"]
            assert {a["kind"] for a in rec["attempts"]} == {"train", "post"}
            assert all(a["cpu_s"] > 0 and a["commit"] for a in rec["attempts"])
    # the same seed, the same batch: JREG changes the gradient, not the first forward
    first = [json.loads((out / "runs" / a / "seed-1" / "metrics.jsonl").read_text().splitlines()[0])["lm_loss"]
             for a in ("baseline-small", "jreg-a1")]
    assert first[0] == pytest.approx(first[1], abs=1e-6)
    sft = json.loads((raw / "sft-jreg-a1__seed-1.json").read_text())
    assert "--sft" in sft["command"] and "--pretrained-checkpoint $OUT/runs/jreg-a1/seed-1/checkpoints" in \
        sft["command"] and sft["command"].endswith("--jreg-lambda 0")
    assert json.loads((out / "gate.json").read_text())["passed"]
    report = (out / "report.md").read_text()
    for heading in ("## Design", "## What came out", "### Where this differs from the paper",
                    "## Primary and secondary contrasts", "## Final checkpoints per arm", "## ζ_L through training",
                    "## Displacement per layer", "## Iso-loss comparison", "## SFT analogue",
                    "## Provenance and cost"):
        assert heading in report, heading
    for name in ("zeta", "psi", "ce"):
        assert (out / f"report_{name}.png").stat().st_size > 1000 and f"(report_{name}.png)" in report
    assert (out / ".gitignore").read_text() == "*\n"


@pytest.mark.slow
def test_report_is_a_function_of_the_raw_files_alone(quick, tmp_path):
    out, proc = quick
    assert proc.returncode == 0
    copy = tmp_path / "raw"
    shutil.copytree(out / "raw", copy)
    text, _ = study_report.report_text(copy, out / "report.md")  # only the header names the raw folder
    assert text.split("## Design")[1] == (out / "report.md").read_text().split("## Design")[1]


def test_committed_report_matches_its_committed_raw_results():
    raw, report = ROOT / "experiments" / "study" / "raw_v2", ROOT / "experiments" / "study" / "report_v2.md"
    text, _ = study_report.report_text(raw, report)
    assert text == report.read_text(encoding="utf-8"), "regenerate: python experiments/study/study_report.py " \
        "--raw experiments/study/raw_v2 --report experiments/study/report_v2.md"


@pytest.mark.slow
def test_second_invocation_skips_finished_runs_and_resumes_an_interrupted_one(quick):
    out, proc = quick
    assert proc.returncode == 0
    run = out / "runs" / "jreg-a1" / "seed-2"  # interrupted after its first checkpoint (step 4 of 8)
    shutil.rmtree(run / "checkpoints" / "iter_0000008")
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("4")
    for name in ("train.done", "post.done", "measures.json"):
        (run / name).unlink()
    before = {arm: len(_attempts(out / "runs" / arm / "seed-2")) for arm in ARMS}
    again = _study(out)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "[study] study: 1 run(s) to do" in again.stdout
    assert "jreg-a1/seed-2: resuming from its checkpoint at step 4" in again.stdout
    for arm in ARMS[:2]:
        assert len(_attempts(out / "runs" / arm / "seed-2")) == before[arm]
    new = _attempts(run)[before["jreg-a1"]:]
    assert [(a["kind"], a["from_iteration"], a["to_iteration"]) for a in new] == [("train", 4, 8), ("post", 0, 8)]
    lines = [json.loads(x) for x in (out / "invocations.jsonl").read_text().splitlines()]
    # each invocation is recorded when it starts (a killed one still shows) and again when it ends
    assert [x["wall_s"] is None for x in lines] == [True, False, True, False]
    assert len(json.loads((out / "raw" / "study.json").read_text())["invocations"]) == 2


@pytest.mark.slow
def test_failed_pilot_gate_stops_after_the_pilot_and_says_so(quick, tmp_path):
    out, proc = quick
    assert proc.returncode == 0
    gated = tmp_path / "gated"
    shutil.copytree(out / "data", gated / "data")
    for arm in ("baseline-large", "baseline-small"):  # the finished pilot, nothing else
        shutil.copytree(out / "runs" / arm / "seed-1", gated / "runs" / arm / "seed-1")
    again = _study(gated, "--gate", "100")
    assert again.returncode == 3, again.stdout[-3000:] + again.stderr[-3000:]
    assert "pilot gate failed" in again.stdout and "stopping: this regime has no jump" in again.stdout
    assert not (gated / "runs" / "jreg-a1" / "seed-1" / "train.done").exists()
    report = (gated / "report.md").read_text()
    assert "against the threshold 100: failed: the study stopped after the pilot" in report


@pytest.mark.slow
def test_other_settings_on_an_existing_output_are_refused(quick):
    out, _ = quick
    proc = _study(out, "--large-steps", "6")
    assert proc.returncode != 0
    assert "holds a run with other settings (" in proc.stderr and "steps: 4 there, 6 now" in proc.stderr


@pytest.mark.parametrize("flags, message", [
    (["--large-steps", "15"], "--large-steps 15: must be a multiple of 10"),
    (["--seeds", "0"], "--seeds 0: must be at least 1"),
    (["--sft-seeds", "9"], "--sft-seeds 9: must lie in 0..--seeds (4)"),
    (["--gate", "nan"], "--alphas and --gate must be finite numbers"),
])
def test_bad_settings_are_refused_in_one_line(flags, message, tmp_path):
    with pytest.raises(SystemExit) as e:
        study.config_from(study.build_parser().parse_args(["--output", str(tmp_path), *flags]))
    assert message in str(e.value)


def test_arms_share_one_token_budget_and_commands_carry_their_settings(tmp_path):
    cfg = study.config_from(study.build_parser().parse_args(["--output", str(tmp_path), "--alphas", "0.3", "1"]))
    arms = cfg.arms()
    assert [(a.name, a.batch, a.steps) for a in arms] == [
        ("baseline-large", 40, 200), ("baseline-small", 4, 2000), ("jreg-a0.3", 4, 2000), ("jreg-a1", 4, 2000)]
    assert len({a.tokens for a in arms}) == 1 and arms[0].tokens == 1_024_000
    assert cfg.jreg_arm == "jreg-a1"
    runs = study.pretrain_runs(cfg)
    data = study.Data(tmp_path, "TOK", tmp_path / "train_text_document", tmp_path / "heldout_text_document")

    def last(cmd: list[str], flag: str) -> str:  # Megatron-LM's parser keeps a repeated flag's last value
        return cmd[len(cmd) - 1 - cmd[::-1].index(flag) + 1]

    small = study.train_command(cfg, runs[2], data)  # jreg-a0.3 seed 1
    assert (last(small, "--seed"), last(small, "--init-mode")) == ("1", "layout-independent")
    assert (last(small, "--jreg-lambda"), last(small, "--jreg-alpha"), last(small, "--jreg-distance")) == \
        ("1", "0.3", "angular")
    assert (last(small, "--global-batch-size"), last(small, "--train-iters"), last(small, "--save-interval"),
            last(small, "--eval-iters"), last(small, "--num-layers")) == ("4", "2000", "200", "40", "12")
    large = study.train_command(cfg, runs[0], data)
    assert (last(large, "--global-batch-size"), last(large, "--save-interval"), last(large, "--eval-iters")) == \
        ("40", "20", "4")
    assert "--jreg-alpha" not in large
    sft = study.sft_runs(cfg, runs)
    assert [r.name for r in sft] == ["sft-baseline-small/seed-1", "sft-jreg-a1/seed-1", "sft-baseline-small/seed-2",
                                     "sft-jreg-a1/seed-2", "sft-baseline-small/seed-3", "sft-jreg-a1/seed-3"]
    cmd = study.train_command(cfg, sft[1], data)
    assert last(cmd, "--pretrained-checkpoint") == str(runs[3].dir / "checkpoints") and "--finetune" not in cmd
    assert last(cmd, "--jreg-lambda") == "0" and "--sft" in cmd


def test_paired_contrast_and_verdicts_against_scipy():
    from scipy import stats

    small, large = [1.9, 1.2, 2.4, 1.6], [0.8, 0.9, 1.1, 0.2]
    diffs = [a - b for a, b in zip(small, large)]
    t = study_report.paired(diffs, +1)
    assert t["p_paper"] == pytest.approx(stats.ttest_rel(small, large, alternative="greater").pvalue, rel=1e-9)
    assert t["p_other"] == pytest.approx(stats.ttest_rel(small, large, alternative="less").pvalue, rel=1e-9)
    assert t["p_two_sided"] == pytest.approx(stats.ttest_rel(small, large).pvalue, rel=1e-9)
    # lower is the paper's side: the same numbers read the other way
    t2 = study_report.paired(diffs, -1)
    assert t2["p_paper"] == pytest.approx(t["p_other"]) and t2["p_other"] == pytest.approx(t["p_paper"])
    assert study_report.verdict(t, 0.01, 0.9) == "confirmed"
    assert study_report.verdict(t2, 0.9, 0.01) == "contradicted"
    assert study_report.verdict(t, 0.2, 0.9) == "inconclusive"
    flat = study_report.paired([0.5, 0.5, 0.5], +1)
    assert "p_paper" not in flat and study_report.verdict(flat, None, None).startswith("not testable")
    assert study_report.holm({"a": 0.01, "b": 0.04, "c": 0.03}) == pytest.approx({"a": 0.03, "b": 0.06, "c": 0.06})


def test_sft_doc_shows_the_committed_reports_sft_section():
    report = (ROOT / "experiments" / "study" / "report_v2.md").read_text(encoding="utf-8")
    doc = (ROOT / "docs" / "sft.md").read_text(encoding="utf-8")
    assert study_report.sft_section(report), "experiments/study/report_v2.md has no SFT analogue section"
    assert study_report.sft_block(doc) == study_report.sft_section(report), "regenerate: python " \
        "experiments/study/study_report.py --raw experiments/study/raw_v2 --report experiments/study/report_v2.md " \
        "--sft-doc docs/sft.md"


def test_runs_selects_the_named_runs_and_their_parents_and_refuses_unknown_names(tmp_path):
    cfg = study.config_from(study.build_parser().parse_args(["--output", str(tmp_path)]))
    pretrain = study.pretrain_runs(cfg)
    sft = study.sft_runs(cfg, pretrain)
    chosen_pretrain, chosen_sft = study.select_runs(pretrain, sft, ["sft-jreg-a1/seed-3"])
    assert [r.name for r in chosen_pretrain] == ["jreg-a1/seed-3"]
    assert [r.name for r in chosen_sft] == ["sft-jreg-a1/seed-3"]
    with pytest.raises(SystemExit, match=r"--runs sft-jreg-a1/seed-9: no such run"):
        study.select_runs(pretrain, sft, ["sft-jreg-a1/seed-9"])


def test_merge_adds_new_runs_and_compares_reruns_of_committed_ones(tmp_path):
    committed = tmp_path / "committed"
    shutil.copytree(ROOT / "experiments" / "study" / "raw_v2", committed)
    new = tmp_path / "new"
    new.mkdir()
    study_json = json.loads((committed / "study.json").read_text())
    rerun = json.loads((committed / "baseline-small__seed-3.json").read_text())
    rerun["measures"]["series"][-1]["heldout"]["zeta_L-1"] += 0.5
    (new / "baseline-small__seed-3.json").write_text(json.dumps(rerun))
    sft = json.loads((committed / "sft-jreg-a1__seed-3.json").read_text())
    (committed / "sft-jreg-a1__seed-3.json").unlink()
    (new / "sft-jreg-a1__seed-3.json").write_text(json.dumps(sft))
    (new / "study.json").write_text(json.dumps({**study_json, "invocations": [{"argv": ["x"], "start": 1.0}]}))
    done = study_report.merge_raw(new, committed)
    assert done == ["re-run of baseline-small/seed-3 compared with the committed one", "added sft-jreg-a1/seed-3"]
    merged = json.loads((committed / "study.json").read_text())
    rep = {r["run"]: r for r in merged["reproductions"]}["baseline-small/seed-3"]
    assert rep["rerun"]["zeta_L-1"] - rep["committed"]["zeta_L-1"] == pytest.approx(0.5)
    assert json.loads((committed / "baseline-small__seed-3.json").read_text())["measures"] != rerun["measures"]
    assert merged["invocations"][-1]["start"] == 1.0
    with_removal = {**rerun, "removal": {"single": [0.1], "top_k": [1], "top": [0.1]}}
    (new / "baseline-small__seed-3.json").write_text(json.dumps(with_removal))  # the committed run has none
    assert study_report.merge_raw(new, committed)[0] == ("re-run of baseline-small/seed-3 replaced the committed "
                                                         "one (which had no layer removal)")
    assert json.loads((committed / "baseline-small__seed-3.json").read_text()) == with_removal
    merged = json.loads((committed / "study.json").read_text())
    rep = {r["run"]: r for r in merged["reproductions"]}["baseline-small/seed-3"]
    assert rep["replaced"] and rep["rerun"]["zeta_L-1"] - rep["committed"]["zeta_L-1"] == pytest.approx(0.5)
    other = {**study_json, "config": {**study_json["config"], "seeds": 9}}
    (new / "study.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="other settings"):
        study_report.merge_raw(new, committed)
