"""`megatron-jreg convert`: Megatron-LM checkpoints <-> Hugging Face Llama, each checked by logits against its
source (last line `max_abs_logit_diff=…`; exit 0 done, 1 logits differ, 2 refused)."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from megatron_jreg.dtypes import WEIGHT_DTYPES
from megatron_jreg.errors import UsageError
from megatron_jreg.fileio import check_output_folder
from megatron_jreg.usage import example

_SIZE_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1000' → bytes (Hugging Face's max_shard_size spelling); ValueError otherwise."""
    upper = text.strip().upper()
    for unit, factor in _SIZE_UNITS.items():
        if upper.endswith(unit):
            return int(float(upper[: -len(unit)]) * factor)
    return int(upper)


@dataclass(frozen=True)
class ConvertConfig:
    """One conversion, a field per flag; fields of the other direction keep their defaults."""

    direction: str
    output: Path
    verify: bool | None = None  # None: when both models fit in memory
    verify_threshold: float | None = None  # None: verify.default_threshold
    # mcore-to-hf
    load: Path | None = None
    iteration: int | None = None
    dtype: str | None = None  # None: the run's precision
    tokenizer_model: str | None = None
    tokenizer_type: str | None = None
    no_tokenizer: bool = False
    max_shard_size: str = "5GB"
    # hf-to-mcore
    hf: str | None = None
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    seq_length: int | None = None
    make_vocab_size_divisible_by: int = 128

    def __post_init__(self) -> None:  # direction and --dtype: argparse's choices
        check_output_folder(self.output, f"--output {self.output}", empty=True)
        threshold = self.verify_threshold
        if threshold is not None and not (math.isfinite(threshold) and threshold > 0):
            raise UsageError(f"--verify-threshold {threshold}: must be a positive finite number")
        if self.verify is False and threshold is not None:
            raise UsageError("--verify-threshold needs the logit check: drop --no-verify or the threshold")
        if self.direction == "hf-to-mcore":
            self._check_import()
            return
        if self.iteration is not None and self.iteration < 0:
            raise UsageError(f"--iteration {self.iteration}: must be >= 0 (or omitted for the latest)")
        if self.no_tokenizer and (self.tokenizer_model or self.tokenizer_type):
            raise UsageError("--no-tokenizer writes no tokenizer: drop --tokenizer-model/--tokenizer-type, or it")
        try:
            size = parse_size(self.max_shard_size)
        except ValueError:
            size = 0
        if size < 1:
            raise UsageError(f"--max-shard-size {self.max_shard_size!r}: give a size such as 5GB, 500MB or 2GiB")

    @property
    def shard_bytes(self) -> int:
        """--max-shard-size in bytes (validated above)."""
        return parse_size(self.max_shard_size)

    def _check_import(self) -> None:
        if Path(self.hf).is_file():
            raise UsageError(f"--hf {self.hf}: a file; give the Hugging Face model folder that holds it (config.json "
                             f"and weights), e.g. --hf {Path(self.hf).parent}")
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "make_vocab_size_divisible_by"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be at least 1")
        if self.seq_length is not None and self.seq_length < 1:
            raise UsageError(f"--seq-length {self.seq_length}: must be at least 1 (or omitted for the model's)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ConvertConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in known})


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
    out.add_argument("--load", type=Path, required=True,
                     help="checkpoint folder (the --save folder, or one iter_* folder)")
    out.add_argument("--iteration", type=int, help="iteration to export (default: the latest)")
    out.add_argument("--output", type=Path, required=True, help="new Hugging Face folder (must not exist or be empty)")
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
    inp.add_argument("--output", type=Path, required=True,
                     help="new checkpoint folder, for `megatron-jreg train --load OUT` (must not exist or be empty)")
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


def _report(v, notes: list[str]) -> None:  # noqa: ANN001 - a verify.Verification or None
    for note in filter(None, notes):
        print(f"note: {note}")
    if v is None:
        print("max_abs_logit_diff=not measured")
        return
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

            result = mcore_to_hf(cfg)
            print(f"wrote {result.output} from iteration {result.iteration}: {len(result.files)} files, "
                  f"{str(result.dtype).removeprefix('torch.')}")
            _report(result.verification, [result.note])
        else:
            from megatron_jreg.convert.from_hf import hf_to_mcore
            from megatron_jreg.model_files import inspect_model_folder

            folder = hub.resolve(cfg.hf, "--hf")
            inspect_model_folder(folder, "--hf", allow_pickle=True, require_weights=False)  # .bin: weights_only
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
