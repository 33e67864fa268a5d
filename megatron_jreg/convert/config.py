"""What `megatron-jreg convert` does, from its flags: one frozen config per run, validated once before any
checkpoint or model is read (no torch import, so a bad flag is answered at once)."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path

from megatron_jreg.dtypes import WEIGHT_DTYPES
from megatron_jreg.errors import UsageError

DIRECTIONS = ("mcore-to-hf", "hf-to-mcore")
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
    """One conversion. Field names are the flags' (`--tensor-model-parallel-size` → tensor_model_parallel_size);
    fields of the other direction keep their defaults."""

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

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise UsageError(f"convert: direction {self.direction!r}: choose one of {', '.join(DIRECTIONS)}")
        object.__setattr__(self, "output", Path(self.output))
        self._check_output()
        threshold = self.verify_threshold
        if threshold is not None and not (math.isfinite(threshold) and threshold > 0):
            raise UsageError(f"--verify-threshold {threshold}: must be a positive finite number")
        if self.verify is False and threshold is not None:
            raise UsageError("--verify-threshold needs the logit check: drop --no-verify or the threshold")
        if self.direction == "mcore-to-hf":
            self._check_export()
        else:
            self._check_import()

    def _check_output(self) -> None:
        """The output folder is new (or empty) and its parent writable: the result is staged beside it and
        renamed, so a refusal here costs nothing, while one at the end would cost the whole conversion."""
        out = self.output
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise UsageError(f"--output {out} exists and is not empty: remove it or choose another folder")
        parent = next(p for p in (out.absolute().parent, *out.absolute().parents) if p.exists())
        if not parent.is_dir():
            raise UsageError(f"--output {out}: {parent} is a file, not a folder; choose another output path")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UsageError(f"--output {out}: cannot write in {parent} (permission denied); choose a folder you "
                             "can write to")

    def _check_export(self) -> None:
        if self.load is None:
            raise UsageError("mcore-to-hf needs --load CKPT_DIR")
        object.__setattr__(self, "load", Path(self.load))
        if self.iteration is not None and self.iteration < 0:
            raise UsageError(f"--iteration {self.iteration}: must be >= 0 (or omitted for the latest)")
        if self.dtype is not None and self.dtype not in WEIGHT_DTYPES:
            raise UsageError(f"--dtype {self.dtype}: choose one of {', '.join(WEIGHT_DTYPES)}")
        if self.no_tokenizer and (self.tokenizer_model or self.tokenizer_type):
            raise UsageError("--no-tokenizer writes no tokenizer: drop --tokenizer-model/--tokenizer-type, or it")
        try:
            size = parse_size(self.max_shard_size)
        except ValueError:
            size = 0
        if size < 1:
            raise UsageError(f"--max-shard-size {self.max_shard_size!r}: give a size such as 5GB, 500MB or 2GiB")

    def _check_import(self) -> None:
        if not self.hf:
            raise UsageError("hf-to-mcore needs --hf HF_DIR")
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
