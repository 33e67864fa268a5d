"""Checkpoints with megatron-core `dist_checkpointing`, in Megatron-LM's layout:

    SAVE/iter_0000100/               torch_dist shards + metadata.json (+ megatron_jreg.json)
    SAVE/latest_checkpointed_iteration.txt

Everything is resharded on load (TP/PP/VPP/DP may differ from the save). A save is atomic: shards are
written to `iter_XXXXXXX.partial`, renamed once every rank finished, and only then does the tracker
file (written to a temporary name and renamed) point at it. The run configuration is stored both in
the common state (plain types: loads with `weights_only`) and as readable JSON for other tools.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from megatron_jreg.training.sharding import unwrap

TRACKER = "latest_checkpointed_iteration.txt"
RUN_CONFIG = "megatron_jreg.json"
CHECKPOINT_VERSION = 3.0
# Megatron-LM's default format for the distributed optimizer: fully parallel, reshardable over DP only.
# (megatron-core's TP/PP-reshardable format needs TE's fused Adam state; the non-distributed
# optimizer's state is stored per parameter and reshards over every layout.)
CONTENT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def latest_iteration(root: str | Path) -> int | None:
    """The iteration the tracker file points at, or None when there is no complete checkpoint."""
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{tracker}: expected an iteration number, found {text!r}")
    return int(text)


def resolve(root: str | Path, iteration: int | None = None) -> tuple[Path, int]:
    """(checkpoint directory, iteration) for `root` (a save dir, or an iter_* dir) and optional iteration."""
    root = Path(root)
    if root.name.startswith("iter_") and (root / "metadata.json").is_file():
        return root, int(root.name[5:])
    if iteration is None:
        iteration = latest_iteration(root)
        if iteration is None:
            raise FileNotFoundError(f"{root}: no {TRACKER}; not a megatron-jreg checkpoint directory")
    path = iteration_dir(root, iteration)
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{path}: checkpoint for iteration {iteration} is missing or incomplete")
    return path, iteration


def read_run_config(root: str | Path, iteration: int | None = None) -> dict:
    """The TrainConfig (as a dict) a checkpoint was written with — enough to rebuild its model."""
    path, _ = resolve(root, iteration)
    return json.loads((path / RUN_CONFIG).read_text())


def _model_state(chunks: list[torch.nn.Module]) -> dict:
    if len(chunks) == 1:
        return {"model": unwrap(chunks[0]).sharded_state_dict()}
    return {f"model{i}": unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}


def _rng_state() -> dict:
    return {
        "random": random.getstate(),
        "np": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "device": torch.cuda.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    torch.cuda.set_rng_state(state["device"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _is_distributed(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in getattr(optimizer, "chained_optimizers", [optimizer]))


def _layout() -> dict:
    return {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
        "cp": parallel_state.get_context_parallel_world_size(),
    }


def _rng_sharded_object() -> ShardedObject:
    pp, tp = (parallel_state.get_pipeline_model_parallel_world_size(),
              parallel_state.get_tensor_model_parallel_world_size())
    offset = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank())
    return ShardedObject("rng_state", [_rng_state()], (pp, tp), offset,
                         replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))


@dataclass
class LoadedState:
    iteration: int
    consumed_train_samples: int
    path: Path


def save_checkpoint(
    root: str | Path,
    iteration: int,
    chunks: list[torch.nn.Module],
    optimizer,
    scheduler,
    consumed_train_samples: int,
    run_config: dict,
) -> Path:
    """Save model, optimizer, scheduler, RNG and data position at `iteration` (collective).

    optimizer/scheduler None writes a weights-only checkpoint (e.g. an import from Hugging Face), which
    the training CLI loads with --finetune or --no-load-optim.
    """
    root = Path(root)
    final = iteration_dir(root, iteration)
    rank = dist.get_rank()
    if latest_iteration(root) == iteration and final.is_dir():
        return final  # already saved (e.g. SIGTERM right after a periodic save)
    partial = final.with_name(final.name + ".partial")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
    dist.barrier()
    model_state = _model_state(chunks)
    state = {
        **model_state,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "consumed_train_samples": consumed_train_samples,
        "opt_param_scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng_state": _rng_sharded_object(),
        "parallel_layout": _layout(),
        "distributed_optimizer": optimizer is not None and _is_distributed(optimizer),
        "adam_steps": _adam_steps(optimizer) if optimizer is not None else None,
        "run_config_json": json.dumps(run_config),
    }
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(_merged(model_state), metadata=CONTENT_METADATA)
    dist_checkpointing.save(state, str(partial), content_metadata=CONTENT_METADATA)
    dist.barrier()
    if rank == 0:
        (partial / RUN_CONFIG).write_text(json.dumps(run_config, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        tmp = root / (TRACKER + ".tmp")
        tmp.write_text(str(iteration))
        os.replace(tmp, root / TRACKER)
    dist.barrier()
    return final


def _merged(model_state: dict) -> dict:
    """The optimizer maps its state onto all model chunks' sharded tensors at once."""
    if "model" in model_state:
        return model_state["model"]
    merged: dict = {}
    for i in range(len(model_state)):
        for key, value in model_state[f"model{i}"].items():
            merged[f"model{i}.{key}"] = value
    return merged


class CheckpointMismatch(ValueError):
    """The checkpoint's optimizer state cannot be loaded into this run's optimizer."""


def _check_optimizer_compatible(common: dict, optimizer, path: Path) -> None:
    saved = common.get("parallel_layout", {})
    now = _layout()
    saved_dist = bool(common.get("distributed_optimizer", False))
    if saved_dist != _is_distributed(optimizer):
        raise CheckpointMismatch(
            f"{path}: optimizer state was saved {'with' if saved_dist else 'without'} "
            "--use-distributed-optimizer; use the same setting to resume, or --no-load-optim to load weights "
            "with a fresh optimizer"
        )
    if saved_dist and (saved.get("tp"), saved.get("pp")) != (now["tp"], now["pp"]):
        raise CheckpointMismatch(
            f"{path}: distributed-optimizer state was saved at TP={saved.get('tp')} PP={saved.get('pp')} and "
            f"reshards only over data parallelism; this run has TP={now['tp']} PP={now['pp']}. Resume at the "
            "saved TP/PP, or add --no-load-optim (weights, scheduler and data position load; Adam moments start "
            "fresh)"
        )


def _materialize_optimizer_state(optimizer) -> None:
    """Give an unstepped distributed optimizer its Adam state before it describes it for loading.

    Without apex/TE, megatron-core's DistributedOptimizer reads `step` from torch's Adam state, which
    exists only after a first step; megatron's own helper takes a zero-gradient step (the parameters it
    touches are overwritten by the load right after).
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def _adam_steps(optimizer) -> int | None:
    """torch Adam's step count inside a DistributedOptimizer (None when TE/apex keep it elsewhere)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer):
            for state in opt.optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    return int(state["step"].item())
    return None


def _restore_adam_steps(optimizer, steps: int | None) -> None:
    """Without apex/TE, megatron-core's DistributedOptimizer does not restore torch Adam's per-parameter
    `step` on load (it keeps the pre-load value and shares one tensor between parameters), which breaks
    Adam's bias correction after a resume. Put back the saved count, one tensor per parameter."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if steps is None:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer):
            for state in opt.optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = torch.tensor(float(steps), dtype=state["step"].dtype, device=state["step"].device)


def load_checkpoint(
    root: str | Path,
    chunks: list[torch.nn.Module],
    optimizer=None,
    scheduler=None,
    iteration: int | None = None,
    load_rng: bool = True,
) -> LoadedState:
    """Load a checkpoint into this rank's chunks (and optimizer/scheduler when given), any layout."""
    path, iteration = resolve(root, iteration)
    common = dist_checkpointing.load_common_state_dict(str(path))
    model_state = _model_state(chunks)
    request = dict(model_state)
    same_layout = common.get("parallel_layout", {}).get("tp") == _layout()["tp"] and common.get(
        "parallel_layout", {}).get("pp") == _layout()["pp"]
    if load_rng and same_layout:
        request["rng_state"] = _rng_sharded_object()
    if optimizer is not None:
        _check_optimizer_compatible(common, optimizer, path)
        _materialize_optimizer_state(optimizer)
        request["optimizer"] = optimizer.sharded_state_dict(
            _merged(model_state), is_loading=True, metadata=CONTENT_METADATA
        )
    loaded = dist_checkpointing.load(request, str(path))
    if len(chunks) == 1:
        unwrap(chunks[0]).load_state_dict(loaded["model"], strict=False)
    else:
        for i, chunk in enumerate(chunks):
            unwrap(chunk).load_state_dict(loaded[f"model{i}"], strict=False)
    if optimizer is not None:
        with torch.no_grad():  # copies into leaf main params (fp32 DistributedOptimizer shards)
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(optimizer, common.get("adam_steps"))
    if scheduler is not None and common.get("opt_param_scheduler") is not None:
        scheduler.load_state_dict(common["opt_param_scheduler"])
    if "rng_state" in loaded:
        _set_rng_state(loaded["rng_state"][0])
    return LoadedState(iteration, int(common.get("consumed_train_samples", 0)), path)
