"""Run a function on N real gloo ranks (spawned processes) and collect each rank's return value.

Importing torch + megatron-core costs seconds per process, so callers run several checks per spawn.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    try:
        import multiprocessing

        import torch
        import torch.distributed as dist

        # A spawned child defaults to spawning too; Megatron-LM's data loader workers (a local
        # worker_init_fn) need Linux's default fork, as under torchrun.
        multiprocessing.set_start_method("fork", force=True)

        from megatron_jreg.compat import apply_cpu_compat

        torch.set_num_threads(1)
        apply_cpu_compat()
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, "ok", pickle.dumps(result)))  # plain bytes: no shared-memory fds
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 600) -> list[Any]:
    """fn(rank, world, *args) on `world` gloo ranks; returns the results ordered by rank."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
                break
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world)]
