"""`megatron-jreg convert`: Megatron-LM checkpoints <-> Hugging Face Llama, each checked by logits against its
source (last line `max_abs_logit_diff=…`; exit 0 done, 1 logits differ, 2 refused)."""

from __future__ import annotations

import argparse
import sys

from megatron_jreg.convert.config import ConvertConfig
from megatron_jreg.dtypes import WEIGHT_DTYPES
from megatron_jreg.usage import example


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-jreg convert",
        description="Convert checkpoints between megatron-jreg (megatron-core) and Hugging Face Llama, "
        "checked by logits.",
        **example("megatron-jreg convert mcore-to-hf --load ckpt/1b-jreg --output out/hf-1b-jreg --dtype bfloat16"),
    )
    sub = parser.add_subparsers(dest="direction", required=True)
    verify_help = ("compare the logits of the written model with the source's on a fixed token batch "
                   "(default: when both models fit in memory); --no-verify skips it")
    threshold_help = ("largest allowed |logit difference| in float32 (default: max(1e-4, 16·ε₃₂·(layers + 1)·"
                      "max|logit|), float32 rounding along the layers; see docs/convert.md)")

    out = sub.add_parser("mcore-to-hf", help="Megatron-LM/megatron-jreg checkpoint (any TP/PP) → Hugging Face "
                         "LlamaForCausalLM",
                         **example("megatron-jreg convert mcore-to-hf --load ckpt/1b-jreg --output out/hf-1b-jreg "
                                   "--dtype bfloat16"))
    out.add_argument("--load", required=True, help="checkpoint folder (the --save folder, or one iter_* folder)")
    out.add_argument("--iteration", type=int, help="iteration to export (default: the latest)")
    out.add_argument("--output", required=True, help="new Hugging Face folder (must not exist or be empty)")
    out.add_argument("--dtype", choices=WEIGHT_DTYPES,
                     help="dtype of the written weights (default: the run's precision: --bf16 → bfloat16, "
                     "else float32)")
    out.add_argument("--tokenizer-model",
                     help="tokenizer to write next to the weights, converted to a Hugging Face tokenizer and checked "
                     "id for id: a folder with tokenizer.json, a SentencePiece .model, a tiktoken .json/.tiktoken, or "
                     "a folder with GPT-2's vocab.json and merges.txt; it must match the checkpoint's vocabulary "
                     "(default: the run's own tokenizer)")
    out.add_argument("--tokenizer-type", help="--tokenizer-type of --tokenizer-model (default: from the file)")
    out.add_argument("--no-tokenizer", action="store_true",
                     help="write the model without a tokenizer (e.g. when the run's tokenizer cannot be converted)")
    out.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default 5GB)")
    out.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None, help=verify_help)
    out.add_argument("--verify-threshold", type=float, help=threshold_help)

    inp = sub.add_parser("hf-to-mcore", help="Hugging Face Llama folder → Megatron-LM release checkpoint",
                         **example("megatron-jreg convert hf-to-mcore --hf meta-llama/Llama-3.2-1B --output "
                                   "ckpt/llama-import --tensor-model-parallel-size 2"))
    inp.add_argument("--hf", required=True, help="Hugging Face model folder (config.json + safetensors or .bin), "
                     "or a hub id in the local Hugging Face cache (org/name[@revision])")
    inp.add_argument("--output", required=True, help="new checkpoint folder, for `megatron-jreg train --load OUT` "
                     "(must not exist or be empty)")
    layout = ("checked against the model and recorded (Megatron-LM's flag). The checkpoint is written once at "
              "TP=1/PP=1: dist_checkpointing reshards on load, so it loads at any layout")
    inp.add_argument("--tensor-model-parallel-size", type=int, default=1,
                     help=f"intended TP size, {layout} (default: %(default)s)")
    inp.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                     help=f"intended PP size, {layout} (default: %(default)s)")
    inp.add_argument("--seq-length", type=int, help="training sequence length (default: max_position_embeddings)")
    inp.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                     help="megatron pads the vocabulary to a multiple of this × TP (default 128)")
    inp.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None, help=verify_help)
    inp.add_argument("--verify-threshold", type=float, help=threshold_help)
    return parser


def _report(verification, notes: list[str]) -> None:
    for note in notes:
        if note:
            print(f"note: {note}")
    if verification is None:
        print("max_abs_logit_diff=not measured")
        return
    v = verification
    print(f"logits checked on {v.tokens_shape[0]}×{v.tokens_shape[1]} tokens: largest |logit| {v.max_abs_logit:.4g}, "
          f"threshold {v.threshold:.1e}")
    if v.rounding_effect is not None:
        print(f"note: rounding the weights to the export dtype moved the logits by up to {v.rounding_effect:.3e} "
              "(the check above compares the rounded weights on both sides)")
    print(f"max_abs_logit_diff={v.max_abs_logit_diff:.3e}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # before the imports: --help and usage errors stay instant
    from megatron_jreg.errors import run_command

    return run_command("megatron-jreg convert", lambda: convert(ConvertConfig.from_args(args)))


def convert(cfg: ConvertConfig) -> int:
    """Run one conversion and print its report; 1 when the logits differ (VerificationFailed), else 0."""
    from megatron_jreg import hub
    from megatron_jreg.convert.verify import VerificationFailed

    try:
        if cfg.direction == "mcore-to-hf":
            from megatron_jreg.convert.to_hf import mcore_to_hf

            result = mcore_to_hf(cfg.load, cfg.output, iteration=cfg.iteration, dtype=cfg.dtype,
                                 tokenizer_model=cfg.tokenizer_model, tokenizer_type=cfg.tokenizer_type,
                                 verify=cfg.verify, threshold=cfg.verify_threshold,
                                 max_shard_size=cfg.max_shard_size, no_tokenizer=cfg.no_tokenizer)
            print(f"wrote {result.output} from iteration {result.iteration}: {len(result.files)} files, "
                  f"{str(result.dtype).removeprefix('torch.')}")
            _report(result.verification, [result.note])
        else:
            from megatron_jreg.convert.from_hf import hf_to_mcore
            from megatron_jreg.model_files import check_model_folder

            folder = hub.resolve(cfg.hf, "--hf")
            check_model_folder(folder, "--hf", allow_pickle=True, require_weights=False)  # .bin: weights_only
            result = hf_to_mcore(folder, cfg.output, tensor_model_parallel_size=cfg.tensor_model_parallel_size,
                                 pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
                                 seq_length=cfg.seq_length,
                                 make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
                                 verify=cfg.verify, threshold=cfg.verify_threshold)
            print(f"wrote {result.output} (Megatron-LM release checkpoint: weights and args). Continue training "
                  "with (or the same flags to Megatron-LM's pretrain_gpt.py):\n  megatron-jreg train "
                  + " ".join(result.flags) + " [data, optimizer and --jreg-* flags]")
            _report(result.verification, result.notes)
    except VerificationFailed as e:  # a result, not an error: the numbers that did not pass
        print(f"megatron-jreg convert: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":  # dist_checkpointing's writer processes re-import __main__
    sys.exit(main())
