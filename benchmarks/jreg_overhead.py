"""Forward+backward time and peak memory of JREG (λ = 1) against the plain model (λ = 0), side by side.

One GPTModel (megatron-core's local spec, built by `megatron_jreg.checkpoints.model.build_model` from
Megatron-LM flags), one batch, one process; λ = 0 and λ = 1 steps alternate so that machine noise hits
both alike. A step is the model's forward with labels (megatron's per-token cross-entropy), the mean
loss's backward, and JREG's hooks when λ = 1 (`JregPlugin`, exactly as in training). Memory: peak
allocated bytes on a GPU; on CPU (no allocator statistics) the bytes of distinct storages autograd
saves for backward, i.e. the activations a step keeps alive, which is what JREG could add to.

On CPU the step is dominated by matmuls slow enough to hide JREG's memory-bound op, so a CPU time_ratio says
nothing about the GPU cost: the op itself against its memory floor is benchmarks/jreg_op.py's, on either
device, and the GPU check (benchmarks/gpu_check.sh) measures the step there.

`--micro-batch-size auto` finds the largest micro-batch whose λ = 1 step fits the memory budget
(`find_micro_batch`, ~4 probes): by default 90 % of the GPU's memory less what training adds per parameter beyond
this benchmark (fp32 main gradients, fp32 main weights and Adam's two moments: 14 bytes).

    python benchmarks/jreg_overhead.py                                  # CPU: 4 layers × 256, 256 tokens
    python benchmarks/jreg_overhead.py --preset llama-170m --bf16 --vocab-size 128256 --micro-batch-size auto

Last line: time_ratio=… memory_ratio=… micro_batch=… (`--json PATH` writes every figure).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

# The CPU default: a model small enough for 2 cores, in Llama's proportions.
CPU_FLAGS = ("--num-layers 4 --hidden-size 256 --ffn-hidden-size 688 --num-attention-heads 4 --num-query-groups 2 "
             "--seq-length 256 --max-position-embeddings 256").split()
# Bytes per parameter that a training step holds beyond this benchmark's weights and gradients:
# fp32 main gradients (4; megatron accumulates bf16 gradients in fp32) + fp32 main weights (4) + Adam (8),
# less the gradient this benchmark already holds (2 in bf16).
TRAINING_BYTES_PER_PARAM = 14


def saved_bytes(run: Callable[[], None]) -> int:
    """Bytes of distinct storages saved for backward while `run()` builds the graph (then backward)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def find_micro_batch(peak_of: Callable[[int], float], budget: float, limit: int = 1024) -> tuple[int, dict]:
    """The largest micro-batch b <= limit with peak_of(b) <= budget (peak_of returns inf when b does not fit).

    Peak memory is affine in b (weights + b × per-sample activations): measure b = 1 and 2, extrapolate,
    then confirm the guess and one above it; a wrong guess is corrected by galloping up or bisecting down.
    A linear peak needs 4 probes. Returns (b, {b: peak} of every probe).
    """
    peaks: dict[int, float] = {}

    def fits(b: int) -> bool:
        peaks[b] = peak_of(b)
        return peaks[b] <= budget

    if not fits(1):
        raise RuntimeError(f"micro-batch 1 needs {peaks[1] / 2**30:.2f} GiB, more than the budget "
                           f"{budget / 2**30:.2f} GiB: use a shorter --seq-length or a smaller model")
    if limit < 2 or not fits(2):
        return 1, peaks
    per_sample = max(peaks[2] - peaks[1], 1.0)
    guess = int((budget - (peaks[1] - per_sample)) // per_sample)
    lo, hi = 2, limit + 1  # lo fits; hi does not (or lies past the limit)
    b, step = min(max(guess, lo + 1), limit), 1
    while hi - lo > 1:
        if fits(b):
            lo = b
            if hi == limit + 1:  # nothing failed yet: one above, then farther
                b, step = min(lo + step, limit), step * 2
            else:
                b = (lo + hi) // 2
        else:
            hi = b
            b = (lo + hi) // 2
    return lo, peaks


class Bench:
    """The model, its two plugins (λ = 0 and λ = 1) and a fixed random batch per micro-batch size."""

    def __init__(self, flags: list[str], vocab_size: int, bf16: bool, distance: str) -> None:
        from megatron_jreg.checkpoints.args import model_args
        from megatron_jreg.checkpoints.model import build_model
        from megatron_jreg.compat import device
        from megatron_jreg.plugin import JregConfig, JregPlugin

        self.args = model_args(flags, vocab_size)
        self.dtype = torch.bfloat16 if bf16 else torch.float32
        self.device = device()
        self.model = build_model(self.args, self.dtype).to(self.device).train()
        self.plugins = {lam: JregPlugin([self.model], JregConfig(lam=lam, alpha=1.0, distance=distance))
                        for lam in (0.0, 1.0)}
        self.vocab_size = vocab_size
        self.seq = int(self.args.seq_length)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self._batches: dict[int, tuple[torch.Tensor, ...]] = {}

    def batch(self, b: int) -> tuple[torch.Tensor, ...]:
        """tokens[b, s], labels[b, s], position_ids[b, s] (only the last size is kept)."""
        if b not in self._batches:
            self._batches.clear()
            g = torch.Generator().manual_seed(b)
            tokens = torch.randint(0, self.vocab_size, (b, self.seq), generator=g).to(self.device)
            labels = torch.randint(0, self.vocab_size, (b, self.seq), generator=g).to(self.device)
            position_ids = torch.arange(self.seq, device=self.device).unsqueeze(0).expand(b, self.seq)
            self._batches[b] = (tokens, labels, position_ids)
        return self._batches[b]

    def step(self, lam: float, b: int) -> None:
        """One forward+backward of micro-batch b with JREG at λ (gradients dropped first)."""
        for p in self.model.parameters():
            p.grad = None
        for other, plugin in self.plugins.items():
            if other != lam:
                plugin.remove_hooks()
        self.plugins[lam].start_step(1, record=False)
        tokens, labels, position_ids = self.batch(b)
        loss = self.model(tokens, position_ids, None, labels=labels)  # per-token cross-entropy [b, s]
        loss.float().mean().backward()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def peak(self, lam: float, b: int) -> float:
        """Peak allocated bytes of one step (GPU; inf when it runs out of memory), saved activations on CPU."""
        if self.device.type != "cuda":
            return float(saved_bytes(lambda: self.step(lam, b)))
        self.sync()
        torch.cuda.reset_peak_memory_stats()
        try:
            self.step(lam, b)
            self.sync()
            return float(torch.cuda.max_memory_allocated())
        except torch.cuda.OutOfMemoryError:
            pass
        # outside the handler, so that the traceback no longer holds the step's tensors
        for p in self.model.parameters():
            p.grad = None
        self._batches.clear()
        torch.cuda.empty_cache()
        return math.inf

    def close(self) -> None:
        """Release the model and megatron's model-parallel state (the process group stays)."""
        from megatron.core import parallel_state

        for plugin in self.plugins.values():
            plugin.remove_hooks()
        del self.model, self.plugins
        self._batches.clear()
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def gpu_budget(n_params: int, fraction: float) -> float:
    """Bytes a training micro-batch may use here: `fraction` of the GPU less the optimizer's extra state."""
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return fraction * total - TRAINING_BYTES_PER_PARAM * n_params


def measure(flags: list[str], vocab_size: int = 4096, micro_batch: int | str = 4, iters: int = 12, bf16: bool = False,
            distance: str = "angular", budget_bytes: float | None = None, memory_fraction: float = 0.9) -> dict:
    """Build the model from Megatron-LM `flags`, time λ = 0 against λ = 1; the figures as a dict."""
    bench = Bench(flags, vocab_size, bf16, distance)
    try:
        cuda = bench.device.type == "cuda"
        result: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "params": bench.n_params,
                        "num_layers": int(bench.args.num_layers), "hidden_size": int(bench.args.hidden_size),
                        "seq_length": bench.seq, "vocab_size": vocab_size, "dtype": "bf16" if bf16 else "fp32",
                        "distance": distance, "memory_kind": "peak allocated" if cuda else "saved activations"}
        if micro_batch == "auto":
            if budget_bytes is None:
                if not cuda:
                    raise ValueError("--micro-batch-size auto on CPU needs --memory-budget-mib (no device memory)")
                budget_bytes = gpu_budget(bench.n_params, memory_fraction)
            b, peaks = find_micro_batch(lambda n: bench.peak(1.0, n), budget_bytes)
            result.update(budget_bytes=budget_bytes, probe_peaks={str(k): v for k, v in sorted(peaks.items())})
            if cuda:
                result["device_memory"] = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        else:
            b = int(micro_batch)
        result["micro_batch"] = b
        for lam in (0.0, 1.0, 0.0, 1.0):  # warm-up
            bench.step(lam, b)
        bench.sync()
        times: dict[float, list[float]] = {0.0: [], 1.0: []}
        for i in range(iters):
            for lam in (0.0, 1.0) if i % 2 == 0 else (1.0, 0.0):
                bench.sync()
                t0 = time.perf_counter()
                bench.step(lam, b)
                bench.sync()
                times[lam].append(time.perf_counter() - t0)
        memory = {lam: bench.peak(lam, b) for lam in (0.0, 1.0)}
        median = {lam: statistics.median(v) for lam, v in times.items()}
        result.update(
            step_ms={str(lam): 1e3 * median[lam] for lam in (0.0, 1.0)}, steps=iters,
            memory_bytes={str(lam): memory[lam] for lam in (0.0, 1.0)},
            time_ratio=median[1.0] / median[0.0], memory_ratio=memory[1.0] / memory[0.0],
            tokens_per_sec={str(lam): b * bench.seq / median[lam] for lam in (0.0, 1.0)},
        )
        return result
    finally:
        bench.close()


def report(result: dict) -> str:
    """Human lines and the final key=value line."""
    lines = [f"model: {result['num_layers']} layers x {result['hidden_size']}, {result['params'] / 1e6:.1f}M params, "
             f"batch {result['micro_batch']}x{result['seq_length']}, {result['dtype']}, {result['device']}, "
             f"distance {result['distance']}"]
    for lam in ("0.0", "1.0"):
        lines.append(f"lambda={float(lam):g}: median step {result['step_ms'][lam]:.1f} ms over {result['steps']}, "
                     f"{result['memory_kind']} {result['memory_bytes'][lam] / 2**20:.1f} MiB")
    lines.append(f"time_ratio={result['time_ratio']:.4f} memory_ratio={result['memory_ratio']:.4f} "
                 f"micro_batch={result['micro_batch']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=None, help="--model-preset of megatron-jreg train (default: the CPU size)")
    p.add_argument("--seq-length", type=int, default=None, help="tokens per sample (default: the preset's)")
    p.add_argument("--micro-batch-size", default="4", help="samples per step, or 'auto': the largest that fits")
    p.add_argument("--memory-budget-mib", type=float, default=None,
                   help="memory a step may use, for --micro-batch-size auto (default on a GPU: 90%% of it less "
                        f"{TRAINING_BYTES_PER_PARAM} bytes per parameter)")
    p.add_argument("--iters", type=int, default=12, help="timed steps per λ")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--jreg-distance", choices=["angular", "cosine"], default="angular")
    p.add_argument("--json", type=Path, default=None, help="also write every figure here")
    args, extra = p.parse_known_args(argv)
    if args.micro_batch_size != "auto" and not args.micro_batch_size.isdigit():
        p.error("--micro-batch-size: give a number or 'auto'")
    from megatron_jreg.training.flags import preset_flags

    flags = preset_flags(args.preset) if args.preset else list(CPU_FLAGS)
    if args.seq_length:
        flags += ["--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length)]
    flags += extra  # any other Megatron-LM architecture flag, e.g. --num-layers 2
    budget = None if args.memory_budget_mib is None else args.memory_budget_mib * 2**20
    result = measure(flags, args.vocab_size, args.micro_batch_size, args.iters, args.bf16, args.jreg_distance,
                     budget_bytes=budget)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(report(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
