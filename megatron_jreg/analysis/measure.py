"""Measure Ψ_ℓ and ζ_ℓ of one model over a list of texts: exact sums per layer over all real tokens (not a mean of batch
means), so batching never changes the result."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from megatron_jreg import jreg
from megatron_jreg.analysis.loading import ModelSpec
from megatron_jreg.analysis.removal import check_top_k, next_token_targets, removal_figures
from megatron_jreg.analysis.source import AnalysisError, HiddenStateSource, last_token_mask
from megatron_jreg.progress import progress_bar


@dataclass
class ModelResult:
    """Per-layer totals of one model and the figures derived from them (layers ℓ = 1..L, states h_0..h_L), each
    defined once in `report.DEFINITIONS`."""

    label: str
    path: str
    kind: str
    model_class: str
    convention: str
    step: int | None
    sums: list[float]  # Σ d(h_{ℓ-1}, h_ℓ) over the measured tokens, index ℓ-1
    counts: list[int]  # tokens measured at layer ℓ, index ℓ-1
    samples: int
    truncated_samples: int
    streamed: bool = False  # read layer by layer from safetensors (`stream_source.py`)
    peak_memory_bytes: int | None = None  # `PeakMemory` while loading and measuring, when known
    distance: str = "angular"  # d: "angular" (arccos(cos)/π, the paper's Ψ) or "cosine" (1 − cos)
    positions: str = "all"  # "all" real tokens, or the "last" of each sample
    norm_sums: list[float] = field(default_factory=list)  # Σ ‖h_ℓ‖ over the measured tokens, ℓ = 0..L
    zero_tokens: list[int] = field(default_factory=list)  # tokens whose h_ℓ is zero (d: orthogonal), ℓ = 0..L
    distance_sums: list[list[float]] = field(default_factory=list)  # [i][j] = Σ d(h_i, h_j) for i < j, else 0
    removal: dict | None = None  # `removal.RemovalTotals.as_dict`, when measured
    truncated_to: str | None = None  # "--max-length T" or "the model's context (T tokens)"
    revision: str | None = None  # the Hugging Face revision (--revision), when one was named

    @property
    def num_layers(self) -> int:
        return len(self.sums)

    @property
    def psi(self) -> list[float]:
        return [s / c if c else math.nan for s, c in zip(self.sums, self.counts)]

    @property
    def zeta(self) -> list[float]:
        if self.num_layers < 2:
            return []
        return jreg.jump_rates(torch.tensor(self.psi, dtype=torch.float64)).tolist()

    @property
    def final_jumps(self) -> dict[str, float]:
        if self.num_layers < 2:
            return dict.fromkeys(("zeta_L", "zeta_L-1", "zeta_L-2"), math.nan)
        return jreg.final_jumps(torch.tensor(self.psi, dtype=torch.float64))

    @property
    def middle_layers(self) -> tuple[int, int] | None:
        n = self.num_layers
        lo, hi = max(2, n // 4 + 1), min(n - 1, n - n // 4)
        return (lo, hi) if lo <= hi else None

    @property
    def psi_mid_median(self) -> float:
        span = self.middle_layers
        return statistics.median(self.psi[span[0] - 1 : span[1]]) if span else math.nan

    @property
    def psi_ratio(self) -> float:
        mid = self.psi_mid_median
        return self.psi[-1] / mid if mid and math.isfinite(mid) else math.nan

    @property
    def largest_rise(self) -> tuple[int | None, float]:
        psi = self.psi
        if len(psi) < 2:
            return None, math.nan
        rises = [100.0 * (b - a) for a, b in zip(psi[:-1], psi[1:])]
        best = max(range(len(rises)), key=lambda i: rises[i])
        return best + 2, rises[best]

    @property
    def tokens(self) -> int:
        return self.counts[0] if self.counts else 0

    @property
    def residual_norms(self) -> list[float]:
        return [s / self.tokens if self.tokens else math.nan for s in self.norm_sums]

    @property
    def residual_growth(self) -> float:
        norms = self.residual_norms
        return norms[-1] / norms[0] if len(norms) > 1 and norms[0] and math.isfinite(norms[0]) else math.nan

    @property
    def layer_distances(self) -> list[list[float]]:
        size = len(self.distance_sums)
        n_tok = self.tokens or math.nan
        return [[self.distance_sums[i][i + n] / n_tok for i in range(size - n)] for n in range(1, size)]


def encode_samples(source: HiddenStateSource, texts: list[str], max_length: int | None
                   ) -> tuple[list[list[int]], int, str | None]:
    """(token ids of each non-empty text, truncated to `max_length` or the context; number truncated; what cut them)."""
    limit = max_length or source.context_length
    samples, truncated = [], 0
    for ids in source.encode(texts):
        if limit is not None and len(ids) > limit:
            ids, truncated = ids[:limit], truncated + 1
        if ids:
            samples.append(ids)
    why = f"--max-length {max_length}" if max_length else f"the model's context ({limit} tokens)"
    return samples, truncated, why if truncated else None


def padded_batches(samples: list[list[int]], batch_size: int, pad_id: int, padding_side: str = "right"
                   ) -> Iterator[tuple[Tensor, Tensor]]:
    """(input_ids[b, t], attention_mask[b, t]) batches, longest first so a batch too large for memory fails at once."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i]))
    for start in range(0, len(order), batch_size):
        chunk = [torch.tensor(samples[i], dtype=torch.long) for i in order[start : start + batch_size]]
        yield (pad_sequence(chunk, batch_first=True, padding_value=pad_id, padding_side=padding_side),
               pad_sequence([torch.ones_like(c) for c in chunk], batch_first=True, padding_side=padding_side))


def measure(source: HiddenStateSource, texts: list[str], spec: ModelSpec, *, batch_size: int = 8,
            max_length: int | None = None, kind: str = "angular", padding_side: str = "right", progress: bool = False,
            positions: str = "all", remove_layers: Sequence[int] | None = None) -> ModelResult:
    """The figures of `ModelResult` for `source` over `texts` (padding excluded), and with `remove_layers` (the
    top k values) layer removal on the same samples."""
    if remove_layers is not None:  # before any work: k within the model's layers, an LM head to score with
        remove_layers = check_top_k(remove_layers, source.num_layers, "--top-k")
        if getattr(source, "head_missing", None):
            raise AnalysisError(f"--remove-layers: layer removal needs the LM head, but {source.head_missing}; "
                                "drop --remove-layers or add the head's weights")
    samples, truncated, truncated_to = encode_samples(source, texts, max_length)
    if not samples:
        raise AnalysisError(f"{spec.label}: no sample has any token; check --data")
    tokens = sum(map(len, samples))
    streaming = hasattr(source, "stream_stats")  # `StreamingSource`: every batch through one layer at a time
    side = "right" if streaming or remove_layers is not None else padding_side
    batches = [(ids, mask, last_token_mask(mask) if positions == "last" else mask.bool())
               for ids, mask in padded_batches(samples, batch_size, source.pad_id, side)]
    total, label = (tokens * source.num_layers, f"{spec.label} (layers × tokens)") if streaming else \
        (tokens, spec.label)
    with progress_bar(total, label, "tok", progress) as bar:
        if streaming:
            stats = source.stream_stats(batches, kind, bar.update)
        else:
            stats = None
            for ids, mask, select in batches:
                batch = source.layer_stats(ids, mask, kind, select)
                stats = batch if stats is None else {key: stats[key] + batch[key] for key in stats}
                bar.update(int(mask.sum()))
    result = ModelResult(
        label=spec.label, path=str(spec.path), kind=spec.kind, model_class=source.model_class,
        convention=source.convention, step=spec.step, sums=stats["sums"].tolist(),
        counts=[int(c) for c in stats["counts"].tolist()], samples=len(samples), truncated_samples=truncated,
        distance=kind, positions=positions, norm_sums=stats["norm_sums"].tolist(),
        zero_tokens=[int(z) for z in stats["zero_tokens"].tolist()], distance_sums=stats["distance_sums"].tolist(),
        truncated_to=truncated_to, revision=spec.revision)
    if remove_layers is not None:
        label = f"{spec.label} (layer removal)"
        with_targets = [(ids, mask, next_token_targets(ids, mask, positions)) for ids, mask, _ in batches]
        if not any(bool((t >= 0).any()) for _, _, t in with_targets):
            raise AnalysisError(f"{label}: no sample has a token to predict (all are one token long); layer removal "
                                "needs samples of two tokens or more")
        result.removal = removal_figures(source, with_targets, remove_layers, label, progress)
    return result
