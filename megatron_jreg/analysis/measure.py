"""Measure Ψ_ℓ and ζ_ℓ of one model over a list of texts.

Accumulation is exact over the data set: per layer, the sum of per-token displacements and the number
of real tokens over all samples and batches, Ψ_ℓ = Σ / count at the end (not a mean of batch means).
Batches are formed from samples sorted by length, so little compute goes into padding; the result does
not depend on the batching because padded positions never enter the sums.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_jreg import jreg
from megatron_jreg.analysis.source import AnalysisError, HiddenStateSource, LayerStreamingSource, ModelSpec


@dataclass
class ModelResult:
    """Per-layer totals of one model and the figures derived from them (layers ℓ = 1..L)."""

    label: str
    path: str
    kind: str
    model_class: str
    convention: str
    step: int | None
    sums: list[float]
    """Σ over real tokens of d(h_{ℓ-1}, h_ℓ), index ℓ-1."""
    counts: list[int]
    """Real tokens seen by layer ℓ, index ℓ-1."""
    samples: int
    truncated_samples: int
    streamed: bool = False
    """Measured layer by layer from safetensors (`stream_source.py`) rather than loaded whole."""
    peak_memory_bytes: int | None = None
    """Peak memory while loading and measuring this model (`memory.PeakMemory`), when measured."""

    @property
    def num_layers(self) -> int:
        return len(self.sums)

    @property
    def psi(self) -> list[float]:
        """Ψ_ℓ for ℓ = 1..L."""
        return [s / c if c else math.nan for s, c in zip(self.sums, self.counts)]

    @property
    def zeta(self) -> list[float]:
        """ζ_ℓ for ℓ = 2..L (`jreg.jump_rates`); empty for a 1-layer model."""
        if self.num_layers < 2:
            return []
        return jreg.jump_rates(torch.tensor(self.psi, dtype=torch.float64)).tolist()

    @property
    def final_jumps(self) -> dict[str, float]:
        """{zeta_L, zeta_L-1, zeta_L-2} (`jreg.final_jumps`), NaN where L is too small."""
        if self.num_layers < 2:
            return dict.fromkeys(("zeta_L", "zeta_L-1", "zeta_L-2"), math.nan)
        return jreg.final_jumps(torch.tensor(self.psi, dtype=torch.float64))

    @property
    def middle_layers(self) -> tuple[int, int] | None:
        """(first, last) ℓ of the middle layers: the central half of the stack, never layer 1 or L."""
        n = self.num_layers
        lo, hi = max(2, n // 4 + 1), min(n - 1, n - n // 4)
        return (lo, hi) if lo <= hi else None

    @property
    def psi_mid_median(self) -> float:
        """Median Ψ of the middle layers: the typical step size that Ψ_L is compared against."""
        span = self.middle_layers
        return statistics.median(self.psi[span[0] - 1 : span[1]]) if span else math.nan

    @property
    def tokens(self) -> int:
        return self.counts[0] if self.counts else 0


def encode_samples(source: HiddenStateSource, texts: list[str], max_length: int | None) -> tuple[list[list[int]], int]:
    """Token ids of each text, truncated to `max_length` (default: the model's context length).

    Returns (samples, number truncated); texts that tokenize to nothing are dropped.
    """
    limit = max_length or source.context_length
    samples, truncated = [], 0
    for ids in source.encode(texts):
        if limit is not None and len(ids) > limit:
            ids, truncated = ids[:limit], truncated + 1
        if ids:
            samples.append(ids)
    return samples, truncated


def padded_batches(
    samples: list[list[int]], batch_size: int, pad_id: int, padding_side: str = "right"
) -> Iterator[tuple[Tensor, Tensor]]:
    """Batches (input_ids[b, t] int64, attention_mask[b, t] int64) of samples sorted longest first.

    Longest first so that a batch too large for memory fails at once rather than at the end.
    """
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i]))
    for start in range(0, len(order), batch_size):
        chunk = [samples[i] for i in order[start : start + batch_size]]
        width = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, s in enumerate(chunk):
            cols = slice(0, len(s)) if padding_side == "right" else slice(width - len(s), width)
            ids[row, cols] = torch.tensor(s, dtype=torch.long)
            mask[row, cols] = 1
        yield ids, mask


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, label: str, enabled: bool, unit: str = "tok"):
    """A tqdm bar on stderr (with its rate and time left), or a stand-in when disabled or tqdm is missing."""
    if not enabled:
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, desc=label, unit=unit, unit_scale=True, leave=True, dynamic_ncols=True)


def measure(
    source: HiddenStateSource,
    texts: list[str],
    spec: ModelSpec,
    *,
    batch_size: int = 8,
    max_length: int | None = None,
    kind: str = "angular",
    padding_side: str = "right",
    progress: bool = False,
) -> ModelResult:
    """Ψ_ℓ totals of `source` over `texts` (all positions of each sample, padding excluded)."""
    samples, truncated = encode_samples(source, texts, max_length)
    if not samples:
        raise AnalysisError(f"{spec.label}: no sample has any token; check --data")
    sums = torch.zeros(source.num_layers, dtype=torch.float64)
    counts = torch.zeros(source.num_layers, dtype=torch.float64)
    tokens = sum(map(len, samples))
    bar = _NoProgress()
    try:
        if isinstance(source, LayerStreamingSource):  # every batch through one layer at a time
            bar = progress_bar(tokens * source.num_layers, f"{spec.label} (layers × tokens)", progress)
            batches = list(padded_batches(samples, batch_size, source.pad_id, "right"))
            sums, counts = source.stream_sums(batches, kind, bar.update)
        else:
            bar = progress_bar(tokens, spec.label, progress)
            for ids, mask in padded_batches(samples, batch_size, source.pad_id, padding_side):
                batch_sums, batch_counts = source.layer_sums(ids, mask, kind)
                sums += batch_sums
                counts += batch_counts
                bar.update(int(mask.sum()))
    finally:
        bar.close()
    return ModelResult(
        label=spec.label,
        path=str(spec.path),
        kind=spec.kind,
        model_class=source.model_class,
        convention=source.convention,
        step=spec.step,
        sums=sums.tolist(),
        counts=[int(c) for c in counts.tolist()],
        samples=len(samples),
        truncated_samples=truncated,
    )
