"""Study v3 (experiments/study): the pre-registered statistics against scipy and brute force, the endpoint
definitions, the committed report as a function of the committed raw files alone, and the pre-registration
commit preceding every run's recorded commit."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STUDY = ROOT / "experiments" / "study"
RAW_V3 = STUDY / "raw_v3"
sys.path[:0] = [str(ROOT / "examples"), str(STUDY)]

import study_v3_analysis as A  # noqa: E402


def test_sign_flip_equals_scipys_exact_paired_permutation_test():
    import numpy as np
    from scipy import stats as sp

    rng = np.random.default_rng(3)
    for _ in range(5):
        d = rng.normal(0.4, 1.0, size=9)
        ours = A.sign_flip(d)
        for alternative, key in (("two-sided", "two_sided"), ("greater", "greater"), ("less", "less")):
            ref = sp.permutation_test((d,), np.mean, permutation_type="samples", alternative=alternative,
                                      n_resamples=math.inf)
            assert ours[key] == pytest.approx(ref.pvalue, abs=1e-12), alternative


def test_sign_flip_ci_is_the_set_of_shifts_the_test_keeps():
    import numpy as np

    d = [0.9, 1.4, -0.2, 0.7, 1.1, 0.3, 1.8, 0.5]
    lo, hi = A.sign_flip_ci(d)
    assert lo < np.mean(d) < hi
    grid = np.linspace(lo - 1, hi + 1, 801)
    kept = [mu for mu in grid if A.sign_flip(d, mu)["two_sided"] > A.LEVEL]
    assert min(kept) == pytest.approx(lo, abs=0.01) and max(kept) == pytest.approx(hi, abs=0.01)
    assert A.sign_flip_ci([1.0, 2.0, 3.0, 4.0]) == (-math.inf, math.inf)  # 2/16 > 0.05: no shift is rejected


def test_holm_verdicts_and_the_worse_finding():
    assert A.holm({"a": 0.01, "b": 0.04, "c": 0.03}) == pytest.approx({"a": 0.03, "b": 0.06, "c": 0.06})
    t = A.paired([0.1, 0.2, 0.15, 0.3, 0.25, 0.05, 0.2, 0.1], +1)
    assert t["p"] == pytest.approx(2 / 256) and t["p_predicted"] == pytest.approx(1 / 256)
    assert A.verdict(t, 0.01, +1) == "confirmed" and A.verdict(t, 0.01, -1) == "contradicted"
    assert A.verdict(t, 0.2, +1) == "inconclusive" and A.worse_finding(t)
    assert A.verdict(A.paired([0.5], +1), None, +1).startswith("not testable")


def test_power_is_the_level_at_no_effect_and_the_mde_reaches_the_target():
    level = A.family_level()
    assert A.power(0.0, 1.0, 12, level) <= 2 * level
    mde = A.mde(1.0, 12, level)
    assert A.power(mde, 1.0, 12, level) >= A.POWER > A.power(0.8 * mde, 1.0, 12, level)
    assert A.mde(1.0, 4, level) == math.inf


def test_endpoint_definitions():
    psi = [0.05, 0.06, 0.05, 0.04, 0.07, 0.06]
    assert A.top_rise(psi) == pytest.approx(100 * 0.03)  # ℓ = 5: 0.07 − 0.04
    assert A.top_rise([0.1, 0.09, 0.08, 0.07]) == pytest.approx(-1.0)  # unclipped
    assert A.middle_layers(12) == (4, 9)
    single = [0.5, 0.4, 0.3, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.2, 0.3, 0.9]
    assert A.dispersion(single) == pytest.approx(0.0, abs=1e-12)
    removal = {"single": single, "top": {"1": 0.9, "2": 1.5, "3": 2.0}}
    assert A.metric("removal_top", {}, removal) == 1.5 and A.metric("removal_top3", {}, removal) == 2.0
    assert math.isnan(A.metric("removal_top", {}, None))


def test_committed_report_is_a_function_of_the_committed_raw_files(tmp_path):
    import study_v3_report

    text, _ = study_v3_report.report_text(RAW_V3, STUDY, plots=False)
    committed = (STUDY / "report_v3.md").read_text(encoding="utf-8")
    assert text == committed, "regenerate: python experiments/study/study_v3_report.py " \
        "--raw experiments/study/raw_v3 --report experiments/study/report_v3.md"


def test_the_preregistration_precedes_every_runs_commit():
    import study_v3_report

    runs = [json.loads(p.read_text()) for p in RAW_V3.glob("*__seed-*.json")]
    commits = {a["commit"] for r in runs for a in r["attempts"]}
    assert runs and commits and None not in commits
    for c in commits:
        rc = subprocess.run(["git", "-C", str(ROOT), "merge-base", "--is-ancestor", study_v3_report.PREREGISTRATION,
                             c]).returncode
        assert rc == 0, f"run commit {c} does not descend from the pre-registration"
    assert {r["seed"] for r in runs} <= set(A.SEEDS)
