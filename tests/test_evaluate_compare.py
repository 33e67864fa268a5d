"""`megatron-jreg compare`: the paired t-test on both tails against scipy, undefined tests, Holm, metric
direction, lm-eval's results files, pairing and the CLI end to end."""

from __future__ import annotations

import json
import math

import pytest

BASELINE = [0.301, 0.312, 0.296, 0.305, 0.309]
JREG = [0.318, 0.315, 0.311, 0.304, 0.322]


@pytest.mark.parametrize("higher_is_better", [True, False])
def test_paired_test_reproduces_scipy_on_every_tail(higher_is_better):
    from scipy import stats

    from megatron_jreg.evaluate.stats import paired_one_sided

    test = paired_one_sided(JREG, BASELINE, higher_is_better=higher_is_better)
    better, worse = ("greater", "less") if higher_is_better else ("less", "greater")
    diffs = [j - b for j, b in zip(JREG, BASELINE)]
    ref_better = stats.ttest_rel(JREG, BASELINE, alternative=better)
    ref_worse = stats.ttest_rel(JREG, BASELINE, alternative=worse)
    two_sided = stats.ttest_rel(JREG, BASELINE)
    assert test.t == pytest.approx(ref_better.statistic, rel=1e-12)
    assert test.p_value == pytest.approx(ref_better.pvalue, rel=1e-10)
    assert test.p_worse == pytest.approx(ref_worse.pvalue, rel=1e-10)
    assert test.p_two_sided == pytest.approx(two_sided.pvalue, rel=1e-10)
    interval = stats.ttest_1samp(diffs, 0.0, alternative=better).confidence_interval(0.95)
    assert test.bound == pytest.approx(interval.low if higher_is_better else interval.high, rel=1e-10)
    assert test.mean_diff == pytest.approx(sum(diffs) / len(diffs))
    assert test.sd_diff == pytest.approx(stats.tstd(diffs), rel=1e-12)
    # JREG is higher by 0.0094 on average: better when higher is better, worse when lower is
    assert (test.significant, test.worse) == ((True, False) if higher_is_better else (False, True))
    assert test.defined and min(ref_better.pvalue, ref_worse.pvalue) < 0.05


def test_paired_test_at_another_confidence():
    from scipy import stats

    from megatron_jreg.evaluate.stats import paired_one_sided

    test = paired_one_sided(BASELINE, JREG, confidence=0.9)
    reference = stats.ttest_rel(BASELINE, JREG, alternative="greater")
    assert test.p_value == pytest.approx(reference.pvalue, rel=1e-10)
    assert test.bound == pytest.approx(reference.confidence_interval(0.9).low, rel=1e-10)
    assert not test.significant and test.worse


@pytest.mark.parametrize(
    ("jreg", "baseline"),
    [
        ([0.5, 0.6], [0.4, 0.5]),  # the same +0.1 on both seeds (up to rounding: 0.1 and 0.09999999999999998)
        ([0.4, 0.3], [0.3, 0.2]),  # a float tie: 0.09999999999999998 and 0.10000000000000003
        ([0.5, 0.6, 0.7, 0.8, 0.9], [0.4, 0.5, 0.6, 0.7, 0.8]),  # at n = 5 too
        ([0.5, 0.6], [0.5, 0.6]),  # no difference at all
        ([0.0, 0.0], [0.0, 0.0]),
    ],
)
def test_no_spread_is_undefined_not_significant(jreg, baseline):
    from megatron_jreg.evaluate.stats import paired_one_sided

    test = paired_one_sided(jreg, baseline)
    assert not test.defined and not test.significant and not test.worse
    assert all(math.isnan(v) for v in (test.t, test.p_value, test.p_worse, test.p_two_sided, test.bound))
    assert test.mean_diff == pytest.approx(sum(jreg) / len(jreg) - sum(baseline) / len(baseline), abs=1e-15)


@pytest.mark.filterwarnings("ignore:Precision loss occurred:RuntimeWarning")
def test_float_tie_that_scipy_calls_significant():
    """The case the tolerance is for: scipy's t on rounding noise is ~4e15 and p ~2e-16."""
    from scipy import stats

    from megatron_jreg.evaluate.stats import paired_one_sided

    reference = stats.ttest_rel([0.4, 0.3], [0.3, 0.2], alternative="greater")
    assert reference.pvalue < 1e-10
    assert not paired_one_sided([0.4, 0.3], [0.3, 0.2]).defined
    # a real spread of 1e-4 on scores of 0.3 is kept
    assert paired_one_sided([0.4, 0.3001], [0.3, 0.2]).defined


@pytest.mark.parametrize(
    ("jreg", "baseline", "message"),
    [
        ([0.5, math.nan], [0.4, 0.5], "JREG score 1 is nan"),
        ([0.5, 0.6], [math.inf, 0.5], "baseline score 0 is inf"),
        ([0.5, 0.6], [True, 0.5], "baseline score 0 is True"),
        ([0.5], [0.4], "at least 2 seeds"),
        ([0.5, 0.6], [0.4], "as many JREG as baseline"),
    ],
)
def test_paired_test_refuses_what_it_cannot_test(jreg, baseline, message):
    from megatron_jreg.evaluate.stats import paired_one_sided

    with pytest.raises(ValueError, match=message):
        paired_one_sided(jreg, baseline)
    with pytest.raises(ValueError, match="confidence"):
        paired_one_sided([0.5, 0.6], [0.4, 0.4], confidence=1.0)


def test_holm_adjustment():
    from megatron_jreg.evaluate.stats import holm

    # worked by hand: sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04 -> running max
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.6]) == [1.0, 1.0]
    assert holm([0.02]) == [0.02] and holm([]) == []
    adjusted = holm([0.01, math.nan, 0.02])  # the undefined test still counts: m = 3
    assert adjusted[0] == pytest.approx(0.03) and adjusted[2] == pytest.approx(0.04) and math.isnan(adjusted[1])
    with pytest.raises(ValueError, match="p-value 1.5"):
        holm([0.1, 1.5])


# ---------------------------------------------------------------------------------------------------
# the CLI


def _write(path, seed, lambada, boolq, extra=None, samples=100, ppl=20.0):
    from megatron_jreg.evaluate.results import EvalResults

    results = EvalResults(model={"kind": "hf", "path": str(path)}, seed=seed)
    results.add("lambada", {"acc": lambada, "acc_stderr": 0.01, "perplexity": ppl}, samples)
    results.add("boolq", {"acc": boolq, "acc_stderr": 0.01}, 100)
    if extra is not None:
        results.add("piqa", {"acc": extra}, 100)
    results.write(path)
    return str(path)


def _lm_eval_file(path, seed, scores: dict[str, dict[str, float]], n=12, group=None) -> str:
    """A results file in the layout lm-eval 0.4.13 writes (`--output_path`): "metric,filter" keys, alias and
    sample_len beside the metrics, "N/A" stderrs, higher_is_better / n-shot / n-samples per task, groups in
    group_subtasks. The layout is that of a file written by lm-eval's CLI in test_lm_eval_registration."""
    directions = {"acc": True, "perplexity": False, "word_perplexity": False, "bits_per_byte": False}
    record = {
        "results": {
            task: {"name": task, "alias": task, "sample_len": n}
            | {f"{m},none": v for m, v in metrics.items()}
            | {f"{m}_stderr,none": "N/A" for m in metrics}
            for task, metrics in scores.items()
        },
        "group_subtasks": {},
        "configs": {task: {"task": task, "num_fewshot": 0} for task in scores},
        "versions": {task: "Yaml" for task in scores},
        "n-shot": {task: 0 for task in scores},
        "higher_is_better": {task: {m: directions[m] for m in metrics} for task, metrics in scores.items()},
        "n-samples": {task: {"original": 2 * n, "effective": n} for task in scores},
        "config": {"model": "megatron-jreg", "model_args": {"hf": "/m"}, "limit": float(n), "random_seed": 0,
                   "numpy_seed": 1234, "torch_seed": 1234, "fewshot_seed": 1234},  # fmt: skip
        "lm_eval_version": "0.4.13",
    }
    if group is not None:
        name, subtasks = group
        record["group_subtasks"] = {name: subtasks}
        del record["n-samples"][name]
        record["groups"] = {name: record["results"][name]}
    if seed is not None:
        record["seed"] = seed
    path.write_text(json.dumps(record))
    return str(path)


def _run(argv, capsys):
    from megatron_jreg.evaluate import compare

    rc = compare.main(argv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_compare_cli_pairs_by_seed_and_averages(tmp_path, capsys):
    from scipy import stats

    from megatron_jreg.evaluate.stats import holm

    boolq_b, boolq_j = [0.61, 0.60, 0.63], [0.60, 0.62, 0.64]
    lam_b, lam_j = BASELINE[:3], JREG[:3]
    base = [_write(tmp_path / f"b{s}.json", s, lam_b[s], boolq_b[s], extra=0.5) for s in range(3)]
    # the JREG files are given in another order: pairing must follow the seed field
    jreg = [_write(tmp_path / f"j{s}.json", s, lam_j[s], boolq_j[s]) for s in (2, 0, 1)]
    out = tmp_path / "cmp.json"
    rc, printed, err = _run(["--baseline", *base, "--jreg", *jreg, "--output", str(out)], capsys)
    assert rc == 0 and err == ""
    assert "paired by seed" in printed and "left out" in printed and "piqa" in printed

    saved = json.loads(out.read_text())
    rows = saved["rows"]
    assert list(rows) == ["lambada", "boolq", "average"] and saved["average_of"] == ["lambada", "boolq"]
    avg_b = [(lam_b[s] + boolq_b[s]) / 2 for s in range(3)]
    avg_j = [(lam_j[s] + boolq_j[s]) / 2 for s in range(3)]
    p_tasks = []
    for name, j, b in (("lambada", lam_j, lam_b), ("boolq", boolq_j, boolq_b), ("average", avg_j, avg_b)):
        reference = stats.ttest_rel(j, b, alternative="greater")
        row = rows[name]
        assert row["higher_is_better"] and row["direction_from"] in ("name", "tasks")
        assert row["p_value"] == pytest.approx(reference.pvalue, rel=1e-9)
        assert row["p_worse"] == pytest.approx(stats.ttest_rel(j, b, alternative="less").pvalue, rel=1e-9)
        assert row["p_two_sided"] == pytest.approx(stats.ttest_rel(j, b).pvalue, rel=1e-9)
        assert row["lower_bound"] == pytest.approx(reference.confidence_interval(0.95).low, rel=1e-9)
        assert row["jreg_better"] == (reference.pvalue < 0.05) and not row["jreg_worse"]
        verdict = "JREG better" if reference.pvalue < 0.05 else "not significant"
        assert any(line.startswith(name) and line.endswith(verdict) for line in printed.splitlines())
        p_tasks.append(reference.pvalue)
    # two tasks: Holm over their one-sided p-values; the average is one summary test, not in the family
    assert [rows[t]["p_holm"] for t in ("lambada", "boolq")] == pytest.approx(holm(p_tasks[:2]))
    assert rows["average"]["p_holm"] is None and "p better (Holm)" in printed
    assert "Average over 2 task(s), 3 seeds: JREG better at 5%: " in printed
    assert "note: 2 tasks, each tested at 5%" in printed


def test_compare_perplexity_lower_is_better(tmp_path, capsys):
    """The issue's case: perplexity 60 against 5e8 is JREG better, not worse."""
    from scipy import stats

    base = [_write(tmp_path / f"b{s}.json", s, 0.3, 0.6, ppl=p) for s, p in enumerate([5e8, 4e8, 6.5e8])]
    jreg = [_write(tmp_path / f"j{s}.json", s, 0.3, 0.6, ppl=p) for s, p in enumerate([60.0, 58.0, 71.0])]
    out = tmp_path / "cmp.json"
    argv = ["--baseline", *base, "--jreg", *jreg, "--metric", "perplexity", "--output", str(out)]
    rc, printed, _ = _run(argv, capsys)
    assert rc == 0
    row = json.loads(out.read_text())["rows"]["lambada"]
    b, j = [5e8, 4e8, 6.5e8], [60.0, 58.0, 71.0]
    reference = stats.ttest_rel(j, b, alternative="less")
    assert not row["higher_is_better"] and row["direction_from"] == "name"
    assert row["p_value"] == pytest.approx(reference.pvalue, rel=1e-9) and row["jreg_better"]
    assert row["upper_bound"] == pytest.approx(reference.confidence_interval(0.95).high, rel=1e-9)
    assert "lower_bound" not in row
    assert "lambada  perplexity  lower" in printed and "JREG better at 5%: yes" in printed


def test_compare_says_when_jreg_is_significantly_worse(tmp_path, capsys):
    from scipy import stats

    base = [_write(tmp_path / f"b{s}.json", s, JREG[s], 0.6) for s in range(5)]
    jreg = [_write(tmp_path / f"j{s}.json", s, BASELINE[s], 0.6) for s in range(5)]
    out = tmp_path / "cmp.json"
    rc, printed, _ = _run(["--baseline", *base, "--jreg", *jreg, "--output", str(out)], capsys)
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    reference = stats.ttest_rel(BASELINE, JREG, alternative="less")
    assert rows["lambada"]["jreg_worse"] and not rows["lambada"]["jreg_better"]
    assert rows["lambada"]["p_worse"] == pytest.approx(reference.pvalue, rel=1e-9) and reference.pvalue < 0.05
    assert any(line.startswith("lambada") and line.endswith("JREG worse") for line in printed.splitlines())
    # boolq is equal on every seed: undefined; the average moves with lambada alone
    assert not rows["boolq"]["defined"] and rows["boolq"]["p_value"] is None
    assert any(line.startswith("boolq") and line.endswith("undefined (no spread)") for line in printed.splitlines())
    assert "JREG worse at 5%: yes" in printed


def test_compare_two_seeds_same_difference_is_undefined_and_warned(tmp_path, capsys):
    """The issue's "p = 0, better: yes" at n = 2: both seeds move by the same amount."""
    base = [_write(tmp_path / f"b{s}.json", s, 0.3 + s / 10, 0.6) for s in range(2)]
    jreg = [_write(tmp_path / f"j{s}.json", s, 0.4 + s / 10, 0.6) for s in range(2)]
    rc, printed, err = _run(["--baseline", *base, "--jreg", *jreg], capsys)
    assert rc == 0
    assert err.splitlines() == [
        "megatron-jreg compare: warning: only 2 seed pairs: with 1 degree of freedom a one-sided p < 5% needs "
        "t > 6.31; use at least 3 seeds per arm"
    ]
    rows = [line for line in printed.splitlines() if line.startswith(("lambada", "boolq", "average"))]
    assert len(rows) == 3 and all(line.endswith("undefined (no spread)") for line in rows)
    assert "JREG better at 5%: no; JREG worse at 5%: no" in printed
    assert "undefined: every seed's difference is the same" in printed


def test_compare_reads_lm_eval_results_files(tmp_path, capsys):
    """lm-eval's own files, without --metric acc,none: acc is compared, perplexity is lower-is-better as the
    files' higher_is_better says, the group row is compared but left out of the average."""
    from scipy import stats

    from megatron_jreg.evaluate import compare
    from megatron_jreg.evaluate.results import EvalResults

    accs_b, accs_j = [[0.30, 0.50], [0.32, 0.49], [0.29, 0.52]], [[0.35, 0.52], [0.36, 0.50], [0.33, 0.55]]

    def scores(t1: float, t2: float) -> dict:
        return {"grp": {"acc": (t1 + t2) / 2}, "t1": {"acc": t1, "perplexity": 30.0}, "t2": {"acc": t2}}

    group = ("grp", ["t1", "t2"])
    base = [_lm_eval_file(tmp_path / f"b{s}.json", s, scores(*accs_b[s]), group=group) for s in range(3)]
    jreg = [_lm_eval_file(tmp_path / f"j{s}.json", s, scores(*accs_j[s]), group=group) for s in range(3)]
    read = EvalResults.read(base[0])
    assert read.results["t1"] == {"acc": 0.30, "acc_stderr": None, "perplexity": 30.0, "perplexity_stderr": None}
    assert read.samples == {"t1": 12, "t2": 12} and read.n_shot["t1"] == 0 and read.seed == 0
    assert read.higher_is_better["t1"] == {"acc": True, "perplexity": False} and read.groups == {"grp": ["t1", "t2"]}
    out = tmp_path / "cmp.json"
    rc, printed, _ = _run(["--baseline", *base, "--jreg", *jreg, "--output", str(out)], capsys)
    assert rc == 0, printed
    saved = json.loads(out.read_text())
    assert list(saved["rows"]) == ["grp", "t1", "t2", "average"] and saved["average_of"] == ["t1", "t2"]
    assert saved["rows"]["t1"]["direction_from"] == "lm-eval"
    avg_b, avg_j = [sum(a) / 2 for a in accs_b], [sum(a) / 2 for a in accs_j]
    reference = stats.ttest_rel(avg_j, avg_b, alternative="greater")
    assert saved["rows"]["average"]["p_value"] == pytest.approx(reference.pvalue, rel=1e-9)
    assert "not the groups grp" in printed
    # --metric acc,none as lm-eval names it is the same metric
    assert compare.main(["--baseline", *base, "--jreg", *jreg, "--metric", "acc,none", "--output", str(out)]) == 0
    assert json.loads(out.read_text())["rows"]["average"]["p_value"] == pytest.approx(reference.pvalue, rel=1e-9)


def test_compare_direction_from_the_file_and_mixed_directions(tmp_path, capsys):
    """word_perplexity's direction comes from the file; a metric nobody names is assumed higher (said so),
    and tasks of opposite directions get no average row."""
    from megatron_jreg.evaluate.results import EvalResults

    def scores(ppl: float, acc: float) -> dict:
        return {"wikitext": {"word_perplexity": ppl}, "t2": {"acc": acc}}

    base = [_lm_eval_file(tmp_path / f"b{s}.json", s, scores(40.0 + s, 0.3 + s / 50)) for s in range(3)]
    jreg = [_lm_eval_file(tmp_path / f"j{s}.json", s, scores(38.0 + s * 1.1, 0.31 + s / 45)) for s in range(3)]
    out = tmp_path / "cmp.json"
    argv = ["--baseline", *base, "--jreg", *jreg, "--metric", "acc", "--task-metric", "wikitext=word_perplexity"]
    rc, printed, _ = _run([*argv, "--output", str(out)], capsys)
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert list(rows) == ["wikitext", "t2"] and not rows["wikitext"]["higher_is_better"]
    assert "note: no average: the tasks mix higher- and lower-is-better metrics" in printed
    # a metric without a known direction: assumed higher, noted; --lower-is-better turns it
    base, jreg = [], []
    for s in range(3):
        for arm, value, files in (("b", 1.0 + s / 10, base), ("j", 1.2 + s / 9, jreg)):
            EvalResults(results={"custom": {"score": value}}, seed=s).write(tmp_path / f"{arm}-custom{s}.json")
            files.append(str(tmp_path / f"{arm}-custom{s}.json"))
    rc, printed, _ = _run(["--baseline", *base, "--jreg", *jreg, "--metric", "score", "--output", str(out)], capsys)
    assert rc == 0 and "note: custom score: direction unknown, taken as higher is better" in printed
    assert json.loads(out.read_text())["rows"]["custom"]["jreg_better"]
    argv = ["--baseline", *base, "--jreg", *jreg, "--metric", "score", "--lower-is-better", "score"]
    rc, printed, _ = _run([*argv, "--output", str(out)], capsys)
    row = json.loads(out.read_text())["rows"]["custom"]
    assert rc == 0 and row["direction_from"] == "--lower-is-better" and row["jreg_worse"]
    assert "direction unknown" not in printed


def test_compare_pairs_files_without_seed_only_when_told(tmp_path, capsys):
    base = [_lm_eval_file(tmp_path / f"b{s}.json", None, {"t": {"acc": 0.3 + s / 100}}) for s in range(3)]
    jreg = [_lm_eval_file(tmp_path / f"j{s}.json", None, {"t": {"acc": 0.31 + s / 90}}) for s in range(3)]
    rc, _, err = _run(["--baseline", *base, "--jreg", *jreg], capsys)
    assert rc == 2 and f'{base[0]}: no "seed" field' in err and "--pair-by-order" in err
    rc, printed, _ = _run(["--baseline", *base, "--jreg", *jreg, "--pair-by-order"], capsys)
    assert rc == 0 and "paired by order (--pair-by-order)" in printed


def test_compare_refuses_unpaired_inputs(tmp_path, capsys):
    from megatron_jreg.evaluate import compare

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
    d = [_write(tmp_path / f"d{s}.json", s, 0.3, 0.6, samples=100 if s else 90) for s in range(3)]
    assert compare.main(["--baseline", *a, "--jreg", *d]) == 2
    assert f"lambada was scored with different numbers of examples ({a[0]}: 100" in capsys.readouterr().err


def test_one_file_per_arm_is_a_side_by_side_table_without_a_test(tmp_path, capsys):
    """A first look at one seed per arm: both scores, the difference and its direction per task, the test
    marked n/a (was: refused, "a t-test needs at least 2 seeds per arm"); the JSON says it was not tested."""
    base = _write(tmp_path / "b.json", 1, 0.40, 0.61, ppl=30.0)
    jreg = _write(tmp_path / "j.json", 1, 0.45, 0.60, ppl=20.0)
    out = tmp_path / "cmp.json"
    rc, printed, err = _run(["--baseline", base, "--jreg", jreg, "--output", str(out)], capsys)
    assert rc == 0, err
    assert "one seed per arm" in err and "at least 2 seeds per arm" in err
    lines = {line.split()[0]: line for line in printed.splitlines() if line.split()}
    assert "0.4000" in lines["lambada"] and "0.4500" in lines["lambada"] and "+0.0500" in lines["lambada"]
    assert "-0.0100" in lines["boolq"] and all(lines[t].endswith("n/a (1 seed per arm)") for t in ("lambada", "boolq"))
    assert "Average over 2 task(s), 1 seed per arm: mean difference +0.0200" in printed
    assert "no significance test" in printed and "Holm" not in printed
    rows = json.loads(out.read_text())["rows"]
    assert rows["lambada"]["tested"] is False and rows["lambada"]["p_value"] is None
    assert rows["lambada"]["mean_diff"] == pytest.approx(0.05) and not rows["lambada"]["jreg_better"]
    rc, printed, _ = _run(["--baseline", base, "--jreg", jreg, "--metric", "perplexity"], capsys)
    assert rc == 0 and "lower" in printed and "-10.0000" in printed
