"""Checkpoint integrity without stalls: what the SHA-256 manifest adds to a torch_dist save written by N gloo ranks,
Megatron-LM's --verify-integrity (rank 0 alone hashes every file while the other ranks wait) against megatron-jreg's
(each rank hashes the shards it wrote, in threads, then one gather: training/checkpointing.finish_save), and the
verification at load both ways — on the same freshly saved files, in alternated order, within one run.

    python benchmarks/checkpoint_digest.py [--gb 1.0] [--ranks 2] [--rounds 5] [--dir /tmp]

Each round saves --gb of float32, split evenly over the ranks (megatron-core's ShardedTensor, its own
dist_checkpointing.save, no manifest: `save`), then writes the manifest Megatron-LM's way (its
save_integrity_manifest on rank 0, then a barrier, as its finalize step does) and megatron-jreg's way, and verifies
it both ways (megatron-core's verify_integrity_manifest; megatron_jreg.checkpoints.verify_integrity on every rank's
share, then a gather), the two in alternated order; every pass reads the files from the page cache the save
filled. Reported, as medians over the rounds: the slowest rank's wall seconds (the ranks continue when all have)
and the busiest rank's CPU seconds — what the step takes where each rank has a core of its own (a GPU node), which
a shared machine's wall time does not show (there ranks side by side may run no faster than one after the other).
Ends with one line: `gb=… ranks=… save_s=… megatron_manifest_s=… jreg_manifest_s=… megatron_manifest_cpu_s=…
jreg_manifest_cpu_s=… manifest_cpu_ratio=… megatron_verify_s=… jreg_verify_s=… megatron_verify_cpu_s=…
jreg_verify_cpu_s=… verify_cpu_ratio=…` (ratios: megatron-jreg's busiest rank over Megatron-LM's).

Recorded: docs/results/checkpoint_digest.txt (`--gb 2 --rounds 5`) and docs/results/checkpoint_digest_8gb.txt
(`--gb 8 --rounds 3`: 12 minutes on this 2-core machine beside a background experiment; the ranks hold the
tensors in memory, so its 24 GB of RAM caps the size near 16 GB, and 8 GB is written twice at once, the warm-up
save included).
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

LABELS = {"megatron": "Megatron-LM --verify-integrity (rank 0)", "jreg": "megatron-jreg (every rank its shards)"}


def _timed(fn, *args: object) -> tuple[float, float]:  # noqa: ANN001 - a callable run on every rank
    """(wall seconds, CPU seconds) of `fn(*args)` on the rank where each is largest, the ranks starting together.
    The CPU seconds of the busiest rank are what the step costs where every rank has a core of its own."""
    import torch

    torch.distributed.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    fn(*args)
    spent = torch.tensor([time.perf_counter() - wall, time.process_time() - cpu], dtype=torch.float64)
    torch.distributed.all_reduce(spent, op=torch.distributed.ReduceOp.MAX)
    return float(spent[0]), float(spent[1])


def _rank(rank: int, world: int, port: int, gb: float, rounds: int, folder: str, queue) -> None:  # noqa: ANN001
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.validation import save_integrity_manifest, verify_integrity_manifest

    from megatron_jreg.checkpoints import verify_integrity
    from megatron_jreg.compat import apply_cpu_compat
    from megatron_jreg.training.checkpointing import digest_threads, finish_save

    apply_cpu_compat()  # without CUDA: megatron-core's writer synchronizes the (absent) device
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    rows = int(gb * 1e9) // 4 // 1024 // world
    local = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rank))
    state = {"weight": ShardedTensor.from_rank_offsets("weight", local, (0, rank, world))}

    def save(path: str) -> None:
        Path(path).mkdir(exist_ok=True)  # as Megatron-LM's save_checkpoint makes it on every rank
        dist_checkpointing.save(state, path)

    def megatron_manifest(path: str) -> None:  # dist_checkpointing.save's integrity_finalize_fn
        if rank == 0:
            save_integrity_manifest(path)
        torch.distributed.barrier()

    def verify_jreg(path: str) -> None:  # training/checkpointing._load_checkpoint's verification
        counts: list = [None] * world
        torch.distributed.all_gather_object(counts, verify_integrity(path, rank, world, digest_threads()))
        assert sum(counts) == len(list(Path(path).iterdir())) - 1

    manifest = {"megatron": megatron_manifest, "jreg": lambda path: finish_save(Path(path), None, digest=True)}
    verify = {"megatron": verify_integrity_manifest, "jreg": verify_jreg}
    save(f"{folder}/warm-up")  # the first save sets megatron-core's strategies up: not timed
    times: dict[str, list[float]] = {"save": [], **{f"{k} {m}": [] for k in ("manifest", "verify") for m in LABELS}}
    for r in range(rounds):
        path = f"{folder}/round-{r}"
        times["save"].append(_timed(save, path))
        order = ("megatron", "jreg") if r % 2 == 0 else ("jreg", "megatron")  # neither always first
        for how in order:
            times[f"manifest {how}"].append(_timed(manifest[how], path))
        for how in order:
            times[f"verify {how}"].append(_timed(verify[how], path))
        files = sorted(p.name for p in Path(path).iterdir())
        torch.distributed.barrier()
        if rank == 0:
            shutil.rmtree(path)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    if rank == 0:
        queue.put({"times": times, "files": files, "threads": digest_threads()})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint size in GB (default: 1.0)")
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks writing it (default: 2)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of save, manifests, verifications (default: 5)")
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
    times = {k: [wall for wall, _ in v] for k, v in result["times"].items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in result["times"].items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.gb:.2f} GB torch_dist checkpoint written by {args.ranks} gloo rank(s) ({args.gb / args.ranks:.2f} GB "
          f"each; files {', '.join(result['files'])}), {args.rounds} rounds, page cache warm, "
          f"{result['threads']} digest thread(s) per rank, {os.cpu_count()} CPU cores, load average "
          f"{os.getloadavg()[0]:.1f}; medians (min-max) of the slowest rank's wall seconds, and the busiest rank's "
          "CPU seconds (the wall time where each rank has a core of its own)")

    def row(label: str, key: str, extra: str = "") -> None:
        print(f"  {label:42s} wall {med[key]:6.2f} s ({min(times[key]):.2f}-{max(times[key]):.2f})  "
              f"busiest rank's CPU {cpu[key]:6.2f} s{extra}")

    row("save, no manifest", "save")
    print("manifest at save (added to the save; every rank waits for it)")
    for how, label in LABELS.items():
        row(label, f"manifest {how}", f"  +{cpu[f'manifest {how}'] / cpu['save']:.0%} of the save's CPU")
    print("verification at load")
    for how, label in LABELS.items():
        row(label, f"verify {how}")
    print(f"gb={args.gb:.2f} ranks={args.ranks} save_s={med['save']:.2f} "
          f"megatron_manifest_s={med['manifest megatron']:.2f} jreg_manifest_s={med['manifest jreg']:.2f} "
          f"megatron_manifest_cpu_s={cpu['manifest megatron']:.2f} jreg_manifest_cpu_s={cpu['manifest jreg']:.2f} "
          f"manifest_cpu_ratio={cpu['manifest jreg'] / cpu['manifest megatron']:.2f} "
          f"megatron_verify_s={med['verify megatron']:.2f} jreg_verify_s={med['verify jreg']:.2f} "
          f"megatron_verify_cpu_s={cpu['verify megatron']:.2f} jreg_verify_cpu_s={cpu['verify jreg']:.2f} "
          f"verify_cpu_ratio={cpu['verify jreg'] / cpu['verify megatron']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
