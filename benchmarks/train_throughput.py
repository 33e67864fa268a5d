"""Training throughput of `megatron-jreg train` with λ = 0 against λ = 1, measured side by side.

Runs the real CLI (Megatron-LM's loop, mock data, local spec) for the same model and batch, alternating
baseline and JREG runs (`--rounds` each) so that machine noise hits both alike. Each run is a process of
its own (`--worker`), which also reports its peak memory: allocated bytes on a GPU, peak RSS on CPU.
Tokens/s, model TFLOP/s per rank (Megatron-LM's FLOP count) and step time come from each run's
`--metrics-file`, over the steady iterations only: the first logged interval (compilation, allocator
warm-up) is dropped.

    python benchmarks/train_throughput.py                            # CPU: tiny preset
    python benchmarks/train_throughput.py --preset llama-170m --bf16 --seq-length 2048 --micro-batch-size 16 \
        --vocab-size 128256 --iters 30 --rounds 1                    # one GPU

On a GPU without Transformer Engine or apex, `GPU_FLAGS` switch off the fused kernels that only those
provide. Last line: tokens_per_sec_ratio=… time_ratio=… memory_ratio=… baseline_tokens_per_sec=…
jreg_tokens_per_sec=… baseline_tflops_per_rank=…
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Megatron-LM turns these fused kernels on by default; without Transformer Engine or apex (megatron-core
# 0.19.2's code):
# - gradient accumulation fusion needs apex's `fused_weight_gradient_mlp_cuda` (or TE): RuntimeError when
#   the linear layers are built;
# - RoPE fusion needs TE's `fused_apply_rotary_pos_emb`: assertion at the first forward;
# - masked-softmax fusion needs Megatron-LM's CUDA extension `scaled_masked_softmax_cuda` (not in the
#   megatron-core wheel): ImportError at the first bf16/fp16 attention (fp32 never asks for it).
# The bias-SwiGLU and bias-dropout-add fusions are torch.compile'd Python (megatron.core.jit): they run
# wherever triton does, and stay on (`EAGER_FLAGS` switches them off too).
GPU_FLAGS = ["--no-gradient-accumulation-fusion", "--no-rope-fusion", "--no-masked-softmax-fusion"]
EAGER_FLAGS = ["--no-bias-swiglu-fusion", "--no-bias-dropout-fusion"]


_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def child_environment(extra: dict | None = None) -> dict:
    """This process's environment for a benchmark child: a world of its own (not the rendezvous of a
    process group this process may have started), warnings off, `extra` added."""
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    env.update(PYTHONWARNINGS="ignore", **(extra or {}))
    return env


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def train_flags(preset: str, lam: float, micro_batch: int, iters: int, metrics: Path | str, *,
                global_batch: int | None = None, seq_length: int | None = None, vocab_size: int = 4096,
                log_interval: int = 10, bf16: bool = False, lr: float = 1e-4, gpu: bool = False) -> list[str]:
    """`megatron-jreg train` flags for a throughput run on mock data (no validation, no checkpoints)."""
    flags = ["--model-preset", preset, "--transformer-impl", "local", "--mock-data", "--tokenizer-type",
             "NullTokenizer", "--vocab-size", str(vocab_size), "--micro-batch-size", str(micro_batch),
             "--global-batch-size", str(global_batch or micro_batch), "--train-iters", str(iters),
             "--log-interval", str(log_interval), "--eval-interval", str(10**9), "--eval-iters", "0",
             "--lr", str(lr), "--jreg-lambda", str(lam), "--jreg-alpha", "1", "--metrics-file", str(metrics),
             "--no-progress"]
    if seq_length:
        flags += ["--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length)]
    if bf16:
        flags.append("--bf16")
    if gpu:
        flags += GPU_FLAGS
    return flags


@dataclass
class RunResult:
    """One training run: its exit code, metrics records, peak memory and console log."""

    rc: int
    records: list[dict] = field(default_factory=list)
    peak_bytes: float | None = None
    peak_kind: str = ""  # "allocated" (GPU), "rss" (CPU process), "" (not measured: an in-process CPU run)
    seconds: float = 0.0
    log: Path | None = None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log and self.log.exists() else ""


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def metrics_path(argv: list[str]) -> Path:
    return Path(argv[argv.index("--metrics-file") + 1])


def _peak() -> tuple[float, str]:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return float(torch.cuda.max_memory_allocated()), "allocated"
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024), "rss"


def worker(result_path: Path, argv: list[str]) -> int:
    """In a fresh process: `megatron-jreg train argv`, then {rc, peak_bytes, peak_kind} into result_path."""
    from megatron_jreg.train import main as train_main

    try:
        rc = train_main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    peak, kind = _peak()
    result_path.write_text(json.dumps({"rc": rc, "peak_bytes": peak, "peak_kind": kind}))
    return rc


def run_training(argv: list[str], log: Path, *, isolated: bool = True, env: dict | None = None,
                 timeout: float | None = None) -> RunResult:
    """`megatron-jreg train argv`, console to `log`: in a process of its own (isolated; `env` added to its
    environment) or in this one (several runs share one import of torch and megatron-core)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if isolated:
        result_file = log.with_suffix(".result.json")
        result_file.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(result_file), "--", *argv]
        child_env = child_environment(env)
        with open(log, "w") as out:
            try:
                rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env, timeout=timeout,
                                    cwd=REPO).returncode
            except subprocess.TimeoutExpired:
                out.write(f"\n[timed out after {timeout:.0f} s]\n")
                rc = 124
        info = json.loads(result_file.read_text()) if result_file.exists() else {}
        result = RunResult(rc, peak_bytes=info.get("peak_bytes"), peak_kind=info.get("peak_kind", ""))
    else:
        from megatron_jreg.train import main as train_main

        with open(log, "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                rc = train_main(argv)
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        result = RunResult(rc)
    result.seconds = time.perf_counter() - start
    result.log = log
    result.records = [r for r in read_records(metrics_path(argv)) if "split" not in r]
    return result


def steady(records: list[dict], skip_through: int) -> dict:
    """Throughput over the logged intervals after iteration `skip_through` (training records only).

    Each record covers the iterations since the previous one; interval means are weighted by their length.
    Returns iterations, iteration_ms, tokens_per_sec, tflops_per_rank.
    """
    train = sorted((r for r in records if "tokens_per_sec" in r and r.get("iteration_ms")),
                   key=lambda r: r["iteration"])
    spans = []
    previous = 0
    for r in train:
        if previous >= skip_through:
            spans.append((r["iteration"] - previous, r))
        previous = r["iteration"]
    if not spans:
        raise ValueError(f"no logged interval after iteration {skip_through} (iterations logged: "
                         f"{[r['iteration'] for r in train]}): train longer or log more often")
    n = sum(k for k, _ in spans)
    ms = sum(k * r["iteration_ms"] for k, r in spans) / n
    tokens_per_iter = statistics.fmean(r["tokens_per_sec"] * r["iteration_ms"] / 1e3 for _, r in spans)
    flop_per_iter = statistics.fmean(r["tflops_per_rank"] * r["iteration_ms"] / 1e3 for _, r in spans)
    return {"iterations": n, "iteration_ms": ms, "tokens_per_sec": tokens_per_iter / (ms / 1e3),
            "tflops_per_rank": flop_per_iter / (ms / 1e3)}


def compare(base: RunResult, jreg: RunResult, skip_through: int) -> dict:
    """Side-by-side figures of a λ = 0 and a λ = 1 run."""
    b, j = steady(base.records, skip_through), steady(jreg.records, skip_through)
    out = {"baseline": b, "jreg": j, "time_ratio": j["iteration_ms"] / b["iteration_ms"],
           "tokens_per_sec_ratio": j["tokens_per_sec"] / b["tokens_per_sec"], "memory_ratio": None,
           "memory_kind": base.peak_kind or None, "peak_bytes": [base.peak_bytes, jreg.peak_bytes]}
    if base.peak_bytes and jreg.peak_bytes and base.peak_kind == jreg.peak_kind:
        out["memory_ratio"] = jreg.peak_bytes / base.peak_bytes
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        if len(argv) < 3 or argv[2] != "--":
            sys.exit("usage: train_throughput.py --worker RESULT.json -- TRAIN_FLAGS...")
        return worker(Path(argv[1]), argv[3:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seq-length", type=int, default=None, help="default: the preset's")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--bf16", action="store_true")
    args = p.parse_args(argv)
    gpu = cuda_available()
    results: dict[float, list[RunResult]] = {0.0: [], 1.0: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for lam in (0.0, 1.0) if r % 2 == 0 else (1.0, 0.0):
                tag = f"r{r}-l{lam:g}"
                flags = train_flags(args.preset, lam, args.micro_batch_size, args.iters, Path(tmp) / f"{tag}.jsonl",
                                    seq_length=args.seq_length, vocab_size=args.vocab_size,
                                    log_interval=args.log_interval, bf16=args.bf16, gpu=gpu)
                run = run_training(flags, Path(tmp) / f"{tag}.log")
                if run.rc != 0:
                    sys.exit(f"run {tag} failed (exit {run.rc}):\n{run.log_tail()}")
                results[lam].append(run)
                s = steady(run.records, args.log_interval)
                print(f"round {r} lambda={lam:g}: {s['tokens_per_sec']:.0f} tokens/s, {s['iteration_ms']:.1f} ms/it, "
                      f"{s['tflops_per_rank']:.3f} TFLOP/s/rank, peak {run.peak_kind} "
                      f"{(run.peak_bytes or 0) / 2**20:.0f} MiB", flush=True)
    pairs = [compare(b, j, args.log_interval) for b, j in zip(results[0.0], results[1.0], strict=True)]
    med = {key: statistics.median(x[key] for x in pairs) for key in ("time_ratio", "tokens_per_sec_ratio")}
    mem = [x["memory_ratio"] for x in pairs if x["memory_ratio"] is not None]
    base_tps = statistics.median(x["baseline"]["tokens_per_sec"] for x in pairs)
    jreg_tps = statistics.median(x["jreg"]["tokens_per_sec"] for x in pairs)
    base_tflops = statistics.median(x["baseline"]["tflops_per_rank"] for x in pairs)
    print(f"preset {args.preset}, batch {args.micro_batch_size}, {'bf16' if args.bf16 else 'fp32'}, "
          f"{'GPU' if gpu else 'CPU'}, {args.rounds} round(s)")
    print(f"tokens_per_sec_ratio={med['tokens_per_sec_ratio']:.4f} time_ratio={med['time_ratio']:.4f} "
          f"memory_ratio={statistics.median(mem) if mem else float('nan'):.4f} baseline_tokens_per_sec={base_tps:.1f} "
          f"jreg_tokens_per_sec={jreg_tps:.1f} baseline_tflops_per_rank={base_tflops:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
