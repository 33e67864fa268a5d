"""`evaluate`: check every task can run, load the model once, run LAMBADA and lm-eval, collect results."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from megatron_jreg import hub
from megatron_jreg.errors import UsageError
from megatron_jreg.evaluate.config import EvaluateConfig
from megatron_jreg.evaluate.lambada import evaluate_lambada, read_lambada
from megatron_jreg.evaluate.models import CausalLM, load_hf_lm, load_megatron_lm
from megatron_jreg.evaluate.results import EvalResults, add_harness
from megatron_jreg.evaluate.tasks import check_datasets, task_manager, task_plans
from megatron_jreg.hub import force_offline
from megatron_jreg.progress import show_progress


def load_model(cfg: EvaluateConfig) -> CausalLM:
    if cfg.hf is not None:
        return load_hf_lm(cfg.hf, cfg.device, cfg.dtype, cfg.max_length)
    return load_megatron_lm(cfg.load, cfg.iteration)


def _package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def evaluate(cfg: EvaluateConfig, manager=None) -> EvalResults:
    """Run `cfg.tasks` (`manager`: an lm-eval TaskManager to reuse); every task's data is checked before the model
    loads, so a missing dataset is one UsageError for all tasks before any compute."""
    force_offline()
    plans = []
    if cfg.harness_tasks:
        manager = manager or task_manager(cfg.harness_tasks, cfg.include_path)
        plans = task_plans(manager, cfg.harness_tasks, cfg.task_data)
        if problems := check_datasets(plans):
            raise UsageError(
                "these lm-eval tasks have no data on this machine (nothing is downloaded at run time):\n  "
                + "\n  ".join(problems)
            )
    passages, skipped = [], None
    if "lambada" in cfg.tasks:  # read before the model: a broken file stops the run before any compute
        passages, skipped = read_lambada(cfg.lambada_file)
        passages = passages[: cfg.limit]
    model = load_model(cfg)
    source = cfg.hf if cfg.hf is not None else cfg.load
    results = EvalResults(
        model={
            "kind": "hf" if cfg.hf is not None else "megatron",
            "path": str(Path(source).resolve()),
            "iteration": getattr(model, "iteration", cfg.iteration),  # --load: the iteration actually loaded
            **({"hub_id": hub_id} if cfg.hf is not None and (hub_id := hub.describe(cfg.hf)) else {}),
        },
        seed=cfg.seed,
        config={
            "tasks": list(cfg.tasks),
            "limit": cfg.limit,
            "batch_size": cfg.batch_size,
            "max_length": model.max_length,
            "lambada_file": str(cfg.lambada_file) if "lambada" in cfg.tasks else None,
            "num_fewshot": cfg.num_fewshot,
            "megatron_jreg": _package_version("megatron-jreg"),
            "lm_eval": _package_version("lm-eval") if plans else None,
        },
    )
    progress = show_progress(cfg.progress)
    if "lambada" in cfg.tasks:
        results.add("lambada", evaluate_lambada(model, passages, cfg.batch_size, progress), len(passages))
        if skipped:
            results.skipped["lambada"] = dict(sorted(skipped.items()))
    if plans:
        from megatron_jreg.evaluate.harness import run_harness

        raw = run_harness(
            model, [p.spec for p in plans], manager, cfg.limit, cfg.batch_size, cfg.bootstrap_iters, cfg.num_fewshot,
            progress,
        )
        if raw is not None:  # None on the ranks of a multi-process run that do not report
            add_harness(results, raw)
    order = {task: i for i, task in enumerate(cfg.tasks)}
    results.results = dict(sorted(results.results.items(), key=lambda kv: order.get(kv[0], len(order))))
    return results
