"""Training throughput of `megatron-jreg train` with λ = 0 against λ = 1, measured side by side.

Runs the real CLI (mock data) for the same model and batch, alternating baseline and JREG runs
(`--rounds` each) so machine noise hits both alike, and reads tokens/s and model TFLOP/s per rank from
each run's metrics file (the median over logged intervals, the first interval dropped as warm-up).

    python benchmarks/train_throughput.py                            # CPU: tiny preset
    python benchmarks/train_throughput.py --preset llama-170m --bf16 --micro-batch-size 8   # on a GPU

Last line: tokens_per_sec_ratio=… baseline_tokens_per_sec=… jreg_tokens_per_sec=… jreg_tflops_per_rank=…
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_once(args: argparse.Namespace, lam: float, workdir: Path, tag: str) -> tuple[float, float]:
    metrics = workdir / f"{tag}.jsonl"
    cmd = [
        sys.executable, "-m", "megatron_jreg.train", "--model-preset", args.preset, "--mock-data",
        "--vocab-size", str(args.vocab_size), "--micro-batch-size", str(args.micro_batch_size),
        "--global-batch-size", str(args.micro_batch_size), "--seq-length", str(args.seq_length),
        "--train-iters", str(args.iters), "--log-interval", str(args.log_interval), "--eval-interval", "1000000",
        "--lr", "1e-4", "--jreg-lambda", str(lam), "--jreg-alpha", "1", "--metrics-file", str(metrics),
        "--no-progress", *(["--bf16"] if args.bf16 else []),
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"run failed ({' '.join(cmd)}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    train = [r for r in recs if "tokens_per_sec" in r][1:]  # first interval includes warm-up
    return statistics.median(r["tokens_per_sec"] for r in train), statistics.median(r["tflops_per_rank"] for r in train)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--bf16", action="store_true")
    args = p.parse_args(argv)
    results: dict[float, list[tuple[float, float]]] = {0.0: [], 1.0: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for lam in ((0.0, 1.0) if r % 2 == 0 else (1.0, 0.0)):
                results[lam].append(run_once(args, lam, Path(tmp), f"r{r}-l{lam}"))
                print(f"round {r} lambda={lam:g}: {results[lam][-1][0]:.0f} tokens/s, "
                      f"{results[lam][-1][1]:.3f} TFLOP/s/rank", flush=True)
    tps = {lam: statistics.median(x[0] for x in v) for lam, v in results.items()}
    tflops = {lam: statistics.median(x[1] for x in v) for lam, v in results.items()}
    print(f"preset {args.preset}, batch {args.micro_batch_size}x{args.seq_length}, {'bf16' if args.bf16 else 'fp32'}")
    print(f"tokens_per_sec_ratio={tps[1.0] / tps[0.0]:.4f} baseline_tokens_per_sec={tps[0.0]:.1f} "
          f"jreg_tokens_per_sec={tps[1.0]:.1f} jreg_tflops_per_rank={tflops[1.0]:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
