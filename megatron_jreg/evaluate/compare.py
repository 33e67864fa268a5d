"""`megatron-jreg compare`: did JREG beat the baseline (or do worse), per task and on average, across seeds?
Runs pair by their "seed", so two arms listed in different orders still compare like with like."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import fmean

from scipy import stats

from megatron_jreg.errors import run_command
from megatron_jreg.evaluate.results import EvalResults
from megatron_jreg.evaluate.results import format_number as _value
from megatron_jreg.evaluate.stats import PairedTest, holm, paired_one_sided, untested
from megatron_jreg.evaluate.tasks import task_pairs
from megatron_jreg.fileio import write_json
from megatron_jreg.usage import example

AVERAGE = "average"
# Metric directions by name where no file says (lm-eval writes `higher_is_better`; our built-in tasks do not).
LOWER_IS_BETTER = frozenset(
    {"perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte", "bits-per-byte", "bpb", "loss", "ppl",
     "nll", "cross_entropy", "ter"}
)  # fmt: skip
HIGHER_IS_BETTER = frozenset(
    {"acc", "acc_norm", "acc_mutual_info", "f1", "exact_match", "em", "mcc", "bleu", "chrf", "rouge1", "rouge2",
     "rougeL"}
)  # fmt: skip
ASSUMED = "assumed"


@dataclass(frozen=True)
class Row:
    metric: str
    baseline_mean: float
    jreg_mean: float
    test: PairedTest
    direction_from: str  # "--higher-is-better"/"--lower-is-better", "lm-eval", "name" or "assumed"
    p_holm: float | None = None  # Holm-adjusted p (JREG better) over the task rows, when there are several


@dataclass
class Comparison:
    rows: dict[str, Row]
    skipped: list[str]  # tasks missing from some file or without the metric
    average_of: list[str]  # the tasks the average row is over (empty: no average row)
    notes: list[str] = field(default_factory=list)


def metric_name(metric: str) -> str:
    """lm-eval's "acc,none" is our "acc" (results.py); other filters keep their suffix."""
    return metric.removesuffix(",none")


def metric_direction(
    task: str, metric: str, runs: dict[Path, EvalResults], overrides: dict[str, bool]
) -> tuple[bool, str]:
    """(higher is better, where that came from: the command line, the files, the metric's name, or assumed)."""
    base = metric.partition(",")[0]
    for key in (metric, base):
        if key in overrides:
            return overrides[key], "--higher-is-better" if overrides[key] else "--lower-is-better"
    said = {p: flag for p, run in runs.items() if (flag := run.higher_is_better.get(task, {}).get(base)) is not None}
    if len(set(said.values())) > 1:
        listed = ", ".join(f"{p}: {'higher' if f else 'lower'}" for p, f in said.items())
        raise ValueError(f"the files disagree on whether {task} {base} is better higher or lower ({listed}); "
                         f"say which with --higher-is-better {base} or --lower-is-better {base}")
    if said:
        return next(iter(said.values())), "lm-eval"
    if base in LOWER_IS_BETTER or base.endswith(("_loss", "_perplexity", "_ppl")):
        return False, "name"
    if base in HIGHER_IS_BETTER:
        return True, "name"
    return True, ASSUMED


def pair_runs(
    baseline: list[Path], jreg: list[Path], runs: dict[Path, EvalResults], by_order: bool = False
) -> tuple[list[tuple[Path, Path]], str]:
    """(baseline, jreg) file pairs and "seed" or "order"; unless `by_order`, a file without a seed is refused: pairing
    by position would silently pair different seeds."""
    if len(baseline) != len(jreg):
        raise ValueError(f"--baseline has {len(baseline)} files and --jreg {len(jreg)}; give one per seed in each arm")
    seed = {path: runs[path].seed for path in [*baseline, *jreg]}
    if by_order:
        for b, j in zip(baseline, jreg):
            if None not in (seed[b], seed[j]) and seed[b] != seed[j]:
                raise ValueError(f"--pair-by-order pairs {b} (seed {seed[b]}) with {j} (seed {seed[j]}); list both "
                                 "arms in the same seed order, or leave out --pair-by-order to pair by seed")
        return list(zip(baseline, jreg)), "order"
    if unseeded := next((path for path, s in seed.items() if s is None), None):
        raise ValueError(f'{unseeded}: no "seed" field, so it cannot be paired with its '
                         f"seed\'s run in the other arm; write it with `megatron-jreg evaluate --seed N` (or add "
                         '"seed": N to the file), or pass --pair-by-order if --baseline and --jreg list the seeds in '
                         "the same order")
    seeds_b, seeds_j = [seed[p] for p in baseline], [seed[p] for p in jreg]
    if len(set(seeds_b)) != len(seeds_b) or sorted(seeds_b) != sorted(seeds_j):
        raise ValueError(f"seeds do not pair up: --baseline {seeds_b}, --jreg {seeds_j}; each seed must appear once "
                         "per arm")
    by_seed = {seed[p]: p for p in jreg}
    return [(b, by_seed[seed[b]]) for b in baseline], "seed"


def _agree(task: str, what: str, values: dict[Path, int | None], fix: str) -> None:
    known = {path: v for path, v in values.items() if v is not None}
    if len(set(known.values())) > 1:
        listed = ", ".join(f"{path}: {v}" for path, v in known.items())
        raise ValueError(f"{task} was scored with different {what} ({listed}); {fix}")


def compare_runs(pairs: list[tuple[Path, Path]], runs: dict[Path, EvalResults], metric_for: dict[str, str],
                 default_metric: str, confidence: float = 0.95,
                 directions: dict[str, bool] | None = None) -> Comparison:
    """Per-task rows and their average; the average leaves out groups whose subtasks are compared (they would count
    twice) and mixed directions."""
    directions = directions or {}
    paths = [path for pair in pairs for path in pair]
    candidates = list(dict.fromkeys(task for path in paths for task in runs[path].results))
    tasks, skipped = [], []
    for task in candidates:
        metric = metric_for.get(task, default_metric)
        ok = all(isinstance(runs[p].results.get(task, {}).get(metric), int | float) for p in paths)
        (tasks if ok else skipped).append(task)
    if not tasks:
        raise ValueError(f"no task has metric {default_metric!r} in every file; choose another with --metric")
    notes: list[str] = []
    rows: dict[str, Row] = {}
    per_task: dict[str, tuple[list[float], list[float]]] = {}
    for task in tasks:
        _agree(task, "numbers of examples", {p: runs[p].samples.get(task) for p in paths},
               "evaluate every model on the same examples (same data and --limit)")  # fmt: skip
        _agree(task, "few-shot counts", {p: runs[p].n_shot.get(task) for p in paths},
               "evaluate every model with the same --num-fewshot")  # fmt: skip
        metric = metric_for.get(task, default_metric)
        higher, source = metric_direction(task, metric, {p: runs[p] for p in paths}, directions)
        if source == ASSUMED:
            notes.append(f"{task} {metric}: direction unknown, taken as higher is better "
                         f"(--lower-is-better {metric} if lower is better)")
        b = [float(runs[base].results[task][metric]) for base, _ in pairs]
        j = [float(runs[jr].results[task][metric]) for _, jr in pairs]
        per_task[task] = (b, j)
        rows[task] = Row(metric, fmean(b), fmean(j), _test(j, b, confidence, higher), source)
    if len(rows) > 1 and len(pairs) > 1:
        adjusted = holm([row.test.p_value for row in rows.values()])
        rows = {task: replace(row, p_holm=p) for (task, row), p in zip(rows.items(), adjusted)}
        notes.append(f'{len(rows)} tasks, each tested at {_level(confidence)}: the chance of some false "better" is '
                     'higher; "p better (Holm)" adjusts for it')
    groups = {g: s for path in paths for g, s in runs[path].groups.items()}
    average_of = [t for t in tasks if not any(sub in rows for sub in groups.get(t, ()))]
    if left := [t for t in tasks if t not in average_of]:
        notes.append(f"average over the subtasks, not the groups {', '.join(left)} (they would count twice)")
    if len({rows[t].test.higher_is_better for t in average_of}) > 1:
        notes.append("no average: the tasks mix higher- and lower-is-better metrics")
        average_of = []
    if average_of:
        avg_b = [fmean([per_task[t][0][i] for t in average_of]) for i in range(len(pairs))]
        avg_j = [fmean([per_task[t][1][i] for t in average_of]) for i in range(len(pairs))]
        higher = rows[average_of[0]].test.higher_is_better
        rows[AVERAGE] = Row("/".join(sorted({rows[t].metric for t in average_of})), fmean(avg_b), fmean(avg_j),
                            _test(avg_j, avg_b, confidence, higher), "tasks")
    return Comparison(rows, skipped, average_of, notes)


def _test(jreg: list[float], baseline: list[float], confidence: float, higher: bool) -> PairedTest:
    if len(jreg) == 1:
        return untested(jreg[0], baseline[0], confidence, higher)
    return paired_one_sided(jreg, baseline, confidence, higher)


def _level(confidence: float) -> str:
    return f"{round((1 - confidence) * 100, 6):g}%"


def _verdict(test: PairedTest) -> str:
    if not test.tested:
        return "n/a (1 seed per arm)"
    if not test.defined:
        return "undefined (no spread)"
    return "JREG better" if test.significant else "JREG worse" if test.worse else "not significant"


def format_rows(comparison: Comparison) -> str:
    rows = comparison.rows
    confidence = next(iter(rows.values())).test.confidence
    level = _level(confidence)
    with_holm = any(row.p_holm is not None for row in rows.values())
    header = ["task", "metric", "better", "n", "baseline", "jreg", "diff", "p better", "p worse", "p two-sided"]
    header += ["p better (Holm)"] * with_holm + [f"{round(confidence * 100, 6):g}% bound", f"at {level}"]
    table = [header]
    for task, row in rows.items():
        t = row.test
        cells = [task, row.metric, "higher" if t.higher_is_better else "lower", str(t.n), _value(row.baseline_mean),
                 _value(row.jreg_mean), _value(t.mean_diff, "+"), _p(t.p_value), _p(t.p_worse),
                 _p(t.p_two_sided)]  # fmt: skip
        if with_holm:
            cells.append("" if row.p_holm is None else _p(row.p_holm))
        bound = "-" if math.isnan(t.bound) else (">= " if t.higher_is_better else "<= ") + _value(t.bound, "+")
        table.append([*cells, bound, _verdict(t)])
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    if AVERAGE in rows and not rows[AVERAGE].test.tested:
        avg = rows[AVERAGE].test
        lines.append(f"Average over {len(comparison.average_of)} task(s), 1 seed per arm: mean difference "
                     f"{_value(avg.mean_diff, '+')} ({'higher' if avg.higher_is_better else 'lower'} is better); "
                     "no significance test (it needs at least 2 seeds per arm, better 3)")
    elif AVERAGE in rows:
        avg = rows[AVERAGE].test
        direction, side = ("higher", "lower") if avg.higher_is_better else ("lower", "upper")
        lines.append(
            f"Average over {len(comparison.average_of)} task(s), {avg.n} seeds: JREG better at {level}: "
            f"{'yes' if avg.significant else 'no'}; JREG worse at {level}: {'yes' if avg.worse else 'no'} "
            f"(mean difference {_value(avg.mean_diff, '+')}, {direction} is better, p better = {_p(avg.p_value)}, "
            f"p worse = {_p(avg.p_worse)}, two-sided p = {_p(avg.p_two_sided)}, "
            f"{round(confidence * 100, 6):g}% {side} bound {_value(avg.bound, '+')}"
            + ("" if avg.defined else "; undefined: every seed's difference is the same")
            + ")"
        )
    return "\n".join(lines)


def _p(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.4g}"


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def rows_to_json(comparison: Comparison, pairing: str) -> dict:
    """The comparison as JSON; NaN (an undefined test) is null."""
    rows = {}
    for task, r in comparison.rows.items():
        t = r.test
        finite = {k: _finite(getattr(t, k)) for k in ("t", "p_value", "p_worse", "p_two_sided")}
        rows[task] = {"metric": r.metric, "higher_is_better": t.higher_is_better, "direction_from": r.direction_from,
                      "n": t.n, "baseline_mean": r.baseline_mean, "jreg_mean": r.jreg_mean, "mean_diff": t.mean_diff,
                      "sd_diff": t.sd_diff, **finite, "p_holm": None if r.p_holm is None else _finite(r.p_holm),
                      "lower_bound" if t.higher_is_better else "upper_bound": _finite(t.bound),
                      "confidence": t.confidence, "tested": t.tested, "defined": t.defined,
                      "jreg_better": t.significant, "jreg_worse": t.worse}
    return {"pairing": pairing, "skipped_tasks": comparison.skipped, "average_of": comparison.average_of,
            "notes": comparison.notes, "rows": rows}


def _direction_overrides(higher: list[str], lower: list[str]) -> dict[str, bool]:
    if both := sorted(set(map(metric_name, higher)) & set(map(metric_name, lower))):
        raise ValueError(f"--higher-is-better and --lower-is-better both name {', '.join(both)}; give one direction")
    return {**{metric_name(m): True for m in higher}, **{metric_name(m): False for m in lower}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-jreg compare", description=__doc__.split("\n")[0],
                                **example("megatron-jreg compare --baseline results/base-s{1,2,3}.json "
                                          "--jreg results/jreg-s{1,2,3}.json"))
    p.add_argument("--baseline", nargs="+", type=Path, required=True, metavar="FILE",
                   help="result files (evaluate --output, or lm-eval's results_*.json) of the baseline arm, one per "
                   "seed")
    p.add_argument("--jreg", nargs="+", type=Path, required=True, metavar="FILE",
                   help="result files of the JREG arm, one per seed")
    p.add_argument("--metric", default="acc", help="metric compared for every task (default: acc)")
    p.add_argument("--task-metric", action="append", default=[], metavar="TASK=METRIC",
                   help="another metric for one task, e.g. hellaswag=acc_norm (repeatable)")
    p.add_argument("--higher-is-better", action="append", default=[], metavar="METRIC",
                   help="a metric whose direction the files do not give and its name does not tell (repeatable)")
    p.add_argument("--lower-is-better", action="append", default=[], metavar="METRIC", help="the same, lower is better")
    p.add_argument("--pair-by-order", action="store_true",
                   help="pair the i-th --baseline file with the i-th --jreg file (for files without a seed, e.g. "
                   "lm-eval's)")
    p.add_argument("--confidence", type=float, default=0.95, help="one-sided confidence level (default: 0.95)")
    p.add_argument("--output", type=Path, metavar="FILE", help="also write the comparison as JSON (default: none)")
    return p


def check_scores(runs: dict[Path, EvalResults], metric_for: dict[str, str], default_metric: str) -> None:
    """Refuse a compared score that is NaN, infinite or a boolean: a NaN difference makes p = 0 and "JREG better: yes"
    (absent scores are `compare_runs`' to leave out)."""
    for path, run in runs.items():
        for task, metrics in run.results.items():
            metric = metric_for.get(task, default_metric)
            value = metrics.get(metric) if isinstance(metrics, dict) else None
            if isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
                raise ValueError(f"{path}: {task} {metric} is {value!r}, not a finite score; re-run `megatron-jreg "
                                 "evaluate` for that model, or leave the file out")


def check_settings(runs: dict[Path, EvalResults]) -> None:
    shots = {path: run.config.get("num_fewshot") for path, run in runs.items()}
    if len(set(shots.values())) > 1:
        listed = ", ".join(f"{p.name}: {n}" for p, n in shots.items())
        raise ValueError(f"the files were evaluated with different --num-fewshot ({listed}); evaluate them alike")


def _few_seeds_warning(n: int, confidence: float) -> str | None:
    """One line when n < 3 pairs: on 1 degree of freedom a t-test has almost no power."""
    if n >= 3:
        return None
    if n == 1:
        return ("megatron-jreg compare: note: one seed per arm: the scores side by side, without a significance "
                "test (it needs at least 2 seeds per arm; use at least 3)")
    critical = float(stats.t.ppf(confidence, n - 1))
    return (f"megatron-jreg compare: warning: only {n} seed pairs: with {n - 1} degree of freedom a one-sided p < "
            f"{_level(confidence)} needs t > {critical:.2f}; use at least 3 seeds per arm")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command("megatron-jreg compare", lambda: _compare(args))


def _compare(args: argparse.Namespace) -> int:
    if not 0.0 < args.confidence < 1.0:  # also refuses NaN
        raise ValueError(f"--confidence {args.confidence}: must be between 0 and 1, e.g. 0.95")
    if args.output is not None and args.output.is_dir():
        raise ValueError(f"--output {args.output}: is a folder; pass a file name, e.g. {args.output}/compare.json")
    overrides = {task: metric_name(m) for task, m in
                 task_pairs(args.task_metric, "--task-metric", "METRIC", "hellaswag=acc_norm").items()}
    directions = _direction_overrides(args.higher_is_better, args.lower_is_better)
    metric = metric_name(args.metric)
    runs = {p: EvalResults.read(p) for p in [*args.baseline, *args.jreg]}
    if len(runs) < len(args.baseline) + len(args.jreg):
        raise ValueError("a result file is given twice; each seed's file belongs to one arm, once")
    check_scores(runs, overrides, metric)
    check_settings(runs)
    pairs, pairing = pair_runs(args.baseline, args.jreg, runs, args.pair_by_order)
    comparison = compare_runs(pairs, runs, overrides, metric, args.confidence, directions)
    if warning := _few_seeds_warning(len(pairs), args.confidence):
        print(warning, file=sys.stderr)
    print(f"{len(pairs)} seed pair{'s' * (len(pairs) > 1)}, paired by {pairing}"
          + (" (--pair-by-order)" if pairing == "order" else ""))
    if comparison.skipped:
        print(f"left out (missing from some file or without the metric): {', '.join(comparison.skipped)}")
    print(format_rows(comparison))
    for note in comparison.notes:
        print(f"note: {note}")
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.output, rows_to_json(comparison, pairing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
