"""`megatron-jreg` as an lm-eval model in lm-eval's own CLI (`python -m megatron_jreg.evaluate.lm_eval_model`: lm-eval
registers models only on import); requests go to `harness.HarnessLM`, as in `evaluate`: same numbers."""

# ruff: noqa: E402 - the imports after sleep_while_waiting() load torch, and must come after it
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from megatron_jreg.process_env import sleep_while_waiting

sleep_while_waiting()  # the wrapper's process, as evaluate's: before torch loads libgomp (megatron_jreg/process_env.py)
import torch
from lm_eval.api.registry import register_model

from megatron_jreg import hub
from megatron_jreg.errors import JregError, ModelFileError, UsageError
from megatron_jreg.evaluate.harness import HarnessLM
from megatron_jreg.evaluate.models import DTYPES, load_hf_lm, load_megatron_lm

NAME = "megatron-jreg"
USAGE = ("load=CKPT[,iteration=N] or hf=DIR[,dtype=auto|float32|bfloat16|float16][,max_length=N] (pretrained=PATH: "
         "either, by what PATH holds)")
EXAMPLE = ("megatron-jreg lm-eval --model megatron-jreg --model_args pretrained=ckpt/1b-jreg --tasks arc_easy "
           "--output_path results/")
logger = logging.getLogger(__name__)


ModelArgsError = UsageError  # `--model_args` that cannot work; the message names the argument and the fix


def _is_hf(spec: str) -> bool:
    """A Hugging Face folder (config.json) or a hub id in the local cache, rather than a checkpoint folder."""
    path = Path(spec).expanduser()
    if path.exists():
        return (path / "config.json").is_file()
    try:
        return (hub.resolve(spec, "pretrained=") / "config.json").is_file()
    except ModelFileError:
        return False


@register_model(NAME)
class MegatronJregLM(HarnessLM):
    """The lm-eval model `megatron-jreg`; its model_args: `USAGE` (docs/evaluate.md)."""

    def __init__(  # max_batch_size: lm-eval passes it; used only with batch_size auto
        self, pretrained: str | None = None, load: str | None = None, iteration: int | None = None,
        hf: str | None = None, dtype: str = "auto", max_length: int | None = None, batch_size: int | str = 8,
        device: str | None = None, max_batch_size: int | None = None, **unknown: Any,
    ) -> None:
        if unknown:
            raise ModelArgsError(f"--model_args {', '.join(sorted(unknown))}: unknown to {NAME}; give {USAGE}")
        key = "load"
        if pretrained is not None:
            key = "pretrained"
            if load is not None or hf is not None:
                raise ModelArgsError("--model_args: pretrained= names the model as load= or hf= do; give one of them")
            hf, load = (pretrained, None) if _is_hf(str(pretrained)) else (None, pretrained)
        if (load is None) == (hf is None):
            raise ModelArgsError(f"--model_args: give exactly one of load= and hf=; {USAGE}")
        if load is not None and (dtype != "auto" or max_length is not None):
            raise ModelArgsError("--model_args dtype=/max_length= apply to hf=; a checkpoint keeps its run's settings")
        if hf is not None and iteration is not None:
            raise ModelArgsError("--model_args iteration= selects a checkpoint of load=; drop it for hf=")
        if dtype not in DTYPES:
            raise ModelArgsError(f"--model_args dtype={dtype}: choose one of {', '.join(DTYPES)}")
        if max_length is not None and (not isinstance(max_length, int) or max_length < 2):
            raise ModelArgsError(f"--model_args max_length={max_length}: give a whole number of at least 2")
        if iteration is not None and (not isinstance(iteration, int) or iteration < 0):
            raise ModelArgsError(f"--model_args iteration={iteration}: give a checkpoint's iteration number")
        try:
            size = int(batch_size)
        except (TypeError, ValueError):  # 'auto': the adapter never measures memory
            raise ModelArgsError(f"--batch_size {batch_size}: {NAME} takes a number, not auto; e.g. --batch_size "
                                 "8") from None
        if size < 1:
            raise ModelArgsError(f"--batch_size {batch_size}: must be at least 1")
        if hf is not None:
            if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
                # lm-eval's CLI defaults to cuda:0; without a GPU, the CPU, as lm-eval's own `hf` model does
                logger.warning("%s: --device %s, but no CUDA device here; running on the CPU", NAME, device)
                device = "cpu"
            model = load_hf_lm(str(hf), device, dtype, max_length)
            self.source = {"hf": str(hf)}
        else:
            path = Path(str(load))
            if not path.exists():
                nor = " (nor a Hugging Face folder)" if key == "pretrained" else ""
                raise ModelArgsError(f"--model_args {key}={load}: no such checkpoint directory{nor}")
            model = load_megatron_lm(path, iteration)
            self.source = {"load": str(load), "iteration": getattr(model, "iteration", iteration)}
        super().__init__(model, size)

    def get_model_info(self) -> dict[str, Any]:
        """Recorded by lm-eval in its results' config."""
        return {"megatron_jreg_model": self.source}


def check_task_data() -> None:
    """The datasets of lm-eval's command line's tasks, checked as `evaluate` does before any model loads."""
    from lm_eval._cli import HarnessCLI

    from megatron_jreg.evaluate.tasks import check_datasets, task_manager, task_plans

    args = HarnessCLI().parse_args()  # argparse only; lm-eval parses the same sys.argv again
    if getattr(args, "command", None) != "run" or not getattr(args, "tasks", None):
        return
    names = list(dict.fromkeys(t.strip() for task in args.tasks for t in task.split(",") if t.strip()))
    include = [Path(args.include_path)] if getattr(args, "include_path", None) else []
    manager = task_manager(names, include)
    check_datasets(task_plans(manager, [n for n in names if n in manager.all_subtasks], {}))


def main(argv: list[str] | None = None) -> int:
    from megatron_jreg.hub import force_offline

    force_offline()
    from lm_eval.__main__ import cli_evaluate

    from megatron_jreg.evaluate.harness import quiet_git_hash

    saved = sys.argv  # lm-eval's CLI reads sys.argv; the caller's is restored (Megatron-LM re-reads it later)
    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    try:
        check_task_data()
        with quiet_git_hash():
            cli_evaluate()
    except (JregError, FileNotFoundError) as e:  # bad model_args, model files, non-finite logits
        print(f"megatron-jreg lm-eval: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        if e.code == 0 and {"-h", "--help"} & set(sys.argv):
            print(f"\nexample:\n  {EXAMPLE}")
        return int(e.code or 0)
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
