"""One analysis run: resolve the models, measure each in turn, write the table, results and plots."""

from __future__ import annotations

import contextlib
import gc
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_jreg.analysis.config import AnalyzeConfig, load_texts, resolve_models
from megatron_jreg.analysis.measure import ModelResult, measure
from megatron_jreg.analysis.memory import PeakMemory
from megatron_jreg.analysis.plot import write_plots
from megatron_jreg.analysis.report import format_table, write_results
from megatron_jreg.analysis.source import AnalysisError, load_source
from megatron_jreg.analysis.stream_source import not_streamable, should_stream
from megatron_jreg.errors import ModelFileError, one_line


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# What the model code of a family (transformers', run on this model's config) raises when it cannot run it.
_MODEL_CODE_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError, NotImplementedError,
                      AssertionError)


@contextlib.contextmanager
def _model_failures(spec):  # noqa: ANN001 - a ModelSpec
    """One line instead of a traceback when the model's own code fails on its config or the samples (e.g. a
    config whose rotary width exceeds its heads); our own refusals pass through unchanged."""
    try:
        yield
    except (AnalysisError, ModelFileError):
        raise
    except _MODEL_CODE_ERRORS as e:
        raise AnalysisError(
            f"--model {spec.path}: its model code failed on the samples ({type(e).__name__}: {one_line(e, 200)}); "
            "its config.json does not describe a model transformers can run, or `megatron-jreg analyze` does not "
            "support this architecture"
        ) from e


def run_analysis(cfg: AnalyzeConfig, log: Callable[[str], None] = _stderr) -> tuple[list[ModelResult], list[Path]]:
    """Measure every model of `cfg` on the same samples; returns the results and the files written.

    Models are loaded one at a time and released before the next, so a checkpoint series needs the
    memory of one model only.
    """
    specs = resolve_models(cfg.models, cfg.checkpoints)
    if cfg.stream:
        for spec in specs:
            reason = f"a {spec.kind} model" if spec.kind != "hf" else not_streamable(spec.path)
            if reason:
                raise AnalysisError(f"--stream: cannot stream {spec.path}: {reason}; drop --stream")
    texts = load_texts(cfg.data, cfg.num_samples)
    log(
        f"analyze: {len(specs)} model(s), {len(texts)} samples of {cfg.data}, distance {cfg.distance}, "
        f"{cfg.dtype} on {cfg.torch_device}"
    )
    results = []
    for i, spec in enumerate(specs, 1):
        stream = cfg.stream
        if stream is None and spec.kind == "hf":
            stream, why = should_stream(spec.path, cfg.torch_dtype, cfg.torch_device)
            log(f"[{i}/{len(specs)}] {spec.path} ({spec.kind}): {why}")
        log(f"[{i}/{len(specs)}] {'reading' if stream else 'loading'} {spec.path} ({spec.kind})")
        with PeakMemory(cfg.torch_device) as memory, _model_failures(spec):
            source = load_source(
                spec,
                dtype=cfg.torch_dtype,
                device=cfg.torch_device,
                include_final_norm=cfg.include_final_norm,
                tokenizer=cfg.tokenizer,
                stream=bool(stream),
            )
            for note in getattr(source, "notes", ()):
                log(f"    note: {note}")
            try:
                result = measure(
                    source,
                    texts,
                    spec,
                    batch_size=cfg.batch_size,
                    max_length=cfg.max_length,
                    kind=cfg.distance,
                    padding_side=cfg.padding_side,
                    progress=cfg.progress,
                )
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
        bad = [layer for layer, psi in enumerate(result.psi, 1) if not math.isfinite(psi)]
        if bad:
            raise AnalysisError(
                f"--model {spec.path}: Ψ is not finite at layer(s) {bad}: the weights hold NaN/inf or the activations "
                "overflow; check the model's weights, or measure with --dtype float32"
            )
        if result.truncated_samples:
            log(f"    {result.truncated_samples} sample(s) truncated to the model's context (--max-length)")
        results.append(result)
    files = write_results(results, cfg.settings(), cfg.output) + write_plots(results, cfg.output)
    return results, files


def print_report(results: list[ModelResult], files: list[Path]) -> None:
    """The console table on stdout, then where the files went."""
    print(format_table(results))
    print("wrote " + ", ".join(str(p) for p in files))
