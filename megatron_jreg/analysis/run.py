"""One analysis run: its settings (`AnalyzeConfig`, validated once: each check names its flag and the fix), then
resolve the models, measure each in turn with its peak memory, write the results and plots."""

from __future__ import annotations

import contextlib
import gc
import math
import re
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from megatron_jreg import hub, jreg
from megatron_jreg.analysis.loading import ModelSpec, load_source, resolve_models
from megatron_jreg.analysis.measure import ModelResult, measure
from megatron_jreg.analysis.removal import TOP_K, default_top_k
from megatron_jreg.analysis.report import write_results
from megatron_jreg.analysis.source import AnalysisError
from megatron_jreg.data import text
from megatron_jreg.dtypes import torch_dtype
from megatron_jreg.errors import ModelFileError, one_line
from megatron_jreg.fileio import check_output_folder
from megatron_jreg.progress import library_bars, show_progress

DTYPES = ("float32", "bfloat16")  # of dtypes.WEIGHT_DTYPES: float16 overflows in the residual stream of deep models
PADDING_SIDES = ("right", "left")
POSITIONS = ("all", "last")


@dataclass
class AnalyzeConfig:
    """One field per CLI flag (`--num-samples` → num_samples): the library and the CLI share one set of defaults."""

    models: list[str] = field(default_factory=list)
    checkpoints: str | None = None
    data: str = "lambada"
    num_samples: int | None = 100  # None: all; a LAMBADA sample is a whole passage
    batch_size: int = 8
    max_length: int | None = None
    dtype: str = "float32"
    distance: str = "angular"
    include_final_norm: bool = False
    output: Path = Path("jump_analysis")
    device: str = "auto"
    tokenizer: str | None = None
    padding_side: str = "right"  # no flag; recorded in results.json
    stream: bool | None = None  # None: `loading.should_stream` per model
    progress: bool | None = None  # None: when stderr is a terminal
    remove_layers: bool = False
    top_k: tuple[int, ...] | None = None  # None: `removal.default_top_k` per model
    positions: str = "all"
    revisions: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.output = Path(self.output)
        if not self.models and not self.checkpoints:
            raise AnalysisError("nothing to analyze: give --model PATH (repeatable) or --checkpoints GLOB")
        for flag, value, alternative in (("--num-samples", self.num_samples, " (or 'all')"),
                                         ("--batch-size", self.batch_size, ""), ("--max-length", self.max_length, "")):
            if value is not None and value < 1:
                raise AnalysisError(f"{flag} must be >= 1{alternative}, got {value}")
        for flag, value, allowed in (("--dtype", self.dtype, DTYPES), ("--distance", self.distance, jreg.DISTANCES),
                                     ("--positions", self.positions, POSITIONS),
                                     ("padding_side", self.padding_side, PADDING_SIDES)):
            if value not in allowed:
                raise AnalysisError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
        if self.top_k is not None:
            self.top_k = tuple(self.top_k)
            if not self.top_k or any(not isinstance(k, int) or k < 1 for k in self.top_k):
                raise AnalysisError(f"--top-k {','.join(map(str, self.top_k))}: each k must be a whole number >= 1, "
                                    "e.g. --top-k 1,2,3")
            if not self.remove_layers:
                raise AnalysisError("--top-k is the k of layer removal: add --remove-layers (or drop --top-k)")
        if self.revisions:
            if not self.models:
                raise AnalysisError("--revision needs --model ORG/NAME (a hub id in the local cache)")
            for revision in self.revisions:
                if not revision or "/" in revision or "@" in revision:
                    raise AnalysisError(f"--revision {revision!r}: name branches, tags or commits separated by commas, "
                                        "e.g. --revision step1000,step2000")
            for model in self.models:
                if "@" in model or Path(model).exists():
                    raise AnalysisError(f"--revision with --model {model}: give the hub id without @REVISION (a local "
                                        "folder has no revisions)")
        if self.device != "auto":
            try:
                device = torch.device(self.device)
            except RuntimeError as e:
                raise AnalysisError(f"--device {self.device!r} is not a torch device (use auto, cpu, cuda:0)") from e
            if device.type == "cuda" and not torch.cuda.is_available():
                raise AnalysisError(f"--device {self.device}: no CUDA device here; use --device cpu (or auto)")
        if self.tokenizer is not None:
            self.tokenizer = str(hub.resolve(self.tokenizer, "--tokenizer"))
            if not Path(self.tokenizer).exists():
                raise AnalysisError(f"--tokenizer {self.tokenizer}: no such folder; pass a folder with tokenizer.json")
        check_output_folder(self.output, f"--output {self.output}")
        text.parse_data_spec(self.data)  # fail on a bad --data before any model is loaded

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def settings(self) -> dict:
        """The settings as written into results.json (paths as strings)."""
        out = {key: value for key, value in asdict(self).items() if key != "progress"}
        return {**out, "output": str(self.output), "device": str(self.torch_device)}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# What the model code of a family (transformers', run on this model's config) raises when it cannot run it.
_MODEL_CODE_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError, NotImplementedError,
                      AssertionError)


@contextlib.contextmanager
def _model_failures(spec: ModelSpec) -> Iterator[None]:
    """One line instead of a traceback when the model's own code fails on its config or the samples (e.g. a
    config whose rotary width exceeds its heads); our own refusals pass through unchanged."""
    try:
        yield
    except (AnalysisError, ModelFileError):
        raise
    except _MODEL_CODE_ERRORS as e:
        raise AnalysisError(f"--model {spec.path}: its model code failed on the samples ({type(e).__name__}: "
                            f"{one_line(e, 200)}); its config.json does not describe a model transformers can run, or "
                            "`megatron-jreg analyze` does not support this architecture") from e


class Interrupted(Exception):  # noqa: N818 - the user's Ctrl-C, carried to the CLI with what was saved
    """Ctrl-C while measuring a model; the message says which, and what was written."""


def run_analysis(cfg: AnalyzeConfig) -> tuple[list[ModelResult], list[Path]]:
    """(results, files written) of every model of `cfg`, one at a time (a series needs one model's memory); Ctrl-C
    writes what was measured and raises `Interrupted`."""
    specs = resolve_models(cfg.models, cfg.checkpoints, cfg.revisions, cfg.stream)
    texts = text.read_samples(cfg.data, cfg.num_samples)
    log(
        f"analyze: {len(specs)} model(s), {len(texts)} samples of {cfg.data}, distance {cfg.distance}, "
        f"positions {cfg.positions}, {cfg.dtype} on {cfg.torch_device}"
        + (f", layer removal (top k {','.join(map(str, cfg.top_k or TOP_K))}"
           f"{'' if cfg.top_k else ', up to each model’s layers'})" if cfg.remove_layers else "")
    )
    results: list[ModelResult] = []
    i = 0
    try:
        for i, spec in enumerate(specs, 1):
            try:
                if spec.unreadable:
                    raise AnalysisError(spec.unreadable)
                result = _measure_one(cfg, spec, texts, f"[{i}/{len(specs)}]")
            except AnalysisError as e:
                if spec.flag != "--checkpoints":
                    raise
                log(f"[{i}/{len(specs)}] skipped {spec.path}: {str(e).removeprefix(f'{spec.path}: ')}")
                continue
            results.append(result)
    except KeyboardInterrupt:
        saved = "nothing written"
        if results:
            write_results(results, cfg.settings(), cfg.output)
            saved = f"the {len(results)} model(s) measured before it are in {cfg.output}"
        raise Interrupted(f"interrupted while measuring model {i} of {len(specs)}; {saved}") from None
    if not results:
        raise AnalysisError(f"--checkpoints {cfg.checkpoints!r}: no checkpoint could be read (each is named above)")
    return results, write_results(results, cfg.settings(), cfg.output)


def _measure_one(cfg: AnalyzeConfig, spec: ModelSpec, texts: list[str], tag: str) -> ModelResult:
    """Load, measure and release one model; checks its figures (finite, hidden states not all zero)."""
    progress = show_progress(cfg.progress)
    with PeakMemory(cfg.torch_device) as memory, _model_failures(spec):
        with library_bars(progress):  # transformers' loading and GGUF de-quantizing bars follow --progress too
            source = load_source(spec, dtype=cfg.torch_dtype, device=cfg.torch_device, tokenizer=cfg.tokenizer,
                                 include_final_norm=cfg.include_final_norm, stream=cfg.stream,
                                 log=lambda line: log(f"{tag} {line}"))
        stream = source.streamed
        for note in getattr(source, "notes", ()):
            log(f"    note: {note}")
        try:
            top_k = (cfg.top_k or default_top_k(source.num_layers)) if cfg.remove_layers else None
            result = measure(source, texts, spec, batch_size=cfg.batch_size, max_length=cfg.max_length,
                             kind=cfg.distance, padding_side=cfg.padding_side, progress=progress,
                             positions=cfg.positions, remove_layers=top_k)
            if result.step is None:
                result.step = getattr(source, "iteration", None)
        finally:
            source.close()
            del source
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    result.streamed, result.peak_memory_bytes = bool(stream), memory.peak
    if memory.peak is not None:
        where = "GPU memory allocated" if cfg.torch_device.type == "cuda" else "resident set of this process"
        log(f"    peak memory {memory.peak / 2**30:.2f} GiB ({where}; {'streamed' if stream else 'in memory'})")
    check_result(result, spec.path)
    if result.truncated_samples:
        log(f"    {result.truncated_samples} sample(s) truncated to {result.truncated_to}")
    return result


def check_result(result: ModelResult, path: Path) -> None:
    """Refuse figures that mean nothing (non-finite Ψ or CE, an all-zero layer, which d would read as 0.5); warn when
    only some tokens are zero."""
    bad = [layer for layer, psi in enumerate(result.psi, 1) if not math.isfinite(psi)]
    if bad:
        raise AnalysisError(f"--model {path}: Ψ is not finite at layer(s) {bad}: the weights hold NaN/inf or the "
                            "activations overflow; check the model's weights, or measure with --dtype float32")
    if result.removal is not None:
        ce = [result.removal["base_ce"], *result.removal["ce_skip"], *result.removal["ce_skip_top"]]
        if not all(math.isfinite(c) for c in ce):
            raise AnalysisError(f"--model {path}: the cross-entropy of layer removal is not finite (NaN/inf logits); "
                                "check the model's weights, or measure with --dtype float32")
    zero = [ell for ell, z in enumerate(result.zero_tokens) if z]
    dead = [ell for ell in zero if result.zero_tokens[ell] == result.tokens]
    if dead:
        raise AnalysisError(
            f"--model {path}: every measured hidden state h_ℓ is exactly zero at ℓ = {dead} (0 = the embeddings): "
            "the angle to a zero vector is undefined (it would read as Ψ = 0.5); check the model's weights"
        )
    if zero:
        counts = ", ".join(f"h_{ell}: {result.zero_tokens[ell]}" for ell in zero[:5])
        log(f"    warning: {counts} of {result.tokens} tokens have an all-zero hidden state; d counts each as "
            "orthogonal (0.5 angular, 1 cosine)")


def _status_bytes(key: str) -> int | None:
    """A /proc/self/status figure: VmHWM is the peak clear_refs resets (getrusage's ru_maxrss keeps the peak at any
    thread's exit, so a series would carry an earlier model's)."""
    try:
        match = re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


class PeakMemory:
    """`with PeakMemory(device) as m: ...` → m.peak (bytes at the high point, the process's whole
    resident set on the CPU or allocated GPU memory), m.above (bytes above the level at entry)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.peak: int | None = None
        self.above: int | None = None
        self._base: int | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            with contextlib.suppress(OSError):
                Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            self._base = _status_bytes("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self.peak = _status_bytes("VmHWM")
        if self.peak is not None and self._base is not None:
            self.above = self.peak - self._base
