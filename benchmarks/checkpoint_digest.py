"""Checkpoint integrity without stalls: the time of a torch_dist save written by N gloo ranks with no manifest, with
Megatron-LM's --verify-integrity (rank 0 alone hashes every file while the other ranks wait) and with megatron-jreg's
manifest (each rank hashes the shards it wrote, in threads, then one gather: training/checkpointing.py), and the
verification at load both ways, side by side in alternated rounds within one run.

    python benchmarks/checkpoint_digest.py [--gb 1.0] [--ranks 2] [--rounds 3] [--dir /tmp]

The checkpoint is --gb of float32 split evenly over the ranks (megatron-core's ShardedTensor, saved by its own
dist_checkpointing.save); every pass reads the files from the page cache the save just filled. Times are the
slowest rank's (the save returns to training when every rank has), medians over the rounds. Ends with one line:
`gb=… ranks=… save_s=… megatron_verify_save_s=… jreg_verify_save_s=… megatron_save_ratio=… jreg_save_ratio=…
megatron_load_verify_s=… jreg_load_verify_s=… load_verify_speedup=…`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

MODES = ("none", "megatron", "jreg")  # no manifest; Megatron-LM's verify_integrity=True; megatron-jreg's
LABELS = {"none": "no manifest", "megatron": "Megatron-LM --verify-integrity (rank 0)",
          "jreg": "megatron-jreg (every rank its shards)"}


def _slowest(seconds: float) -> float:
    import torch

    value = torch.tensor([seconds], dtype=torch.float64)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return float(value)


def _timed(fn) -> float:  # noqa: ANN001 - a callable run on every rank
    import torch

    torch.distributed.barrier()
    start = time.perf_counter()
    fn()
    return _slowest(time.perf_counter() - start)


def _rank(rank: int, world: int, port: int, gb: float, rounds: int, folder: str, queue) -> None:  # noqa: ANN001
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.validation import verify_integrity_manifest

    from megatron_jreg.checkpoints import verify_integrity
    from megatron_jreg.compat import apply_cpu_compat
    from megatron_jreg.training.checkpointing import digest_threads, finish_save

    apply_cpu_compat()  # without CUDA: megatron-core's writer synchronizes the (absent) device
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    rows = int(gb * 1e9) // 4 // 1024 // world
    local = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rank))
    state = {"weight": ShardedTensor.from_rank_offsets("weight", local, (0, rank, world))}

    def save(path: str, mode: str) -> None:
        Path(path).mkdir(exist_ok=True)  # as Megatron-LM's save_checkpoint makes it on every rank
        dist_checkpointing.save(state, path, verify_integrity=mode == "megatron")
        if mode == "jreg":
            finish_save(Path(path), None, digest=True)

    def verify_jreg(path: str) -> None:
        found = [verify_integrity(path, rank, world, digest_threads())]
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, found[0])
        assert sum(gathered) == len(list(Path(path).iterdir())) - 1

    save(f"{folder}/warm-up", "jreg")  # the first save sets megatron-core's strategies up: not timed
    saves: dict[str, list[float]] = {m: [] for m in MODES}
    loads: dict[str, list[float]] = {"megatron": [], "jreg": []}
    for r in range(rounds):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]  # alternated: no mode always first
        for mode in order:
            path = f"{folder}/{mode}-{r}"
            saves[mode].append(_timed(lambda p=path, m=mode: save(p, m)))
        loads["megatron"].append(_timed(lambda p=f"{folder}/megatron-{r}": verify_integrity_manifest(p)))
        loads["jreg"].append(_timed(lambda p=f"{folder}/jreg-{r}": verify_jreg(p)))
        files = sorted(p.name for p in Path(f"{folder}/jreg-{r}").iterdir())
        torch.distributed.barrier()
        if rank == 0:
            for mode in MODES:
                shutil.rmtree(f"{folder}/{mode}-{r}")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    if rank == 0:
        queue.put({"saves": saves, "loads": loads, "files": files, "threads": digest_threads()})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint size in GB (default: 1.0)")
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks writing it (default: 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three saves, alternated (default: 3)")
    parser.add_argument("--dir", default=None, help="where to write (default: the system's temporary folder)")
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args.gb, args.rounds, folder, queue))
                 for r in range(args.ranks)]
        for p in procs:
            p.start()
        result = queue.get(timeout=3600)
        for p in procs:
            p.join()
    saves = {m: statistics.median(v) for m, v in result["saves"].items()}
    loads = {m: statistics.median(v) for m, v in result["loads"].items()}
    print(f"{args.gb:.2f} GB torch_dist checkpoint written by {args.ranks} gloo rank(s) ({args.gb / args.ranks:.2f} GB "
          f"each; files {', '.join(result['files'])}), {args.rounds} rounds alternated, page cache warm, "
          f"{result['threads']} digest thread(s) per rank; slowest rank's seconds, median (min-max)")
    print("save")
    for mode in MODES:
        values = result["saves"][mode]
        print(f"  {LABELS[mode]:42s} {saves[mode]:7.2f} s ({min(values):.2f}-{max(values):.2f})  "
              f"x{saves[mode] / saves['none']:.2f} of no manifest")
    print("verify at load")
    for mode in ("megatron", "jreg"):
        values = result["loads"][mode]
        print(f"  {LABELS[mode]:42s} {loads[mode]:7.2f} s ({min(values):.2f}-{max(values):.2f})")
    ratio = {m: saves[m] / saves["none"] for m in MODES}
    print(f"gb={args.gb:.2f} ranks={args.ranks} save_s={saves['none']:.2f} "
          f"megatron_verify_save_s={saves['megatron']:.2f} jreg_verify_save_s={saves['jreg']:.2f} "
          f"megatron_save_ratio={ratio['megatron']:.2f} jreg_save_ratio={ratio['jreg']:.2f} "
          f"megatron_load_verify_s={loads['megatron']:.2f} jreg_load_verify_s={loads['jreg']:.2f} "
          f"load_verify_speedup={loads['megatron'] / loads['jreg']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
