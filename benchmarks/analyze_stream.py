"""Peak memory and speed of layer streaming (`analyze --stream`) against the in-memory analysis, same model.

    python benchmarks/analyze_stream.py [--model DIR | --family llama|mixtral] [--num-samples 16] [--batch-size 8]

Both variants measure Ψ of the same safetensors folder on the same LAMBADA passages, each in a fresh
process (so neither inherits the other's allocations), timed from loading the model (in memory) or
reading the first layer (streamed) to the last Ψ:
- in_memory: `load_hf_source` + `measure`, the default path for models that fit;
- streamed: `load_stream_source` + `measure`, one decoder layer's weights in memory at a time.

Memory is the process's peak resident set (VmHWM; `megatron_jreg.analysis.run.PeakMemory`), shown
whole and above the level after importing the model's modeling code (~160 MiB of Python modules for a
Llama in transformers 5, paid by both variants). Without --model, a random model is built and saved here,
big enough for the weights to dominate the in-memory peak: `--family llama` (default) a 12-layer Llama
(hidden 1024, FFN 2816, 16 heads / 4 KV heads, vocabulary 8192; ~580 MiB of fp32 weights); `--family
mixtral` an 8-layer Mixtral (hidden 512, 8 experts of FFN 1408, top-2; ~570 MiB), whose per-expert tensors
stream through transformers' own expert fusion.

The last line is `rss_ratio=<streamed peak above imports ÷ in-memory peak above imports>
speed_ratio=<streamed tok/s ÷ in-memory tok/s> psi_max_abs_diff=<largest |ΔΨ_ℓ|>`.
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

from megatron_jreg.analysis.loading import ModelSpec
from megatron_jreg.analysis.run import PeakMemory
from megatron_jreg.data.text import lambada_passages

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests/_toy.py

VARIANTS = ("in_memory", "streamed")


def build_default_model(folder: Path, family: str) -> Path:
    from tests._toy import save_random_llama, save_random_model, train_tokenizer

    texts = lambada_passages()[1000:3000]  # not among the measured samples
    if family == "llama":
        return save_random_llama(
            folder, texts, layers=12, hidden=1024, ffn=2816, heads=16, kv_heads=4, vocab=8192, tied=False
        )
    from transformers import MixtralConfig

    tokenizer = train_tokenizer(texts, vocab_size=8192)
    config = MixtralConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                           num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    return save_random_model(config, folder, tokenizer)


def worker(args: argparse.Namespace) -> dict:
    """One variant in this process: time and measure loading (or reading) the model and measuring Ψ."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from megatron_jreg.analysis.hf_source import load_hf_source
    from megatron_jreg.analysis.measure import measure
    from megatron_jreg.analysis.stream_source import load_stream_source

    torch.set_num_threads(args.threads)
    config = AutoConfig.from_pretrained(args.model, trust_remote_code=False)
    MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # import the modeling code first
    texts = lambada_passages()[: args.num_samples]
    spec = ModelSpec(args.model, "bench", "hf")
    load = load_stream_source if args.worker == "streamed" else load_hf_source
    with PeakMemory("cpu") as memory:
        start = time.perf_counter()
        source = load(args.model, label="bench")
        result = measure(source, texts, spec, batch_size=args.batch_size, max_length=args.max_length)
        seconds = time.perf_counter() - start
    return {"variant": args.worker, "tokens": result.tokens, "seconds": seconds, "peak": memory.peak,
            "above": memory.above, "psi": result.psi}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="HF folder with safetensors (default: a random one of --family)")
    p.add_argument("--family", choices=("llama", "mixtral"), default="llama", help="the random model's family")
    p.add_argument("--num-samples", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: stable timings on shared cores)")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_default_model(Path(tmp) / args.family, args.family)
        weights = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
        common = ["--model", str(model), "--num-samples", str(args.num_samples), "--batch-size", str(args.batch_size),
                  "--max-length", str(args.max_length), "--threads", str(args.threads)]  # fmt: skip
        results = {}
        for variant in VARIANTS:
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", variant, *common], capture_output=True, text=True, check=False
            )
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                return proc.returncode
            results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])

    mib = 2**20
    name = str(model) if args.model else {"llama": "random Llama L=12 h=1024 FFN=2816 V=8192",
                                          "mixtral": "random Mixtral L=8 h=512 8x FFN=1408 top-2 V=8192"}[args.family]
    print(f"model={name} ({weights / mib:.0f} MiB of safetensors) device=cpu threads={args.threads} "
          f"samples={args.num_samples} batch={args.batch_size}")  # fmt: skip
    for r in results.values():
        rate = r["tokens"] / r["seconds"]
        print(f"{r['variant']:<10} {r['tokens']:>6} tok  {r['seconds']:7.2f} s  {rate:8.1f} tok/s  "
              f"peak RSS {r['peak'] / mib:8.1f} MiB ({r['above'] / mib:+8.1f} MiB over imports)")  # fmt: skip
    mem, streamed = results["in_memory"], results["streamed"]
    speed = (streamed["tokens"] / streamed["seconds"]) / (mem["tokens"] / mem["seconds"])
    diff = max(abs(a - b) for a, b in zip(mem["psi"], streamed["psi"]))
    print(f"rss_ratio={streamed['above'] / mem['above']:.3f} speed_ratio={speed:.2f} psi_max_abs_diff={diff:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
