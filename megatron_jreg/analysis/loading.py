"""What a `--model` path is, and the hidden-state source that measures it.

A path is identified once (`identify`): a Hugging Face folder is checked here (`model_files.check_model_folder`:
config values, safetensors headers, no pickles or custom code) and its transformers config read, and both travel
with the `ModelSpec` to the stream decision and the loader, so nothing re-reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_jreg.analysis.gguf_model import is_gguf_file
from megatron_jreg.analysis.source import AnalysisError, HiddenStateSource
from megatron_jreg.checkpoints.files import is_checkpoint
from megatron_jreg.model_files import check_model_folder


@dataclass(frozen=True)
class ModelSpec:
    """One model to measure: `kind` is "hf" (folder), "gguf" (file) or "megatron" (checkpoint dir)."""

    path: Path
    label: str
    kind: str
    step: int | None = None
    revision: str | None = None
    """The Hugging Face revision it was resolved at (`--revision`), when one was named."""
    flag: str = "--model"
    """The flag that named it: "--model" or "--checkpoints" (a series, whose unreadable members are skipped)."""
    config: Any = field(default=None, compare=False, repr=False)
    """A Hugging Face folder's transformers config, read by `identify` after the folder was checked."""


def identify(path: Path, flag: str = "--model") -> tuple[str, Any]:
    """(kind, config) of a path given to `flag`: ("hf", its transformers config), ("gguf", None) or
    ("megatron", None); an AnalysisError says what was expected."""
    if not path.exists():
        raise AnalysisError(f"{flag} {path}: no such file or directory")
    if is_gguf_file(path):
        return "gguf", None
    if path.is_dir() and (path / "config.json").exists():
        from megatron_jreg.analysis.hf_source import auto_config

        check_model_folder(path, flag)  # bad config, headers, pickles or custom code stop here, before any load
        return "hf", auto_config(path)
    if is_checkpoint(path):
        return "megatron", None
    raise AnalysisError(
        f"{flag} {path}: not a Hugging Face model folder (no config.json), a GGUF file, or a megatron-jreg "
        "checkpoint directory (latest_checkpointed_iteration.txt or iter_*/ folders); point it at one of these"
    )


def load_source(
    spec: ModelSpec,
    *,
    dtype: torch.dtype,
    device: torch.device,
    include_final_norm: bool = False,
    tokenizer: str | None = None,
    stream: bool = False,
    with_tokenizer: bool = True,
) -> HiddenStateSource:
    """Build the source for one model; framework imports happen here, lazily. `stream`: read a Hugging
    Face folder one layer at a time (`stream_source.py`) instead of loading it; with_tokenizer=False: token
    ids come from the caller."""
    if stream and spec.kind != "hf":
        raise AnalysisError(f"--stream: {spec.path} is a {spec.kind} model; streaming reads Hugging Face folders")
    common = dict(label=spec.label, dtype=dtype, device=device, include_final_norm=include_final_norm,
                  tokenizer=tokenizer, with_tokenizer=with_tokenizer)
    if spec.kind == "megatron":
        from megatron_jreg.analysis.megatron_source import load_megatron_source

        return load_megatron_source(spec.path, **common)
    if stream:
        from megatron_jreg.analysis.stream_source import load_stream_source as load
    else:
        from megatron_jreg.analysis.hf_source import load_hf_source as load
    return load(spec.path, config=spec.config, **common)
