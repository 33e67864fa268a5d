"""lm-eval tasks: which configs to run, and whether their datasets are on this machine before any model loads, so
a missing dataset is one report for all tasks with the fix, not a traceback after the first tasks ran."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_jreg.errors import UsageError, one_line

# The paper's downstream tasks and the lm-eval config folder of each: indexing only those is fast.
PAPER_TASKS: dict[str, str] = {"boolq": "super_glue/boolq", "arc_easy": "arc", "hellaswag": "hellaswag", "piqa": "piqa",
                                "race": "race", "social_iqa": "siqa", "sciq": "sciq", "swag": "swag"}


def task_pairs(values: Sequence[str], flag: str, what: str, example: str) -> dict[str, str]:
    """Repeated `flag TASK=VALUE` options (evaluate's --task-data, compare's --task-metric) as {task: value}."""
    pairs = {}
    for value in values:
        task, sep, rest = value.partition("=")
        if not sep or not task or not rest:
            raise UsageError(f"{flag} {value}: write TASK={what}, e.g. {flag} {example}")
        pairs[task] = rest
    return pairs


def task_manager(names: Sequence[str], include_paths: Sequence[Path] = ()):
    """An lm-eval TaskManager that knows `names`: only the paper's folders when that suffices (indexing all is slow)."""
    from lm_eval import tasks as lm_eval_tasks
    from lm_eval.tasks import TaskManager

    user = [Path(p) for p in include_paths]
    if user:
        local = TaskManager(include_path=[str(p) for p in user], include_defaults=False)
        names = [n for n in names if n not in local.all_tasks]
    if all(n in PAPER_TASKS for n in names):
        root = Path(lm_eval_tasks.__file__).parent
        folders = [str(root / PAPER_TASKS[n]) for n in dict.fromkeys(names)]
        return TaskManager(include_path=folders + [str(p) for p in user], include_defaults=False)
    return TaskManager(include_path=[str(p) for p in user] or None)


def task_config(manager, name: str) -> dict[str, Any]:
    """The full config lm-eval would build task `name` from (includes merged, !function resolved)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    if name not in manager.all_tasks:
        raise UsageError(f"--tasks {name}: not an lm-eval task; run `lm_eval ls tasks` for the names, or pass "
                         "--include-path DIR with a task YAML that defines it")
    if name not in manager.all_subtasks:
        raise UsageError(f"--tasks {name}: an lm-eval group or tag; list the tasks it contains instead")
    entry = manager.task_index[name]
    return load_yaml(entry.yaml_path, resolve_func=True) if entry.yaml_path else dict(entry.cfg or {})


@dataclass(frozen=True)
class TaskPlan:
    """One lm-eval task as it will run; `replaced_dataset`: the Hub dataset `--task-data` replaced, if any."""

    name: str
    config: dict[str, Any]
    replaced_dataset: str | None = None

    @property
    def spec(self) -> str | dict[str, Any]:
        """What to hand to lm-eval: the bare name when nothing changed, so the task runs untouched."""
        return self.name if self.replaced_dataset is None else self.config


def task_plans(manager, names: Sequence[str], task_data: Mapping[str, Path]) -> list[TaskPlan]:
    """A plan per task; `--task-data NAME=DIR` swaps dataset_path for DIR and changes nothing else."""
    plans = []
    for name in names:
        config = task_config(manager, name)
        local = {"dataset_path": str(task_data[name])} if name in task_data else {}
        plans.append(TaskPlan(name, {**config, **local}, config.get("dataset_path") if local else None))
    return plans


def _missing(plan: TaskPlan, error: Exception) -> str:
    name, path, subset = plan.name, plan.config["dataset_path"], plan.config.get("dataset_name")
    reason = f"{type(error).__name__}: {one_line(error, 200)}"
    if plan.replaced_dataset is not None:
        return (f"{name}: --task-data {name}={path} does not load ({reason}). It must be a copy of the dataset "
                f"repository: `hf download --repo-type dataset {plan.replaced_dataset} --local-dir DIR` (for a "
                "repository that holds a loading script add `--revision refs/convert/parquet`).")
    import datasets

    load_args = repr(path) + (f", {subset!r}" if subset else "")
    where = f" (config {subset})" if subset else ""
    return (f"{name}: needs the Hugging Face dataset {path}{where}, which is not in the datasets cache "
            f'{datasets.config.HF_DATASETS_CACHE} ({reason}). Fix: on a machine with internet run `python -c "import '
            f'datasets; datasets.load_dataset({load_args})"` and copy its HF_DATASETS_CACHE folder here (or point '
            f"HF_DATASETS_CACHE at the copy), or run `hf download --repo-type dataset {path} --local-dir DIR` and pass "
            f"--task-data {name}=DIR.")


def check_datasets(plans: Sequence[TaskPlan]) -> None:
    """UsageError with one line per task whose data cannot be loaded offline (`custom_dataset`: not checkable)."""
    import datasets

    problems = []
    for plan in plans:
        config = plan.config
        if config.get("custom_dataset") is not None or not config.get("dataset_path"):
            continue
        kwargs = dict(config.get("dataset_kwargs") or {})
        kwargs.pop("trust_remote_code", None)  # lm-eval drops it too for datasets >= 4
        try:
            data = datasets.load_dataset(config["dataset_path"], config.get("dataset_name"), **kwargs)
        except Exception as error:  # noqa: BLE001 - any failure to load is the thing to report
            problems.append(_missing(plan, error))
            continue
        split = config.get("test_split") or config.get("validation_split")  # what lm-eval evaluates
        if split is not None and split not in data:
            problems.append(f"{plan.name}: dataset {config['dataset_path']} has no split {split!r} (has {list(data)})")
    if problems:
        raise UsageError("these lm-eval tasks have no data on this machine (nothing is downloaded at run time):\n  "
                         + "\n  ".join(problems))
