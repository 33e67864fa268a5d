"""Parameter counts of the `--model-preset`s, per vocabulary, counted on built megatron-core GPTModels.

The paper names its models 170M, 1B and 3.4B; the count depends on the vocabulary (the embedding is
V × hidden, tied with the output layer by Megatron-LM's default), so the docs quote both the Llama-3
tokenizer's 128,256 tokens and the 32,000-token SentencePiece model the docs' recipe trains
(docs/data.md). Each model is built from `megatron-jreg train`'s parsed flags (Megatron-LM's parser) by
megatron-core's GPTModelBuilder, as analyze and convert rebuild a checkpoint's model (local spec,
TP=1/PP=1), on the meta device, so no memory is allocated; the
vocabulary is padded as Megatron-LM pads it (`--make-vocab-size-divisible-by` 128). The count is of distinct
parameters (a tied output layer shares the embedding). The closed formula below is checked against every
built model, so a megatron-core change that alters the layer layout fails loudly.

    python benchmarks/preset_params.py [--vocab 128256 32000] [--untied]

Ends with one key=value line: params_<preset>_v<vocab>=N for every pair.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron_jreg.training.flags import PRESETS, parse_args  # noqa: E402

LLAMA3_VOCAB = 128_256
SENTENCEPIECE_VOCAB = 32_000


def preset_args(preset: str, vocab: int, untied: bool) -> argparse.Namespace:
    """Megatron-LM's args for the preset, a `vocab`-token NullTokenizer, one rank."""
    argv = ["--model-preset", preset, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab),
            "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--transformer-impl", "local"]
    if untied:
        argv.append("--untie-embeddings-and-output-weights")
    args = parse_args(argv)
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    args.padded_vocab_size = vocab_size_with_padding(vocab, args, logging_enabled=False)
    return args


def formula(args: argparse.Namespace) -> int:
    """Llama parameter count: embeddings (+ output layer if untied), per layer QKV/proj/SwiGLU/2 norms, final norm."""
    h, f, layers = args.hidden_size, args.ffn_hidden_size, args.num_layers
    head = args.kv_channels or h // args.num_attention_heads
    qkv = h * head * (args.num_attention_heads + 2 * args.num_query_groups)
    proj = head * args.num_attention_heads * h
    per_layer = qkv + proj + h * 2 * f + f * h + 2 * h
    embed = args.padded_vocab_size * h * (2 if args.untie_embeddings_and_output_weights else 1)
    return embed + layers * per_layer + h


def built(args: argparse.Namespace) -> tuple[int, int]:
    """(all distinct parameters, those outside the embedding and output layer) of the built GPTModel."""
    from megatron_jreg.checkpoints.model import build_model

    with torch.device("meta"):
        model = build_model(args)
    total = sum(p.numel() for p in model.parameters())
    embed = model.embedding.word_embeddings.weight.numel()
    if args.untie_embeddings_and_output_weights:
        embed += model.output_layer.weight.numel()
    return total, total - embed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[LLAMA3_VOCAB, SENTENCEPIECE_VOCAB])
    p.add_argument("--untied", action="store_true", help="count with --untie-embeddings-and-output-weights")
    opts = p.parse_args(argv)
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("RANK", "0")
    logging.disable(logging.WARNING)  # megatron-core's deprecation and CPU notes, on stdout
    print(f"{'preset':<12} {'vocab':>7} {'padded':>7} {'tied':>5} {'params':>14} {'non-embedding':>14}")
    keys = []
    for preset in PRESETS:
        for vocab in opts.vocab:
            args = preset_args(preset, vocab, opts.untied)
            total, body = built(args)
            if total != formula(args):
                print(f"error: {preset} at vocabulary {vocab}: built {total} parameters, formula {formula(args)}",
                      file=sys.stderr)
                return 1
            tied = "no" if opts.untied else "yes"
            print(f"{preset:<12} {vocab:>7} {args.padded_vocab_size:>7} {tied:>5} {total:>14,} {body:>14,}")
            keys.append(f"params_{preset}_v{vocab}={total}")
    print("formula_matches_built=1 " + " ".join(keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
