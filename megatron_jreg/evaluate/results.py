"""The results format every evaluation writes, so any two runs can be compared.

    {"results": {task: {metric: value, metric_stderr: value | null}},
     "samples": {task: n}, "model": {...}, "seed": int | null, "config": {...},
     "skipped": {task: {reason: n}}}   (examples of the input not scored, and why)

Built-in tasks and lm-eval tasks land in the same shape: lm-eval's "acc,none" / "acc_stderr,none" keys
become "acc" / "acc_stderr" (a filter other than "none" stays as "acc,filter"), and its "N/A" stderr
becomes null.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

Metrics = dict[str, float | None]
_NOT_METRICS = ("alias", "name", "sample_len", "samples")


@dataclass
class EvalResults:
    results: dict[str, Metrics] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    config: dict[str, Any] = field(default_factory=dict)
    skipped: dict[str, dict[str, int]] = field(default_factory=dict)  # task -> {reason: examples not scored}

    def add(self, task: str, metrics: Metrics, n: int) -> None:
        self.results[task] = metrics
        self.samples[task] = n

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def write(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def read(cls, path: str | Path) -> EvalResults:
        """A result file written by `evaluate --output`; anything else fails naming the file."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            return cls(
                results={task: dict(metrics) for task, metrics in data["results"].items()},
                samples=dict(data.get("samples", {})),
                model=dict(data.get("model", {})),
                seed=data.get("seed"),
                config=dict(data.get("config", {})),
                skipped={task: dict(counts) for task, counts in data.get("skipped", {}).items()},
            )
        except (OSError, json.JSONDecodeError, KeyError, AttributeError, TypeError) as e:
            raise ValueError(f"{path}: not a result file of `megatron-jreg evaluate --output` ({e})") from e

    def table(self) -> str:
        """task | metric | value | stderr, one row per metric, tasks in the order they ran."""
        rows = [("task", "metric", "value", "stderr")]
        for task, metrics in self.results.items():
            for metric, value in metrics.items():
                if not metric.endswith("_stderr") and "_stderr," not in metric:
                    stderr = metrics.get(_stderr_key(metric))
                    rows.append((task, metric, _number(value), _number(stderr)))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _stderr_key(metric: str) -> str:
    name, _, filter_name = metric.partition(",")
    return f"{name}_stderr" + (f",{filter_name}" if filter_name else "")


def _number(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.4f}" if abs(value) < 1e5 else f"{value:.4e}"


def harness_metrics(task_results: dict[str, Any]) -> Metrics:
    """One task's lm-eval results in our metric naming."""
    metrics: Metrics = {}
    for key, value in task_results.items():
        if key in _NOT_METRICS:
            continue
        name, _, filter_name = key.partition(",")
        out = name if filter_name in ("", "none") else key
        metrics[out] = float(value) if isinstance(value, int | float) else None
    return metrics


def add_harness(results: EvalResults, raw: dict[str, Any]) -> None:
    """Add every task of an lm-eval `simple_evaluate` output to `results`."""
    for task, task_results in raw["results"].items():
        n = raw.get("n-samples", {}).get(task, {}).get("effective", 0)
        results.add(task, harness_metrics(task_results), int(n))
