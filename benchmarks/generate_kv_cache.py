"""Decoding with the models' own KV caches against recomputing the whole prefix each step, side by side.

What `megatron-jreg generate` runs (`evaluate.decoding.complete`, greedy) on one random Llama, as a Hugging
Face folder (transformers' cache, `HFDecoder`) and as the Megatron-LM checkpoint `convert hf-to-mcore`
makes of it (megatron-core's `StaticInferenceContext`, `MegatronDecoder`), each against the decoder that
generate used before: every step the full prefix through `CausalLM.logits`. Both decoders of a model must
give the same tokens; the runs alternate so that machine noise hits both alike.

    python benchmarks/generate_kv_cache.py                 # 4 layers × 256, batch 4, 64-token prompts, 128 new

Last line: hf_speedup=… megatron_speedup=… (new tokens per second, KV cache / full prefix).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class FullPrefix:
    """The previous decoder: no cache, the whole sequence so far through `logits_fn` at every step."""

    def __init__(self, logits_fn) -> None:  # noqa: ANN001 - tokens[n, t] -> logits[n, t, V]
        self.logits_fn, self.tokens = logits_fn, None

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        self.tokens = tokens if self.tokens is None else torch.cat([self.tokens, tokens], dim=1)
        return self.logits_fn(self.tokens)[:, -1].float().cpu()


def timed(decode, prompts: list[list[int]], new: int, vocab: int) -> tuple[float, list[list[int]]]:  # noqa: ANN001
    from megatron_jreg.evaluate.decoding import complete

    start = time.perf_counter()
    done = complete(decode, prompts, max_new_tokens=new, window=10_000, vocab_size=vocab, stop_ids=set())
    return time.perf_counter() - start, [d.ids for d in done]


def compare(name: str, cached, full, prompts: list[list[int]], new: int, vocab: int, repeats: int) -> float:  # noqa: ANN001
    times = {"cache": [], "full": []}
    outputs = {}
    for _ in range(repeats):
        for kind, decode in (("cache", cached), ("full", full)):
            seconds, outputs[kind] = timed(decode, prompts, new, vocab)
            times[kind].append(seconds)
    assert outputs["cache"] == outputs["full"], f"{name}: the two decoders gave different tokens"
    tokens = len(prompts) * new
    rates = {k: tokens / statistics.median(v) for k, v in times.items()}
    print(f"{name:9s} full prefix {rates['full']:8.1f} tok/s | KV cache {rates['cache']:8.1f} tok/s | "
          f"x{rates['cache'] / rates['full']:.2f} (same {tokens} tokens)")
    return rates["cache"] / rates["full"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)

    from megatron_jreg.checkpoints import load_megatron_model
    from megatron_jreg.convert.from_hf import hf_to_mcore
    from megatron_jreg.evaluate.decoding import HFDecoder, MegatronDecoder
    from megatron_jreg.evaluate.models import load_hf_lm
    from tests._toy import save_random_llama

    texts = (ROOT / "examples/data/wikitext-2/valid.txt").read_text(encoding="utf-8")[:20000].splitlines()
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_random_llama(Path(tmp) / "hf", texts, layers=args.layers, hidden=args.hidden,
                                   ffn=args.hidden * 8 // 3, heads=4, kv_heads=2, vocab=1000, tied=False)
        hf_to_mcore(folder, Path(tmp) / "mcore", verify=False)
        hf = load_hf_lm(folder, "cpu", "float32")
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, hf.vocab_size, (args.prompt + 3 * i,), generator=gen).tolist()
                   for i in range(args.batch)]  # lengths differ, as questions do
        print(f"{args.layers} layers × {args.hidden}, batch {args.batch}, prompts {args.prompt}..{len(prompts[-1])} "
              f"tokens, {args.new} new tokens each, greedy, 1 thread")
        hf_ratio = compare("hf", lambda b, n: HFDecoder(hf.model), lambda b, n: FullPrefix(hf.logits), prompts,
                           args.new, hf.vocab_size, args.repeats)
        mc = load_megatron_model(Path(tmp) / "mcore", load_tokenizer=False)
        mc_ratio = compare("megatron", lambda b, n: MegatronDecoder(mc.model, b, n), lambda b, n: FullPrefix(mc.logits),
                           prompts, args.new, hf.vocab_size, args.repeats)
    print(f"hf_speedup={hf_ratio:.2f} megatron_speedup={mc_ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
