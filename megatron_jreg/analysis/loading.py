"""What a `--model` is and the source that measures it, answered in one place: each folder is checked once and its
headers and config travel in the `ModelSpec`, so nothing re-reads them."""

from __future__ import annotations

import glob
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from megatron_jreg import hub
from megatron_jreg.analysis.source import AnalysisError, HiddenStateSource
from megatron_jreg.model_files import ModelFolder, auto_config, inspect_model_folder, is_gguf_file

HEADROOM = 1.25  # in-memory analysis needs the weights plus activations; below this factor we stream
_LAST_NUMBER = re.compile(r"(\d+)(?!.*\d)")
_STEP = re.compile(r"(?:^|[^a-z])(?:step|iter|iteration|checkpoint|ckpt)[-_]?(\d+)", re.IGNORECASE)


@dataclass(frozen=True)
class ModelSpec:
    """One model to measure: `kind` is "hf" (folder), "gguf" (file) or "megatron" (checkpoint dir)."""

    path: Path
    label: str
    kind: str
    step: int | None = None
    revision: str | None = None  # the Hugging Face revision it was resolved at (`--revision`)
    flag: str = "--model"  # or "--checkpoints": a series, whose unreadable members are skipped
    unreadable: str | None = None  # why a --checkpoints match cannot be read (it is skipped, saying this)
    config: Any = field(default=None, compare=False, repr=False)
    files: ModelFolder | None = field(default=None, compare=False, repr=False)


def identify(path: Path, flag: str = "--model") -> tuple[str, Any, ModelFolder | None]:
    """(kind "hf", "gguf" or "megatron", transformers config, checked files) of a path given to `flag`."""
    if path.is_dir() and (path / "config.json").exists():
        files = inspect_model_folder(path, flag)  # bad config, headers, pickles or custom code stop here
        return "hf", auto_config(path, flag), files
    if is_gguf_file(path):
        return "gguf", None, None
    from megatron_jreg.checkpoints.files import is_checkpoint  # its package imports megatron-core's checkpointing

    if is_checkpoint(path):
        return "megatron", None, None
    if not path.exists():  # asked only here: `hub.resolve` already looked for it
        raise AnalysisError(f"{flag} {path}: no such file or directory")
    raise AnalysisError(
        f"{flag} {path}: not a Hugging Face model folder (no config.json), a GGUF file, or a megatron-jreg "
        "checkpoint directory (latest_checkpointed_iteration.txt or iter_*/ folders); point it at one of these"
    )


def checkpoint_step(path: Path) -> int | None:
    """The training step in a checkpoint's name: its last number (iter_0001000 → 1000, step-20 → 20)."""
    match = _LAST_NUMBER.search(path.name)
    return int(match.group(1)) if match else None


def resolve_models(models: list[str], checkpoints: str | None, revisions: list[str] | None = None,
                   stream: bool | None = None) -> list[ModelSpec]:
    """`--model` paths or hub ids (each at every `--revision`) in order, then `--checkpoints` by step, each identified
    once; with stream=True a model --stream cannot read is refused before any is measured."""
    given = [(f"{m}@{r}", r) for m in models for r in revisions] if revisions else [(m, None) for m in models]
    entries: list[tuple[Path, str, int | None, str | None, Path]] = []  # path, flag, step, revision, shown as
    for name, revision in given:
        path = hub.resolve(name, "--model")
        shown = path.resolve() if path == Path(name).expanduser() else Path(name)  # a hub id by its name
        step = _STEP.search(revision or Path(name).name)  # step143000, iter_0001000, stage1-step1000-tokens4B → 1000
        entries.append((path, "--model", int(step.group(1)) if step else None, revision, shown))
    if checkpoints:
        matches = [Path(p) for p in glob.glob(checkpoints)]
        if not matches:
            raise AnalysisError(f"--checkpoints {checkpoints!r} matches nothing")
        steps = {p: checkpoint_step(p) for p in matches}
        unordered = [p for p, step in steps.items() if step is None]
        if unordered:
            raise AnalysisError(f"--checkpoints: cannot order {unordered[0]} by step (no number in its name); narrow "
                                "the glob")
        entries += [(p, "--checkpoints", steps[p], None, p.resolve())
                    for p in sorted(matches, key=lambda p: (steps[p], str(p)))]
    parts = [e[-1].parts for e in entries]
    for depth in range(1, max(map(len, parts), default=1) + 1):  # each label: the shortest unique path suffix
        labels = ["/".join(ps[-depth:]) for ps in parts]
        if len(set(labels)) == len(labels):
            break
    specs = []
    for (path, flag, step, revision, _), label in zip(entries, labels):
        try:
            kind, config, files = identify(path, flag)
            specs.append(ModelSpec(path, label, kind, step, revision, flag, config=config, files=files))
        except AnalysisError as e:  # a series skips a match not (yet) readable (an iteration being written)
            if flag != "--checkpoints":
                raise
            specs.append(ModelSpec(path, label, "megatron", step, revision, flag, unreadable=str(e)))
    for spec in specs if stream else ():
        if spec.unreadable is None:
            from megatron_jreg.analysis.stream_source import not_streamable

            reason = f"a {spec.kind} model" if spec.kind != "hf" else not_streamable(spec.path, spec.config)
            if reason:
                raise AnalysisError(f"--stream: cannot stream {spec.path}: {reason}; drop --stream")
    return specs


# --------------------------------------------------------------------------------------------------
# The loader, streaming or not.


def available_bytes(device: torch.device) -> int:
    """Free memory where the model would live: the GPU's, or the host's MemAvailable capped by a cgroup limit."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    available = psutil.virtual_memory().available  # MemAvailable on Linux
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available


def should_stream(spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    """(stream?, why) for `--stream` left to auto: stream when the weights (sized from the carried headers) with
    headroom exceed free memory and the model can stream; said before it loads."""
    from megatron_jreg.analysis.stream_source import not_streamable

    gib = 2**30
    tensors = spec.files.tensors if spec.files is not None else {}
    if not tensors:
        return False, "in memory (no readable *.safetensors to size the weights from)"
    need = sum(t.numel for t in tensors.values()) * dtype.itemsize
    free = available_bytes(device)
    sizes = f"the weights need {need / gib:.1f} GiB, {free / gib:.1f} GiB free"
    if need * HEADROOM <= free:
        return False, f"in memory: {sizes}"
    reason = not_streamable(spec.path, spec.config)
    if reason is not None:
        return False, f"in memory although {sizes}, because --stream cannot read this model: {reason}"
    return True, f"streaming layer by layer: {sizes}"


def load_source(spec: ModelSpec, *, dtype: torch.dtype, device: torch.device, include_final_norm: bool = False,
                tokenizer: str | None = None, stream: bool | None = False, with_tokenizer: bool = True,
                log: Callable[[str], None] = lambda line: None) -> HiddenStateSource:
    """The source for one model, framework imports lazily; stream None: decided by `should_stream`, told to `log`.
    with_tokenizer=False: token ids come from the caller."""
    if stream is None and spec.kind == "hf":
        stream, why = should_stream(spec, dtype, device)
        log(f"{spec.path} ({spec.kind}): {why}")
    if stream and spec.kind != "hf":
        raise AnalysisError(f"--stream: {spec.path} is a {spec.kind} model; streaming reads Hugging Face folders")
    log(f"{'reading' if stream else 'loading'} {spec.path} ({spec.kind})")
    common = dict(label=spec.label, dtype=dtype, device=device, include_final_norm=include_final_norm,
                  tokenizer=tokenizer, with_tokenizer=with_tokenizer)
    if spec.kind == "megatron":
        from megatron_jreg.analysis.megatron_source import load_megatron_source

        return load_megatron_source(spec.path, **common)
    if stream:
        from megatron_jreg.analysis.stream_source import load_stream_source as load
    else:
        from megatron_jreg.analysis.hf_source import load_hf_source as load
    tensors = spec.files.tensors if spec.files is not None else None
    return load(spec.path, config=spec.config, tensors=tensors, **common)
