"""Cost of layer removal (`analyze --remove-layers`, `analysis.removal`) per layer, against the model's own forward pass
and against the naive way of measuring it, side by side on the same batches.

    python benchmarks/analyze_removal.py [--model DIR] [--num-samples 8] [--max-length 128] [--rounds 2]

Variants, each over the same padded LAMBADA batches, alternated over `--rounds` rounds (the median is kept):
- forward: one forward pass of the causal LM per batch, logits included (the unit of cost; the mean of three);
- removal: `removal.removal_totals` in memory: the model, the L variants without one layer (each reusing the
  recorded outputs of the layers below the skipped one) and the top k = 1, 2, 3 variants;
- naive: the same L + 1 + 3 cross-entropies from full forward passes with hooks that return a skipped layer's
  input (what a user writes first, and the tests' reference);
- streamed: `StreamingSource.stream_removal`, one decoder layer's weights in memory at a time (one round).

Without --model a random model of SmolLM2-135M's shapes is built here (30 layers, hidden 576, FFN 1536, 9 heads /
3 KV heads, tied embeddings, vocabulary 49,152 — the tokenizer, trained here, uses the first 8,192 ids).
The last line is `removal_s_per_layer=<removal seconds ÷ L> removal_over_forward=<removal ÷ forward>
naive_over_removal=<naive ÷ removal> max_abs_delta_ce_diff=<largest |ΔCE| difference, removal vs naive>`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_jreg.data.text import lambada_passages

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests/_toy.py

TOP_K = (1, 2, 3)


def build_smollm2_shaped(folder: Path) -> Path:
    from transformers import LlamaConfig

    from tests._toy import save_random_model, train_tokenizer

    tokenizer = train_tokenizer(lambada_passages()[1000:3000], vocab_size=8192)  # not among the measured samples
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         tie_word_embeddings=True, rope_theta=100000.0, bos_token_id=0, eos_token_id=0)
    return save_random_model(config, folder, tokenizer)


def naive_sums(source, batches) -> torch.Tensor:  # noqa: ANN001 - an HFSource
    """Σ CE of the model and every variant from full forward passes, skipping by hooks that return the input."""
    from megatron_jreg.analysis.removal import ce_sum

    layers = source.layers
    num = len(layers)
    variants = [[]] + [[i] for i in range(num)] + [list(range(num - k, num)) for k in TOP_K]
    sums = torch.zeros(len(variants), dtype=torch.float64)
    for v, skipped in enumerate(variants):
        handles = [layers[i].register_forward_hook(lambda m, args, kwargs, out: args[0] if args else
                                                   kwargs["hidden_states"], with_kwargs=True) for i in skipped]
        try:
            for ids, mask, targets in batches:
                sums[v] += ce_sum(source.logits(ids, mask), targets).cpu()
        finally:
            for h in handles:
                h.remove()
    return sums


def timed(fn) -> tuple[float, object]:  # noqa: ANN001
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> int:
    from megatron_jreg.analysis.hf_source import load_hf_source
    from megatron_jreg.analysis.measure import encode_samples, padded_batches
    from megatron_jreg.analysis.removal import next_token_targets, removal_totals
    from megatron_jreg.analysis.stream_source import load_stream_source

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="HF Llama-family folder with safetensors (default: SmolLM2-shaped)")
    p.add_argument("--num-samples", type=int, default=8)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: stable timings on shared cores)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_smollm2_shaped(Path(tmp) / "smollm2-shaped")
        source = load_hf_source(model, label="bench")
        samples, _, _ = encode_samples(source, lambada_passages()[: args.num_samples], args.max_length)
        batches = [(ids, mask, next_token_targets(ids, mask)) for ids, mask in
                   padded_batches(samples, args.batch_size, source.pad_id)]
        tokens = sum(int(m.sum()) for _, m, _ in batches)
        num = source.num_layers
        times: dict[str, list[float]] = {"forward": [], "removal": [], "naive": []}
        with torch.no_grad():
            for _ in range(args.rounds):
                seconds, _ = timed(lambda: [source.logits(ids, mask) for _ in range(3) for ids, mask, _ in batches])
                times["forward"].append(seconds / 3)
                seconds, totals = timed(lambda: removal_totals(source, batches, TOP_K))
                times["removal"].append(seconds)
                seconds, naive = timed(lambda: naive_sums(source, batches))
                times["naive"].append(seconds)
        source.close()
        streamer = load_stream_source(model, label="bench")
        seconds, streamed = timed(lambda: removal_totals(streamer, batches, TOP_K))
        times["streamed"] = [seconds]
        streamer.close()

    ours = totals.sums  # [model, each layer skipped, each top k skipped], float64
    diff = float(((ours - naive) / totals.tokens).abs().max())
    stream_diff = float((streamed.sums - ours).abs().max() / totals.tokens)
    name = str(model) if args.model else "random SmolLM2-135M-shaped Llama L=30 h=576 FFN=1536 9/3 heads V=49152 tied"
    print(f"model={name} device=cpu threads={args.threads} samples={args.num_samples} tokens={tokens} "
          f"predicted={totals.tokens} batch={args.batch_size} rounds={args.rounds} top_k={','.join(map(str, TOP_K))}")
    median = {k: statistics.median(v) for k, v in times.items()}
    for name, seconds in median.items():
        print(f"{name:<9} {seconds:8.2f} s  ({seconds / median['forward']:6.2f} forward passes, "
              f"{seconds / num:6.3f} s per layer of the model)  rounds: {', '.join(f'{t:.2f}' for t in times[name])}")
    print(f"streamed max |ΔCE| vs in memory {stream_diff:.2e}")
    print(f"removal_s_per_layer={median['removal'] / num:.3f} "
          f"removal_over_forward={median['removal'] / median['forward']:.2f} "
          f"naive_over_removal={median['naive'] / median['removal']:.2f} max_abs_delta_ce_diff={diff:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
