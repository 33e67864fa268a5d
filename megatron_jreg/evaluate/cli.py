"""`megatron-jreg evaluate`: LAMBADA top-1 and lm-eval tasks on a Hugging Face folder or a checkpoint."""

# ruff: noqa: E402 - the imports after sleep_while_waiting() load torch, and must come after it
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from megatron_jreg.process_env import sleep_while_waiting

sleep_while_waiting()  # before torch loads libgomp, which reads its wait policy once (megatron_jreg/process_env.py)
import torch

from megatron_jreg import hub
from megatron_jreg.data.text import DEFAULT_LAMBADA
from megatron_jreg.errors import UsageError, run_command
from megatron_jreg.evaluate.lambada import evaluate_lambada, read_lambada
from megatron_jreg.evaluate.models import DTYPES, check_model_flags, load_hf_lm, load_megatron_lm
from megatron_jreg.evaluate.results import EvalResults, add_harness
from megatron_jreg.evaluate.tasks import PAPER_TASKS, check_datasets, task_manager, task_pairs, task_plans
from megatron_jreg.fileio import check_output_folder
from megatron_jreg.model_files import read_config
from megatron_jreg.progress import show_progress
from megatron_jreg.usage import example

BUILTIN_TASKS = ("lambada",)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-jreg evaluate", description=__doc__.split("\n")[0],
                                **example("megatron-jreg evaluate --hf out/hf-jreg --tasks lambada,boolq,arc_easy "
                                          "--output results/jreg-s1.json"))
    model = p.add_mutually_exclusive_group()
    model.add_argument("--hf", type=Path, metavar="DIR|ID",
                       help="a Hugging Face model folder, or a hub id in the local cache")
    model.add_argument("--load", type=Path, metavar="CKPT", help="a megatron-jreg checkpoint (any TP/PP layout)")
    p.add_argument("--iteration", type=int, help="checkpoint iteration for --load (default: the latest)")
    p.add_argument("--tasks", default="lambada",
                   help=f"comma-separated: lambada (built-in) and lm-eval tasks, e.g. {','.join(PAPER_TASKS)} "
                   "(default: %(default)s)")
    p.add_argument("--lambada-file", type=Path, default=DEFAULT_LAMBADA,
                   help='LAMBADA JSONL, one {"text": ...} a line (default: the vendored test set, 5,153 passages)')
    p.add_argument("--limit", type=int, metavar="N", help="evaluate the first N examples of each task (default: all)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N",
                   help="sequences per forward pass; scores do not depend on it, memory and speed do "
                   "(default: %(default)s)")
    p.add_argument("--max-length", type=int, help="context window for --hf (default: the model's)")
    p.add_argument("--device", help="torch device for --hf (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights dtype for --hf; auto = the checkpoint's on GPU, float32 on CPU (default: %(default)s)")
    p.add_argument("--task-data", action="append", default=[], metavar="TASK=PATH",
                   help="run an lm-eval task from a local copy of its dataset repository (repeatable)")
    p.add_argument("--include-path", action="append", type=Path, default=[], metavar="DIR",
                   help="folder of extra lm-eval task YAMLs, e.g. tasks over local files (repeatable)")
    p.add_argument("--seed", type=int,
                   help="training seed of the model, stored so `compare` pairs runs by it (default: none)")
    p.add_argument("--bootstrap-iters", type=int, default=100000,
                   help="lm-eval bootstrap draws for stderrs without a closed form (perplexity) (default: %(default)s)")
    p.add_argument("--num-fewshot", type=int, metavar="N",
                   help="examples in each lm-eval task's prompt (default: each task's own; the built-in lambada is "
                   "zero-shot)")
    p.add_argument("--output", type=Path, metavar="FILE", help="write the results as JSON (default: print only)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars on stderr (default: when stderr is a terminal)")
    return p


@dataclass(frozen=True)
class EvaluateConfig:
    """What to evaluate and how (one field per flag), validated once so a bad flag costs no model load."""

    hf: Path | None = None  # a Hugging Face folder, or a hub id resolved to its cached snapshot
    load: Path | None = None
    iteration: int | None = None
    tasks: tuple[str, ...] = ("lambada",)
    lambada_file: Path = DEFAULT_LAMBADA
    limit: int | None = None  # first N examples of each task
    batch_size: int = 8
    max_length: int | None = None  # None: the model's context window
    device: str | None = None  # None: cuda when available, else cpu
    dtype: str = "auto"
    output: Path | None = None
    task_data: dict[str, Path] = field(default_factory=dict)  # lm-eval task -> local dataset copy
    include_path: tuple[Path, ...] = ()  # folders with extra lm-eval task YAMLs
    seed: int | None = None  # training seed of the model, recorded so `compare` can pair runs
    bootstrap_iters: int = 100000  # lm-eval's default; only bootstrapped metrics (perplexity) use it
    num_fewshot: int | None = None  # lm-eval tasks: examples in each prompt (None: each task's default)
    progress: bool | None = None  # bars on stderr; None: when stderr is a terminal

    def __post_init__(self) -> None:
        if self.hf is not None:
            object.__setattr__(self, "hf", hub.resolve(self.hf, "--hf"))  # a hub id: its cached snapshot
        check_model_flags(self.hf, self.load, self.iteration)
        if self.hf is not None:
            read_config(Path(self.hf), "--hf")
        if not self.tasks or len(set(self.tasks)) != len(self.tasks) or "" in self.tasks:
            raise UsageError(f"--tasks {','.join(self.tasks)}: give distinct task names, e.g. lambada,boolq")
        if "lambada" in self.tasks and not Path(self.lambada_file).is_file():
            raise UsageError(f'--lambada-file {self.lambada_file}: no such file (JSONL, one {{"text": ...}} a line)')
        for flag, value, least in (("--limit", self.limit, 1), ("--batch-size", self.batch_size, 1),
                                   ("--max-length", self.max_length, 2), ("--num-fewshot", self.num_fewshot, 0),
                                   ("--bootstrap-iters", self.bootstrap_iters, 0)):
            if value is not None and value < least:
                raise UsageError(f"{flag} {value}: must be at least {least}")
        if self.num_fewshot and "lambada" in self.tasks:
            raise UsageError(f"--num-fewshot {self.num_fewshot}: the built-in lambada is zero-shot; evaluate it in a "
                              "separate run, or use lm-eval's lambada_openai task instead")
        if self.device is not None:
            try:
                device = torch.device(self.device)
            except RuntimeError:
                raise UsageError(f"--device {self.device}: not a torch device; use cpu, cuda or cuda:N") from None
            if device.type == "cuda" and not torch.cuda.is_available():
                raise UsageError(f"--device {self.device}: no CUDA device here; use --device cpu")
        if self.output is not None:  # not created here: a failed run writes nothing
            out = Path(self.output)
            if out.is_dir():
                raise UsageError(f"--output {out}: is a folder; pass a file name, e.g. {out / 'results.json'}")
            check_output_folder(out.parent, f"--output {out}")
        for task, path in self.task_data.items():
            if task not in self.harness_tasks:
                raise UsageError(f"--task-data {task}={path}: {task} is not an lm-eval task in --tasks")
            if not Path(path).exists():
                raise UsageError(f"--task-data {task}={path}: no such file or folder")
        for path in self.include_path:
            if not Path(path).is_dir():
                raise UsageError(f"--include-path {path}: no such folder")

    @property
    def harness_tasks(self) -> tuple[str, ...]:
        return tuple(t for t in self.tasks if t not in BUILTIN_TASKS)


def parse_config(argv: list[str] | None) -> EvaluateConfig:
    args = vars(build_parser().parse_args(argv))  # one config field per flag
    args["tasks"] = tuple(t.strip() for t in args["tasks"].split(","))
    args["task_data"] = {task: Path(path) for task, path in
                         task_pairs(args["task_data"], "--task-data", "PATH", "arc_easy=data/ai2_arc").items()}
    args["include_path"] = tuple(args["include_path"])
    return EvaluateConfig(**args)


def _package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def evaluate(cfg: EvaluateConfig, manager=None) -> EvalResults:
    """Run `cfg.tasks` (`manager`: a TaskManager to reuse), every task's data checked before the model loads."""
    hub.force_offline()
    plans = []
    if cfg.harness_tasks:
        manager = manager or task_manager(cfg.harness_tasks, cfg.include_path)
        plans = task_plans(manager, cfg.harness_tasks, cfg.task_data)
        check_datasets(plans)
    passages, skipped = [], None
    if "lambada" in cfg.tasks:  # read before the model: a broken file stops the run before any compute
        passages, skipped = read_lambada(cfg.lambada_file)
        passages = passages[: cfg.limit]
    if cfg.hf is not None:
        model = load_hf_lm(cfg.hf, cfg.device, cfg.dtype, cfg.max_length)
    else:
        model = load_megatron_lm(cfg.load, cfg.iteration)
    source = cfg.hf if cfg.hf is not None else cfg.load
    results = EvalResults(
        model={"kind": "hf" if cfg.hf is not None else "megatron", "path": str(Path(source).resolve()),
               "iteration": getattr(model, "iteration", cfg.iteration),  # --load: the iteration actually loaded
               **({"hub_id": hub_id} if cfg.hf is not None and (hub_id := hub.describe(cfg.hf)) else {})},
        seed=cfg.seed,
        config={"tasks": list(cfg.tasks), "limit": cfg.limit, "batch_size": cfg.batch_size,
                "max_length": model.max_length,
                "lambada_file": str(cfg.lambada_file) if "lambada" in cfg.tasks else None,
                "num_fewshot": cfg.num_fewshot, "megatron_jreg": _package_version("megatron-jreg"),
                "lm_eval": _package_version("lm-eval") if plans else None})
    progress = show_progress(cfg.progress)
    if "lambada" in cfg.tasks:
        results.add("lambada", evaluate_lambada(model, passages, cfg.batch_size, progress), len(passages))
        if skipped:
            results.skipped["lambada"] = dict(sorted(skipped.items()))
    if plans:
        from megatron_jreg.evaluate.harness import run_harness

        raw = run_harness(model, [p.spec for p in plans], manager, cfg.limit, cfg.batch_size, cfg.bootstrap_iters,
                          cfg.num_fewshot, progress)
        if raw is not None:  # None on the ranks of a multi-process run that do not report
            add_harness(results, raw)
    order = {task: i for i, task in enumerate(cfg.tasks)}
    results.results = dict(sorted(results.results.items(), key=lambda kv: order.get(kv[0], len(order))))
    return results


def main(argv: list[str] | None = None) -> int:
    hub.force_offline()  # before anything imports a Hugging Face library
    return run_command("megatron-jreg evaluate", lambda: _run(parse_config(argv)))


def _run(cfg: EvaluateConfig) -> int:
    """Evaluate, write --output first (the scores are never lost to a failing stdout), then print."""
    results = evaluate(cfg)
    if cfg.output is not None:
        results.write(cfg.output)
    for task, counts in results.skipped.items():
        reasons = ", ".join(f"{n} {reason}" for reason, n in counts.items())
        print(f"megatron-jreg evaluate: {task}: skipped {sum(counts.values())} example(s): {reasons}", file=sys.stderr)
    print(results.table())
    if cfg.output is not None:
        print(f"wrote {cfg.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
