"""One analysis run: resolve the models, measure each in turn, write the table, results and plots."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_jreg.analysis.config import AnalyzeConfig, load_texts, resolve_models
from megatron_jreg.analysis.measure import ModelResult, measure
from megatron_jreg.analysis.plot import write_plots
from megatron_jreg.analysis.report import format_table, write_results
from megatron_jreg.analysis.source import load_source


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_analysis(cfg: AnalyzeConfig, log: Callable[[str], None] = _stderr) -> tuple[list[ModelResult], list[Path]]:
    """Measure every model of `cfg` on the same samples; returns the results and the files written.

    Models are loaded one at a time and released before the next, so a checkpoint series needs the
    memory of one model only.
    """
    specs = resolve_models(cfg.models, cfg.checkpoints)
    texts = load_texts(cfg.data, cfg.num_samples)
    log(
        f"analyze: {len(specs)} model(s), {len(texts)} samples of {cfg.data}, distance {cfg.distance}, "
        f"{cfg.dtype} on {cfg.torch_device}"
    )
    results = []
    for i, spec in enumerate(specs, 1):
        log(f"[{i}/{len(specs)}] loading {spec.path} ({spec.kind})")
        source = load_source(
            spec,
            dtype=cfg.torch_dtype,
            device=cfg.torch_device,
            include_final_norm=cfg.include_final_norm,
            tokenizer=cfg.tokenizer,
        )
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
        if result.truncated_samples:
            log(f"    {result.truncated_samples} sample(s) truncated to the model's context (--max-length)")
        results.append(result)
    files = write_results(results, cfg.settings(), cfg.output) + write_plots(results, cfg.output)
    return results, files


def print_report(results: list[ModelResult], files: list[Path]) -> None:
    """The console table on stdout, then where the files went."""
    print(format_table(results))
    print("wrote " + ", ".join(str(p) for p in files))
