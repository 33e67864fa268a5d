"""`megatron-jreg generate` settings: one dataclass, validated before any model is loaded."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from megatron_jreg.data.checks import DataError, check_output_folder
from megatron_jreg.evaluate.config import ConfigError, check_model_flags
from megatron_jreg.evaluate.models import DTYPES

__all__ = ["ConfigError", "GenerateConfig"]  # ConfigError: generate's runner raises it too


@dataclass(frozen=True)
class GenerateConfig:
    """What to answer, with which model (exactly one of `hf`, `load`), how (the flags of generate/cli.py)."""

    prompts: Path
    output: Path | str  # a str keeps a trailing "/" (a folder meant), which Path drops
    hf: Path | None = None
    load: Path | None = None
    iteration: int | None = None
    tokenizer: Path | None = None  # --load: a Hugging Face tokenizer folder instead of the run's own
    chat_template: str | None = None
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 8
    model_id: str | None = None  # default: the model folder's name (its parent's for ".../checkpoints")
    device: str | None = None
    dtype: str = "auto"
    progress: bool | None = None  # None: when stderr is a terminal

    def __post_init__(self) -> None:
        check_model_flags(self.hf, self.load, self.iteration)
        if self.hf is not None and not (Path(self.hf) / "config.json").is_file():
            raise ConfigError(f"--hf {self.hf}: no config.json there; pass the folder save_pretrained wrote")
        if self.tokenizer is not None:
            if self.load is None:
                raise ConfigError("--tokenizer replaces a checkpoint's tokenizer: use it with --load (an --hf folder "
                                  "has its own)")
            if not Path(self.tokenizer).is_dir():
                raise ConfigError(f"--tokenizer {self.tokenizer}: no such folder (a Hugging Face tokenizer folder)")
        if not Path(self.prompts).is_file():
            what = "is a folder" if Path(self.prompts).is_dir() else "no such file"
            raise ConfigError(f"--prompts {self.prompts}: {what}; give a question JSONL file (FastChat's MT-bench "
                              "format, e.g. examples/sft/data/wikitext_questions.jsonl)")
        for flag, value, least in (("--max-new-tokens", self.max_new_tokens, 1), ("--batch-size", self.batch_size, 1),
                                   ("--seed", self.seed, 0), ("--iteration", self.iteration, 0)):
            if value is not None and value < least:
                raise ConfigError(f"{flag} must be >= {least}, got {value}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"--temperature must be a finite number >= 0 (0: greedy), got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.model_id is not None and not self.model_id.strip():
            raise ConfigError("--model-id must not be empty (FastChat's judge names the model by it)")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype}: choose one of {', '.join(DTYPES)}")
        out = Path(self.output)
        if str(self.output).endswith(("/", os.sep)) or out.is_dir():
            raise ConfigError(f"--output {self.output} is a folder; give the answer file, e.g. {out / 'model.jsonl'}")
        if out.resolve() == Path(self.prompts).resolve():
            raise ConfigError(f"--output {self.output} is the --prompts file; write the answers to another file")
        try:
            check_output_folder(out.parent, f"--output {self.output}")  # created, and proven writable
        except DataError as e:
            raise ConfigError(str(e)) from None

    @property
    def name(self) -> str:
        """The model id written into every answer (FastChat's judge reports scores under it)."""
        if self.model_id is not None:
            return self.model_id
        folder = Path(self.hf or self.load).resolve()
        return folder.parent.name if folder.name in ("checkpoints", "checkpoint", "ckpt") else folder.name
