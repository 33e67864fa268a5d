"""`megatron-jreg evaluate`: LAMBADA top-1 and lm-eval tasks on a Hugging Face folder or a checkpoint."""

# ruff: noqa: E402 - the imports after sleep_while_waiting() load torch, and must come after it
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_jreg.process_env import sleep_while_waiting

sleep_while_waiting()  # before torch loads libgomp, which reads its wait policy once (megatron_jreg/process_env.py)
from megatron_jreg.data.text import DEFAULT_LAMBADA
from megatron_jreg.errors import run_command
from megatron_jreg.evaluate.config import EvaluateConfig
from megatron_jreg.evaluate.models import DTYPES
from megatron_jreg.evaluate.tasks import PAPER_TASKS, task_pairs
from megatron_jreg.hub import force_offline
from megatron_jreg.usage import example


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


def parse_config(argv: list[str] | None) -> EvaluateConfig:
    args = vars(build_parser().parse_args(argv))  # one config field per flag
    args["tasks"] = tuple(t.strip() for t in args["tasks"].split(","))
    args["task_data"] = {task: Path(path) for task, path in
                         task_pairs(args["task_data"], "--task-data", "PATH", "arc_easy=data/ai2_arc").items()}
    args["include_path"] = tuple(args["include_path"])
    return EvaluateConfig(**args)


def main(argv: list[str] | None = None) -> int:
    force_offline()  # before anything imports a Hugging Face library
    from megatron_jreg.evaluate.runner import evaluate

    return run_command("megatron-jreg evaluate", lambda: _run(parse_config(argv), evaluate))


def _run(cfg: EvaluateConfig, evaluate: Callable[[EvaluateConfig], Any]) -> int:
    """Evaluate, write --output first (the scores are never lost to a failing stdout), report skipped examples
    on stderr, print the table."""
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
