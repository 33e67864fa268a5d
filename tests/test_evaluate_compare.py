"""`megatron-jreg compare`: the one-sided paired t-test against scipy, pairing, and the CLI end to end."""

from __future__ import annotations

import json
import math

import pytest
from scipy import stats

from megatron_jreg.evaluate import compare
from megatron_jreg.evaluate.results import EvalResults
from megatron_jreg.evaluate.stats import paired_one_sided

BASELINE = [0.301, 0.312, 0.296, 0.305, 0.309]
JREG = [0.318, 0.315, 0.311, 0.304, 0.322]


def test_paired_test_reproduces_scipy():
    test = paired_one_sided(JREG, BASELINE)
    diffs = [j - b for j, b in zip(JREG, BASELINE)]
    one_sample = stats.ttest_1samp(diffs, 0.0, alternative="greater")
    paired = stats.ttest_rel(JREG, BASELINE, alternative="greater")
    assert test.t == pytest.approx(one_sample.statistic, rel=1e-12) == paired.statistic
    assert test.p_value == pytest.approx(one_sample.pvalue, rel=1e-10)
    assert test.p_value == pytest.approx(paired.pvalue, rel=1e-10)
    assert test.lower_bound == pytest.approx(one_sample.confidence_interval(0.95).low, rel=1e-10)
    assert test.mean_diff == pytest.approx(sum(diffs) / len(diffs))
    assert test.significant == (one_sample.pvalue < 0.05) and test.significant

    worse = paired_one_sided(BASELINE, JREG, confidence=0.9)
    reference = stats.ttest_1samp([-d for d in diffs], 0.0, alternative="greater")
    assert worse.p_value == pytest.approx(reference.pvalue, rel=1e-10)
    assert worse.lower_bound == pytest.approx(reference.confidence_interval(0.9).low, rel=1e-10)
    assert not worse.significant


def test_paired_test_without_spread():
    up = paired_one_sided([0.5, 0.6], [0.4, 0.5])  # the same +0.1 on both seeds
    assert up.t == math.inf and up.p_value == 0.0 and up.lower_bound == pytest.approx(0.1)
    same = paired_one_sided([0.5, 0.6], [0.5, 0.6])
    assert math.isnan(same.t) and math.isnan(same.p_value) and not same.significant
    with pytest.raises(ValueError, match="at least 2 seeds"):
        paired_one_sided([0.5], [0.4])


def _write(path, seed, lambada, boolq, extra=None):
    results = EvalResults(model={"kind": "hf", "path": str(path)}, seed=seed)
    results.add("lambada", {"acc": lambada, "acc_stderr": 0.01, "perplexity": 20.0}, 100)
    results.add("boolq", {"acc": boolq, "acc_stderr": 0.01}, 100)
    if extra is not None:
        results.add("piqa", {"acc": extra}, 100)
    results.write(path)
    return str(path)


def test_compare_cli_pairs_by_seed_and_averages(tmp_path, capsys):
    boolq_b, boolq_j = [0.61, 0.60, 0.63], [0.60, 0.62, 0.64]
    lam_b, lam_j = BASELINE[:3], JREG[:3]
    base = [_write(tmp_path / f"b{s}.json", s, lam_b[s], boolq_b[s], extra=0.5) for s in range(3)]
    # the JREG files are given in another order: pairing must follow the seed field
    jreg = [_write(tmp_path / f"j{s}.json", s, lam_j[s], boolq_j[s]) for s in (2, 0, 1)]
    out = tmp_path / "cmp.json"
    assert compare.main(["--baseline", *base, "--jreg", *jreg, "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "paired by seed" in printed and "left out" in printed and "piqa" in printed

    rows = json.loads(out.read_text())["rows"]
    assert list(rows) == ["lambada", "boolq", "average"]
    avg_b = [(lam_b[s] + boolq_b[s]) / 2 for s in range(3)]
    avg_j = [(lam_j[s] + boolq_j[s]) / 2 for s in range(3)]
    for name, j, b in (("lambada", lam_j, lam_b), ("boolq", boolq_j, boolq_b), ("average", avg_j, avg_b)):
        reference = stats.ttest_1samp([x - y for x, y in zip(j, b)], 0.0, alternative="greater")
        assert rows[name]["p_value"] == pytest.approx(reference.pvalue, rel=1e-9)
        assert rows[name]["lower_bound"] == pytest.approx(reference.confidence_interval(0.95).low, rel=1e-9)
        assert rows[name]["jreg_better"] == (reference.pvalue < 0.05)
        verdict = "yes" if reference.pvalue < 0.05 else "no"
        assert any(line.startswith(name) and line.endswith(verdict) for line in printed.splitlines())
    assert "Average over 2 task(s), 3 seeds: JREG better at 5%: " in printed


def test_compare_refuses_unpaired_inputs(tmp_path, capsys):
    a = [_write(tmp_path / f"a{s}.json", s, 0.3, 0.6) for s in range(3)]
    b = [_write(tmp_path / f"b{s}.json", s, 0.3, 0.6) for s in range(2)]
    assert compare.main(["--baseline", *a, "--jreg", *b]) == 2
    assert "--baseline has 3 files and --jreg 2" in capsys.readouterr().err
    c = [_write(tmp_path / f"c{s}.json", s + 1, 0.3, 0.6) for s in range(3)]
    assert compare.main(["--baseline", *a, "--jreg", *c]) == 2
    assert "seeds do not pair up" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    assert compare.main(["--baseline", str(tmp_path / "bad.json"), *a[1:], "--jreg", *c]) == 2
    assert "not a result file" in capsys.readouterr().err
