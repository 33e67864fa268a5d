"""`megatron-jreg compare`: did JREG beat the baseline, per task and on average, across seeds?

    megatron-jreg compare --baseline base-s1.json base-s2.json base-s3.json \\
                          --jreg jreg-s1.json jreg-s2.json jreg-s3.json

Runs are paired by their "seed" field when every file has one, else by position on the command line.
Each task's score is one metric ("acc" unless --metric / --task-metric say otherwise); the "average"
row is the one-sided paired t-test (stats.py) on each seed's mean over the compared tasks.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_jreg.evaluate.results import EvalResults
from megatron_jreg.evaluate.stats import PairedTest, paired_one_sided

AVERAGE = "average"


@dataclass(frozen=True)
class Row:
    metric: str
    baseline_mean: float
    jreg_mean: float
    test: PairedTest


def pair_runs(
    baseline: list[EvalResults], jreg: list[EvalResults]
) -> tuple[list[tuple[EvalResults, EvalResults]], str]:
    """(baseline, jreg) pairs of the same seed, and how they were paired ("seed" or "order")."""
    if len(baseline) != len(jreg):
        raise ValueError(
            f"--baseline has {len(baseline)} files and --jreg {len(jreg)}; give one per seed in each arm"
        )
    seeds_b, seeds_j = [r.seed for r in baseline], [r.seed for r in jreg]
    if None in seeds_b or None in seeds_j:
        return list(zip(baseline, jreg)), "order"
    if len(set(seeds_b)) != len(seeds_b) or sorted(seeds_b) != sorted(seeds_j):
        raise ValueError(
            f"seeds do not pair up: --baseline {seeds_b}, --jreg {seeds_j}; "
            "each seed must appear once per arm"
        )
    by_seed = {r.seed: r for r in jreg}
    return [(b, by_seed[b.seed]) for b in baseline], "seed"


def compare_runs(
    pairs: list[tuple[EvalResults, EvalResults]],
    metric_for: dict[str, str],
    default_metric: str,
    confidence: float = 0.95,
) -> tuple[dict[str, Row], list[str]]:
    """({task or "average": Row}, tasks left out because some file lacks them or their metric)."""
    runs = [run for pair in pairs for run in pair]
    candidates = list(dict.fromkeys(task for run in runs for task in run.results))
    tasks, skipped = [], []
    for task in candidates:
        metric = metric_for.get(task, default_metric)
        ok = all(isinstance(run.results.get(task, {}).get(metric), int | float) for run in runs)
        (tasks if ok else skipped).append(task)
    if not tasks:
        raise ValueError(f"no task has metric {default_metric!r} in every file; choose another with --metric")
    rows: dict[str, Row] = {}
    per_seed_b: list[list[float]] = [[] for _ in pairs]
    per_seed_j: list[list[float]] = [[] for _ in pairs]
    for task in tasks:
        metric = metric_for.get(task, default_metric)
        b = [float(base.results[task][metric]) for base, _ in pairs]
        j = [float(jr.results[task][metric]) for _, jr in pairs]
        for i in range(len(pairs)):
            per_seed_b[i].append(b[i])
            per_seed_j[i].append(j[i])
        rows[task] = Row(metric, sum(b) / len(b), sum(j) / len(j), paired_one_sided(j, b, confidence))
    avg_b = [sum(v) / len(v) for v in per_seed_b]
    avg_j = [sum(v) / len(v) for v in per_seed_j]
    metrics = sorted({metric_for.get(t, default_metric) for t in tasks})
    rows[AVERAGE] = Row(
        "/".join(metrics),
        sum(avg_b) / len(avg_b),
        sum(avg_j) / len(avg_j),
        paired_one_sided(avg_j, avg_b, confidence),
    )
    return rows, skipped


def format_rows(rows: dict[str, Row]) -> str:
    confidence = next(iter(rows.values())).test.confidence
    level = f"{round((1 - confidence) * 100, 6):g}%"
    header = (
        "task",
        "metric",
        "n",
        "baseline",
        "jreg",
        "diff",
        "p (one-sided)",
        f"{round(confidence * 100, 6):g}% lower",
        f"JREG better at {level}",
    )
    table = [header]
    for task, row in rows.items():
        t = row.test
        table.append(
            (
                task,
                row.metric,
                str(t.n),
                f"{row.baseline_mean:.4f}",
                f"{row.jreg_mean:.4f}",
                f"{t.mean_diff:+.4f}",
                _fmt(t.p_value, "{:.4g}"),
                _fmt(t.lower_bound, "{:+.4f}"),
                "yes" if t.significant else "no",
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    avg = rows[AVERAGE].test
    verdict = "yes" if avg.significant else "no"
    lines.append(
        f"Average over {len(rows) - 1} task(s), {avg.n} seeds: JREG better at {level}: {verdict} "
        f"(mean difference {avg.mean_diff:+.4f}, p = {_fmt(avg.p_value, '{:.4g}')}, "
        f"{round(confidence * 100, 6):g}% lower bound {_fmt(avg.lower_bound, '{:+.4f}')})"
    )
    return "\n".join(lines)


def _fmt(value: float, spec: str) -> str:
    return "-" if math.isnan(value) else spec.format(value)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def rows_to_json(rows: dict[str, Row], pairing: str, skipped: list[str]) -> dict:
    return {
        "pairing": pairing,
        "skipped_tasks": skipped,
        "rows": {
            task: {
                "metric": r.metric,
                "n": r.test.n,
                "baseline_mean": r.baseline_mean,
                "jreg_mean": r.jreg_mean,
                "mean_diff": r.test.mean_diff,
                "t": _finite(r.test.t),
                "p_value": _finite(r.test.p_value),
                "lower_bound": _finite(r.test.lower_bound),
                "confidence": r.test.confidence,
                "jreg_better": r.test.significant,
            }
            for task, r in rows.items()
        },
    }


def _metric_overrides(values: list[str]) -> dict[str, str]:
    out = {}
    for value in values:
        task, sep, metric = value.partition("=")
        if not sep or not task or not metric:
            raise ValueError(
                f"--task-metric {value}: write TASK=METRIC, e.g. --task-metric hellaswag=acc_norm"
            )
        out[task] = metric
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-jreg compare", description=__doc__.split("\n")[0])
    p.add_argument(
        "--baseline",
        nargs="+",
        type=Path,
        required=True,
        metavar="FILE",
        help="result files (evaluate --output) of the baseline arm, one per seed",
    )
    p.add_argument(
        "--jreg",
        nargs="+",
        type=Path,
        required=True,
        metavar="FILE",
        help="result files of the JREG arm, one per seed",
    )
    p.add_argument("--metric", default="acc", help="metric compared for every task (default: acc)")
    p.add_argument(
        "--task-metric",
        action="append",
        default=[],
        metavar="TASK=METRIC",
        help="another metric for one task, e.g. hellaswag=acc_norm (repeatable)",
    )
    p.add_argument(
        "--confidence", type=float, default=0.95, help="one-sided confidence level (default: 0.95)"
    )
    p.add_argument("--output", type=Path, metavar="FILE", help="also write the comparison as JSON")
    return p


def check_scores(runs: dict[Path, EvalResults], metric_for: dict[str, str], default_metric: str) -> None:
    """Refuse a file whose compared score is NaN, infinite or a boolean: a t-test on it gives nonsense
    (a NaN difference makes p = 0 and "JREG better: yes"). Scores that are absent or not numbers at all
    are left to `compare_runs`, which lists those tasks as left out."""
    for path, run in runs.items():
        for task, metrics in run.results.items():
            metric = metric_for.get(task, default_metric)
            value = metrics.get(metric) if isinstance(metrics, dict) else None
            if isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
                raise ValueError(
                    f"{path}: {task} {metric} is {value!r}, not a finite score; re-run `megatron-jreg evaluate` "
                    "for that model, or leave the file out"
                )


def check_settings(runs: dict[Path, EvalResults]) -> None:
    """Refuse files evaluated with different few-shot settings: their scores are not comparable."""
    shots = {path: run.config.get("num_fewshot") for path, run in runs.items()}
    if len(set(shots.values())) > 1:
        listed = ", ".join(f"{p.name}: {n}" for p, n in shots.items())
        raise ValueError(f"the files were evaluated with different --num-fewshot ({listed}); evaluate them alike")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if not 0.0 < args.confidence < 1.0:  # also refuses NaN
            raise ValueError(f"--confidence {args.confidence}: must be between 0 and 1, e.g. 0.95")
        if args.output is not None and args.output.is_dir():
            raise ValueError(f"--output {args.output}: is a folder; pass a file name, e.g. {args.output}/compare.json")
        overrides = _metric_overrides(args.task_metric)
        runs = {p: EvalResults.read(p) for p in [*args.baseline, *args.jreg]}
        if len(runs) < len(args.baseline) + len(args.jreg):
            raise ValueError("a result file is given twice; each seed's file belongs to one arm, once")
        check_scores(runs, overrides, args.metric)
        check_settings(runs)
        baseline = [runs[p] for p in args.baseline]
        jreg = [runs[p] for p in args.jreg]
        pairs, pairing = pair_runs(baseline, jreg)
        rows, skipped = compare_runs(pairs, overrides, args.metric, args.confidence)
    except ValueError as e:
        print(f"megatron-jreg compare: error: {e}", file=sys.stderr)
        return 2
    print(f"{len(pairs)} seed pairs, paired by {pairing}")
    if skipped:
        print(f"left out (missing from some file or without the metric): {', '.join(skipped)}")
    print(format_rows(rows))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(
            json.dumps(rows_to_json(rows, pairing, skipped), indent=2) + "\n", encoding="utf-8"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
