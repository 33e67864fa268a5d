"""`megatron-jreg evaluate` settings: one dataclass, validated once, errors that name the flag."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_jreg import hub
from megatron_jreg.data.text import DEFAULT_LAMBADA
from megatron_jreg.errors import BadConfigError, JregError
from megatron_jreg.evaluate.models import DTYPES
from megatron_jreg.model_files import read_config

BUILTIN_TASKS = ("lambada",)


class ConfigError(JregError, ValueError):
    """A flag value that cannot work; the message names the flag and the fix."""


def check_model_flags(hf: Path | None, load: Path | None, iteration: int | None) -> None:
    """The model flags evaluate and generate share: exactly one of --hf and --load; --iteration with --load."""
    if (hf is None) == (load is None):
        raise ConfigError("give exactly one model: --hf DIR (a Hugging Face folder) or --load CKPT (a Megatron-LM or "
                          "megatron-jreg checkpoint)")
    if load is not None and not Path(load).is_dir():
        raise ConfigError(f"--load {load}: no such checkpoint folder")
    if iteration is not None and load is None:
        raise ConfigError("--iteration selects a checkpoint of --load; use it with --load")


@dataclass(frozen=True)
class EvaluateConfig:
    """What to evaluate and how: one model (`hf` folder or cached hub id, or `load` checkpoint), tasks mixing the
    built-in "lambada" with lm-eval names."""

    hf: Path | None = None
    load: Path | None = None
    iteration: int | None = None
    tasks: tuple[str, ...] = ("lambada",)
    lambada_file: Path = DEFAULT_LAMBADA
    limit: int | None = None  # first N examples of each task
    batch_size: int = 8
    max_length: int | None = None  # None: the model's context window
    device: str | None = None  # None: cuda when available, else cpu
    dtype: str = "auto"
    output: Path | None = None
    task_data: dict[str, Path] = field(default_factory=dict)  # lm-eval task -> local dataset copy
    include_path: tuple[Path, ...] = ()  # folders with extra lm-eval task YAMLs
    seed: int | None = None  # training seed of the model, recorded so `compare` can pair runs
    bootstrap_iters: int = 100000  # lm-eval's default; only bootstrapped metrics (perplexity) use it
    num_fewshot: int | None = None  # lm-eval tasks: examples in each prompt (None: each task's default)
    progress: bool | None = None  # bars on stderr; None: when stderr is a terminal

    def __post_init__(self) -> None:
        check_model_flags(self.hf, self.load, self.iteration)
        if self.hf is not None:
            try:
                object.__setattr__(self, "hf", hub.resolve(self.hf, "--hf"))  # a hub id: its cached snapshot
            except hub.HubError as e:
                raise ConfigError(str(e)) from None
            if not (Path(self.hf) / "config.json").is_file():
                raise ConfigError(f"--hf {self.hf}: no config.json there; pass the folder save_pretrained wrote")
            try:
                read_config(Path(self.hf), "--hf")
            except BadConfigError as e:
                raise ConfigError(str(e)) from None
        if not self.tasks or len(set(self.tasks)) != len(self.tasks) or "" in self.tasks:
            raise ConfigError(f"--tasks {','.join(self.tasks)}: give distinct task names, e.g. lambada,boolq")
        if "lambada" in self.tasks and not Path(self.lambada_file).is_file():
            raise ConfigError(
                f'--lambada-file {self.lambada_file}: no such file (JSONL, one {{"text": ...}} a line)'
            )
        for flag, value, least in (
            ("--limit", self.limit, 1),
            ("--batch-size", self.batch_size, 1),
            ("--max-length", self.max_length, 2),
            ("--bootstrap-iters", self.bootstrap_iters, 0),
        ):
            if value is not None and value < least:
                raise ConfigError(f"{flag} {value}: must be at least {least}")
        if self.num_fewshot is not None:
            if self.num_fewshot < 0:
                raise ConfigError(f"--num-fewshot {self.num_fewshot}: must be at least 0")
            if self.num_fewshot > 0 and "lambada" in self.tasks:
                raise ConfigError(
                    f"--num-fewshot {self.num_fewshot}: the built-in lambada is zero-shot; evaluate it in a "
                    "separate run, or use lm-eval's lambada_openai task instead"
                )
        if self.device is not None:
            try:
                device = torch.device(self.device)
            except RuntimeError:
                raise ConfigError(f"--device {self.device}: not a torch device; use cpu, cuda or cuda:N") from None
            if device.type == "cuda" and not torch.cuda.is_available():
                raise ConfigError(f"--device {self.device}: no CUDA device here; use --device cpu")
        if self.output is not None:  # not created here: a failed run writes nothing
            out = Path(self.output)
            if out.is_dir():
                raise ConfigError(f"--output {out}: is a folder; pass a file name, e.g. {out / 'results.json'}")
            parent = next(p for p in (out.parent, *out.parent.parents) if p.exists())
            if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
                raise ConfigError(f"--output {out}: cannot write into {parent}; pass a path you can write to")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype}: choose one of {', '.join(DTYPES)}")
        for task, path in self.task_data.items():
            if task not in self.harness_tasks:
                raise ConfigError(f"--task-data {task}={path}: {task} is not an lm-eval task in --tasks")
            if not Path(path).exists():
                raise ConfigError(f"--task-data {task}={path}: no such file or folder")
        for path in self.include_path:
            if not Path(path).is_dir():
                raise ConfigError(f"--include-path {path}: no such folder")

    @property
    def harness_tasks(self) -> tuple[str, ...]:
        """The tasks lm-eval runs (all but the built-in ones)."""
        return tuple(t for t in self.tasks if t not in BUILTIN_TASKS)
