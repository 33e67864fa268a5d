"""One analysis run: resolve the models, measure each in turn, write the table, results and plots."""

from __future__ import annotations

import contextlib
import gc
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_jreg.analysis.config import AnalyzeConfig, load_texts
from megatron_jreg.analysis.loading import ModelSpec, load_source, resolve_models
from megatron_jreg.analysis.measure import ModelResult, PeakMemory, measure
from megatron_jreg.analysis.removal import TOP_K, default_top_k
from megatron_jreg.analysis.report import write_results
from megatron_jreg.analysis.source import AnalysisError
from megatron_jreg.errors import ModelFileError, one_line
from megatron_jreg.progress import library_bars, show_progress


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
    texts = load_texts(cfg.data, cfg.num_samples)
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
