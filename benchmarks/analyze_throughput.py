"""Throughput and peak memory of `megatron-jreg analyze` against a naive `output_hidden_states` loop.

    python benchmarks/analyze_throughput.py [--model DIR] [--num-samples 64] [--batch-size 8] [--device cpu]

Same model, same LAMBADA samples, same batch size, one run each:
- analyze: `measure()` as the CLI runs it (base model only, hooks on the decoder layers reduce each
  layer to a per-layer sum on the fly, batches sorted by length);
- naive: the loop people write: `model(ids, attention_mask=mask, output_hidden_states=True)` on the
  causal LM in data order, then `jreg.displacement_sum` on every pair of hidden states;
- naive_base (shown for reference): the same loop on the base model, i.e. without the LM head logits.

Each variant runs in a fresh subprocess, so allocator caches of one cannot help another. Memory is
the peak above the level after loading the model and tokenizing (`megatron_jreg.analysis.run.PeakMemory`:
on CPU the kernel's peak resident set, VmHWM, reset right before the loop; on CUDA the caching allocator's
`max_memory_allocated`). Without --model, a random 8-layer Llama (hidden 256, vocab 8192) is built
with a tokenizer trained on LAMBADA passages that are not among the measured samples.

The last line is `speed_ratio=<analyze tok/s ÷ naive tok/s> memory_ratio=<analyze peak ÷ naive peak>`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_jreg import jreg
from megatron_jreg.analysis.hf_source import load_hf_source
from megatron_jreg.analysis.loading import ModelSpec
from megatron_jreg.analysis.measure import encode_samples, measure, padded_batches
from megatron_jreg.analysis.run import PeakMemory
from megatron_jreg.data.text import lambada_passages

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests/_toy.py

VARIANTS = ("analyze", "naive", "naive_base")


def build_default_model(folder: Path) -> Path:
    from tests._toy import save_random_llama

    texts = lambada_passages()[1000:3000]  # not among the measured samples
    return save_random_llama(folder, texts, layers=8, hidden=256, ffn=704, heads=8, kv_heads=4, vocab=8192)


@torch.no_grad()
def naive_loop(model, samples: list[list[int]], batch_size: int, pad_id: int, base_only: bool, kind: str) -> int:
    """The straightforward measurement: all hidden states of a batch at once, in data order."""
    runner = model.base_model if base_only else model
    device = next(model.parameters()).device
    sums = None
    for start in range(0, len(samples), batch_size):
        chunk = samples[start : start + batch_size]
        ids, mask = next(padded_batches(chunk, len(chunk), pad_id))  # one batch, data order kept
        ids, mask = ids.to(device), mask.to(device)
        hidden = runner(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states
        pairs = [jreg.displacement_sum(a, b, mask, kind) for a, b in zip(hidden[:-1], hidden[1:])]
        totals = torch.stack([torch.stack(pair) for pair in pairs])
        sums = totals if sums is None else sums + totals
    return int(sum(len(s) for s in samples))


def worker(args: argparse.Namespace) -> dict:
    """One variant in this process: load, tokenize, then time and measure the loop."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    texts = lambada_passages()[: args.num_samples]
    source = load_hf_source(args.model, label="bench", device=device)
    spec = ModelSpec(args.model, "bench", "hf")
    samples, _ = encode_samples(source, texts, args.max_length)
    tokens = sum(map(len, samples))
    with PeakMemory(device) as memory:
        start = time.perf_counter()
        if args.worker == "analyze":
            measure(source, texts, spec, batch_size=args.batch_size, max_length=args.max_length)
        else:
            naive_loop(source.model, samples, args.batch_size, source.pad_id, args.worker == "naive_base", "angular")
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return {"variant": args.worker, "tokens": tokens, "seconds": seconds, "peak_bytes": memory.above}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="HF model folder (default: a random 8-layer Llama)")
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: stable timings on shared cores)")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_default_model(Path(tmp) / "llama")
        common = ["--model", str(model), "--num-samples", str(args.num_samples), "--batch-size",
                  str(args.batch_size), "--max-length", str(args.max_length), "--device", args.device,
                  "--threads", str(args.threads)]  # fmt: skip
        results = {}
        for variant in VARIANTS:
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", variant, *common], capture_output=True, text=True, check=False
            )
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                return proc.returncode
            results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])

    print(f"model={model if args.model else 'random Llama L=8 h=256 V=8192'} device={args.device} "
          f"threads={args.threads} samples={args.num_samples} batch={args.batch_size}")  # fmt: skip
    for r in results.values():
        rate = r["tokens"] / r["seconds"]
        print(f"{r['variant']:<11} {r['tokens']:>7} tok  {r['seconds']:7.2f} s  {rate:9.1f} tok/s  "
              f"peak +{r['peak_bytes'] / 2**20:8.1f} MiB")  # fmt: skip
    a, n = results["analyze"], results["naive"]
    speed = (a["tokens"] / a["seconds"]) / (n["tokens"] / n["seconds"])
    print(f"speed_ratio={speed:.2f} memory_ratio={a['peak_bytes'] / n['peak_bytes']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
