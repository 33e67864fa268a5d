"""Study v4 (experiments/study): the pre-registered tests against brute force, the decision rules, the pre-registration
commit preceding every run and unchanged since, and the committed report as a function of the committed raw files."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STUDY = ROOT / "experiments" / "study"
RAW_V4 = STUDY / "raw_v4"
ANALYSIS = "experiments/study/study_v4_analysis.py"
sys.path[:0] = [str(ROOT / "examples"), str(STUDY)]

import study_v4_analysis as A  # noqa: E402


def _final(psi: list[float], ce: float, train: float = 4.0, top2: float = 0.5) -> dict:
    return {"heldout": {"psi": psi, "ce": ce}, "train": {"ce": train},
            "removal": {"single": [0.1] * len(psi), "top": {"1": top2 / 2, "2": top2, "3": 2 * top2}}}


RISING = [0.05, 0.05, 0.05, 0.04, 0.04, 0.04, 0.04, 0.04, 0.04, 0.05, 0.06, 0.08]  # R = 2
FLAT = [0.05, 0.05, 0.05, 0.04, 0.04, 0.04, 0.04, 0.04, 0.04, 0.03, 0.02, 0.01]  # R = −1


def _finals(costs: dict[str, list[float]], flat: tuple[str, ...]) -> dict:
    out = {}
    for i, s in enumerate(A.SEEDS):
        out["baseline", s] = _final(RISING, 4.3 + 0.01 * i)
        for arm, cost in costs.items():
            out[arm, s] = _final(FLAT if arm in flat else RISING, 4.3 + 0.01 * i + cost[i])
    return out


def test_iut_is_the_larger_of_two_exact_one_sided_tests():
    import numpy as np
    from scipy import stats as sp

    rng = np.random.default_rng(5)
    r, ce = rng.normal(-2, 1, 10), rng.normal(0.002, 0.006, 10)
    t = A.iut(list(r), list(ce))
    for x, shift, key in ((r, 0.0, "p_R"), (ce, A.DELTA, "p_CE")):
        ref = sp.permutation_test((x - shift,), np.mean, permutation_type="samples", alternative="less",
                                  n_resamples=math.inf)
        assert t[key] == pytest.approx(ref.pvalue, abs=1e-12)
    assert t["p"] == max(t["p_R"], t["p_CE"])


def test_an_arm_that_removes_the_rise_and_gains_passes_and_one_that_costs_does_not():
    n = len(A.SEEDS)
    gains = [-0.01 - 0.001 * (i % 3) for i in range(n)]
    costs = {"jreg-l0.1-a1": gains, "jreg-l0.3-a1": [0.02 + 0.001 * (i % 3) for i in range(n)],
             "jreg-l1-a1": gains, "jreg-l1-a0.3": gains, "jreg-l1-a0": gains, "lns": gains}
    result = A.analyse_stage1(_finals(costs, flat=("jreg-l0.1-a1", "jreg-l0.3-a1", "jreg-l1-a1")))
    p = result["primary"]
    assert result["family"] == 6
    assert p["iut:jreg-l0.1-a1"]["verdict"] == "passes" and p["iut:jreg-l1-a1"]["verdict"] == "passes"
    assert p["iut:jreg-l0.3-a1"]["verdict"].startswith("not shown (a cost below")
    assert p["iut:jreg-l1-a0.3"]["verdict"].startswith("not shown (the rise's removal")  # it keeps the rise
    assert p["lns:ce"]["verdict"] == "confirmed" and p["lns:R"]["verdict"] == "inconclusive"  # R diffs all 0
    assert result["secondary"]["jreg-l0.3-a1:ce"]["mean"] == pytest.approx(0.021, abs=1e-3)
    # stage 2 takes the passing arm with the smallest mean CE cost (equal here: the first by name), else J(1, 1)
    assert A.stage2_arm(result) in ("jreg-l0.1-a1", "jreg-l1-a1")
    result["primary"]["iut:jreg-l0.1-a1"]["CE"]["mean"] = -0.5
    assert A.stage2_arm(result) == "jreg-l0.1-a1"
    for key in ("iut:jreg-l0.1-a1", "iut:jreg-l1-a1"):
        result["primary"][key]["verdict"] = "not shown"
    assert A.stage2_arm(result) == A.STAGE2_DEFAULT


def test_a_failing_run_counts_against_its_arm_and_a_failing_baseline_drops_the_seed():
    n = len(A.SEEDS)
    fin = _finals({"jreg-l1-a1": [0.0] * n}, flat=("jreg-l1-a1",))
    s0, s1 = A.SEEDS[:2]
    del fin["jreg-l1-a1", s0], fin["baseline", s1]
    d = A.differences(fin, "jreg-l1-a1", "baseline", "ce", frozenset({("jreg-l1-a1", s0), ("baseline", s1)}))
    assert d[s0] == A.FAILED_CE_DIFF and s1 not in d and len(d) == n - 1


def test_gate_and_measures():
    fin = {("baseline", s): _final(RISING, 4.0) for s in A.GATE_SEEDS}
    assert A.gate_passes(fin)
    fin["baseline", A.GATE_SEEDS[1]] = _final(FLAT, 4.0)
    assert not A.gate_passes(fin)
    f = _final(RISING, 4.3, train=4.1, top2=0.7)
    assert A.metric("gap", f) == pytest.approx(0.2) and A.metric("removal_top2", f) == 0.7
    assert A.mid_share([0.1] * 12) == pytest.approx(0.5)  # layers 4..9 of 12
    assert math.isnan(A.metric("mid_share", {**f, "removal": None}))


def test_the_preregistration_is_unchanged_and_precedes_every_run():
    import study_v4_report

    prereg = study_v4_report.PREREGISTRATION
    changed = subprocess.run(["git", "-C", str(ROOT), "diff", "--stat", prereg, "--", ANALYSIS],
                             capture_output=True, text=True, check=True).stdout
    assert changed == "", f"{ANALYSIS} changed after the pre-registration {prereg}"
    runs = [json.loads(p.read_text()) for p in RAW_V4.glob("*__seed-*.json")]
    assert runs, "experiments/study/raw_v4 holds no run"
    commits = {a["commit"] for r in runs for a in r["attempts"]}
    assert None not in commits
    for c in commits:
        rc = subprocess.run(["git", "-C", str(ROOT), "merge-base", "--is-ancestor", prereg, c]).returncode
        assert rc == 0, f"run commit {c} does not descend from the pre-registration"
    assert {r["seed"] for r in runs} <= set(A.SEEDS)
    assert all(a.get("machine", {}).get("cpu") and a["machine"].get("torch") for r in runs for a in r["attempts"])


def test_committed_report_is_a_function_of_the_committed_raw_files(tmp_path):
    import study_v4_report

    text, _ = study_v4_report.report_text(RAW_V4, tmp_path, plots=False)
    committed = (ROOT / "docs" / "study.md").read_text(encoding="utf-8")
    assert text == committed, "regenerate: python experiments/study/study_v4_report.py " \
        "--raw experiments/study/raw_v4 --report docs/study.md"


def test_stage2_runs_the_arm_the_preregistered_rule_picks_from_stage_1s_raw_files(tmp_path):
    """What `study.py --stage1-raw` chooses (stage 2 on a machine without stage 1's run folders) is the rule's arm on
    the committed stage-1 results, and the flag is refused outside v4's stage 2 in one line."""
    import study_v4_report

    _, _, finals, failed = study_v4_report.load(RAW_V4)
    stage1 = {k: v for k, v in finals.items() if not k[0].startswith("d24-")}
    arm = A.stage2_arm(A.analyse_stage1(stage1, failed))
    assert study_v4_report.stage2_arm(finals) in (None, arm)
    for argv in (["--design", "v3"], ["--design", "v4", "--fallback"], ["--design", "v4"]):
        raw = RAW_V4 if argv != ["--design", "v4"] else tmp_path
        run = subprocess.run([sys.executable, str(STUDY / "study.py"), *argv, "--stage1-raw", str(raw),
                              "--output", str(tmp_path / "out")], capture_output=True, text=True)
        assert run.returncode != 0 and run.stderr.strip().count("\n") == 0, run.stderr
        assert "--stage1-raw" in run.stderr and not (tmp_path / "out").exists()
