"""Process-group setup: under torchrun (RANK/WORLD_SIZE/LOCAL_RANK set) or as one plain process."""

from __future__ import annotations

import datetime
import os
import random
import socket

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_jreg.compat import apply_cpu_compat, dist_backend
from megatron_jreg.config import ModelConfig, ParallelConfig
from megatron_jreg.training.model import virtual_pipeline_size


def world_from_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) for a plain process."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_owns_process_group = False


def init_process_group(timeout_minutes: int = 30) -> tuple[int, int]:
    """Start torch.distributed (NCCL on GPUs, gloo on CPU) unless a caller already did; (rank, world)."""
    global _owns_process_group
    apply_cpu_compat()
    rank, world, local_rank = world_from_env()
    if not dist.is_initialized():
        _owns_process_group = True
        if "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("MASTER_PORT", "29500")
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
        dist.init_process_group(dist_backend(), rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    return dist.get_rank(), dist.get_world_size()


def init_model_parallel(model: ModelConfig, parallel: ParallelConfig, seed: int) -> None:
    """megatron-core's parallel groups and seeds (the same seed on every rank; TP ranks get offsets)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_size(model, parallel),
        context_parallel_size=parallel.context_parallel_size,
    )
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def shutdown() -> None:
    """Tear down what init_process_group/init_model_parallel created (not a caller's process group)."""
    global _owns_process_group
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if _owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
    _owns_process_group = False
