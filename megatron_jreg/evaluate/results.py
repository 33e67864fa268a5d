"""The results format every evaluation writes, built-in and lm-eval tasks in one shape ("acc,none" is "acc"), so
any two runs, ours or lm-eval's own results_*.json, can be compared."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_jreg.fileio import write_json

Metrics = dict[str, float | None]
_NOT_METRICS = ("alias", "name", "sample_len", "samples")


@dataclass
class EvalResults:
    results: dict[str, Metrics] = field(default_factory=dict)  # task -> {metric: value, metric_stderr: value|None}
    samples: dict[str, int] = field(default_factory=dict)  # task -> examples scored
    model: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    config: dict[str, Any] = field(default_factory=dict)
    skipped: dict[str, dict[str, int]] = field(default_factory=dict)  # task -> {reason: examples not scored}
    higher_is_better: dict[str, dict[str, bool]] = field(default_factory=dict)  # lm-eval's, per task and metric
    n_shot: dict[str, int] = field(default_factory=dict)  # lm-eval's few-shot count per task
    groups: dict[str, list[str]] = field(default_factory=dict)  # lm-eval group -> its subtasks

    def add(self, task: str, metrics: Metrics, n: int | None) -> None:
        """One task's metrics, scored on n examples (None: not known, e.g. an lm-eval group)."""
        self.results[task] = metrics
        if n is not None:
            self.samples[task] = n

    def write(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, asdict(self))

    @classmethod
    def read(cls, path: str | Path) -> EvalResults:
        """A result file written by `evaluate --output` or by lm-eval (recognised by its "n-samples")."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            results = cls.from_harness(data) if "n-samples" in data else cls(
                results={task: dict(metrics) for task, metrics in data["results"].items()},
                samples=dict(data.get("samples", {})), model=dict(data.get("model", {})), seed=data.get("seed"),
                config=dict(data.get("config", {})),
                skipped={task: dict(counts) for task, counts in data.get("skipped", {}).items()},
                higher_is_better={task: dict(m) for task, m in data.get("higher_is_better", {}).items()},
                n_shot=dict(data.get("n_shot", {})),
                groups={group: list(tasks) for group, tasks in data.get("groups", {}).items()},
            )
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
            raise ValueError(f"{path}: not a result file of `megatron-jreg evaluate --output` or lm-eval --output_path "
                             f"({e})") from e
        seed = results.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            example = seed.strip() if isinstance(seed, str) and seed.strip().isdigit() else "1"
            raise ValueError(f'{path}: "seed": {json.dumps(seed)} is not a whole number; write the training seed as '
                             f'one, e.g. "seed": {example}')
        return results

    @classmethod
    def from_harness(cls, raw: dict[str, Any]) -> EvalResults:
        config = dict(raw.get("config") or {})
        model = {"kind": "lm-eval", "model": config.get("model"), "model_args": config.get("model_args")}
        results = cls(model=model, seed=raw.get("seed"), config=config)
        add_harness(results, raw)
        return results

    def table(self) -> str:
        rows = [("task", "metric", "value", "stderr")]
        for task, metrics in self.results.items():
            for metric, value in metrics.items():
                if not metric.endswith("_stderr") and "_stderr," not in metric:
                    name, _, filter_name = metric.partition(",")
                    stderr = metrics.get(f"{name}_stderr" + (f",{filter_name}" if filter_name else ""))
                    rows.append((task, metric, format_number(value), format_number(stderr)))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def format_number(value: float | None, sign: str = "") -> str:
    """A score or difference: 4 decimals, or 4 significant digits past 1e5 (perplexities); None or NaN as "-"."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:{sign}.4f}" if abs(value) < 1e5 else f"{value:{sign}.4e}"


def add_harness(results: EvalResults, raw: dict[str, Any]) -> None:
    """Every task of an lm-eval `simple_evaluate` output (a group's example count is its subtasks': none recorded)."""
    counts = raw.get("n-samples") or {}
    for task, task_results in raw["results"].items():
        metrics: Metrics = {}  # "acc,none" as "acc"; a boolean stays one, for `compare` to refuse
        for key, value in task_results.items():
            if key not in _NOT_METRICS:
                name, _, filter_name = key.partition(",")
                metrics[name if filter_name in ("", "none") else key] = (
                    value if isinstance(value, bool) else float(value) if isinstance(value, int | float) else None)
        n = (counts.get(task) or {}).get("effective")
        results.add(task, metrics, None if n is None else int(n))
        directions = (raw.get("higher_is_better") or {}).get(task) or {}
        if known := {metric: flag for metric, flag in directions.items() if isinstance(flag, bool)}:
            results.higher_is_better[task] = known
        if isinstance(shots := (raw.get("n-shot") or {}).get(task), int):
            results.n_shot[task] = shots
    for group, subtasks in (raw.get("group_subtasks") or {}).items():
        if subtasks:
            results.groups[group] = list(subtasks)
