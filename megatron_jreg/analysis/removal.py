"""Layer removal: how much next-token cross-entropy rises when decoder layers are skipped (output := input), per layer
and for the top k (ShortGPT; Gromov et al. 2024). `layer_removal` is the library entry on token windows."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from megatron_jreg.analysis.loading import ModelSpec, identify, load_source
from megatron_jreg.analysis.source import AnalysisError, first_tensor, last_token_mask, planned_layers
from megatron_jreg.progress import library_bars, progress_bar

TOP_K = (1, 2, 3)
IGNORE = -100  # target id of a position that predicts nothing (padding, a sample's last token)
DEFINITION = (
    "delta_ce[l-1] = CE with decoder layer l skipped (its output := its input) minus the model's CE; "
    "delta_ce_top[i] = CE with the top top_k[i] layers (L-k+1..L) skipped minus the model's CE; "
    "CE in nats per predicted token"
)


@dataclass
class RemovalTotals:
    """Σ CE over the predicted tokens of the model and of each variant (float64 on the CPU)."""

    num_layers: int
    top_k: tuple[int, ...]
    sums: Tensor  # [1 + L + len(top_k)] = [model, layer 1..L skipped, the top k skipped].
    tokens: int  # Predicted tokens (the same for every variant).

    def as_dict(self) -> dict:
        """The figures: CE and ΔCE in nats per predicted token (see `DEFINITION`)."""
        ce = (self.sums / (self.tokens or math.nan)).tolist()
        base, skip, top = ce[0], ce[1 : 1 + self.num_layers], ce[1 + self.num_layers :]
        return {"definition": DEFINITION, "num_layers": self.num_layers, "predicted_tokens": self.tokens,
                "base_ce": base, "ce_skip": skip, "delta_ce": [s - base for s in skip], "top_k": list(self.top_k),
                "ce_skip_top": top, "delta_ce_top": [s - base for s in top]}


def default_top_k(num_layers: int) -> tuple[int, ...]:
    """TOP_K's values up to `num_layers` (a 2-layer model: the top 1 and 2), for a caller that named none."""
    return tuple(k for k in TOP_K if k <= num_layers)


def check_top_k(top_k: Sequence[int], num_layers: int, flag: str = "top_k") -> tuple[int, ...]:
    """Distinct k in 1..L, in increasing order; an AnalysisError names `flag` otherwise."""
    ks = tuple(sorted(set(int(k) for k in top_k)))
    bad = [k for k in ks if not 1 <= k <= num_layers]
    if bad:
        raise AnalysisError(f"{flag} {','.join(map(str, bad))}: k must be between 1 and the model's {num_layers} "
                            "decoder layers; pass values in that range")
    return ks


def ce_sum(logits: Tensor, targets: Tensor) -> Tensor:
    """Σ next-token CE (fp32 softmax, float64 sum) of logits[b, t, V] against targets[b, t] (IGNORE: none)."""
    flat = targets.reshape(-1).to(logits.device)
    rows = (flat != IGNORE).nonzero().squeeze(1)
    picked = logits.reshape(-1, logits.shape[-1]).index_select(0, rows).float()
    return torch.nn.functional.cross_entropy(picked, flat.index_select(0, rows), reduction="sum").double()


def next_token_targets(ids: Tensor, mask: Tensor, positions: str = "all") -> Tensor:
    """targets[b, t]: the next real token at each real position, IGNORE elsewhere; positions="last": only each sample's
    last token, as LAMBADA scores a passage."""
    mask = mask.bool()
    targets = torch.full_like(ids, IGNORE)
    predicts = mask[:, :-1] & mask[:, 1:]
    if positions == "last":
        predicts = predicts & last_token_mask(mask)[:, 1:]
    targets[:, :-1] = torch.where(predicts, ids[:, 1:], torch.full_like(ids[:, 1:], IGNORE))
    return targets


@torch.no_grad()
def batch_removal(source: Any, ids: Tensor, mask: Tensor, targets: Tensor, top_k: tuple[int, ...],
                  on_pass: Callable[[int], None] | None = None) -> Tensor:
    """Σ CE of one batch [1 + L + len(top_k)] float64 (model, each layer skipped, the top k), reusing the full pass's
    layer outputs. source: `layers` and `logits(ids, mask)`; ids/mask right-padded."""
    layers = source.layers
    num = len(layers)
    tick = on_pass or (lambda n: None)
    kept: list[tuple[Any, int]] = [(None, 0)] * num  # each layer's output and its version when made

    def keep(i: int, module: nn.Module, args: tuple, out: Any) -> None:
        kept[i] = (out, first_tensor(out)._version)

    handles = [layer.register_forward_hook(functools.partial(keep, i)) for i, layer in enumerate(layers)]
    try:
        sums = [ce_sum(source.logits(ids, mask), targets)]
    finally:
        for handle in handles:
            handle.remove()
    outputs = [out for out, _ in kept]
    tick(num)

    def variant(first: int, skipped: Sequence[int]) -> None:
        """Layers 1..first answer with layer `first`'s recorded output, the skipped ones return their input."""
        with planned_layers(layers, outputs[max(first - 1, 0)], first, skipped):
            sums.append(ce_sum(source.logits(ids, mask), targets))
        tick(num - first - len(skipped))  # the layers computed above the skipped ones

    for skip in range(num):
        variant(skip, [skip])
    for k in top_k:
        variant(num - k, range(num - k, num))
    changed = [i + 1 for i, (out, version) in enumerate(kept) if first_tensor(out)._version != version]
    if changed:  # a recorded output changed in place (by the next layer) cannot answer for its layer
        raise AnalysisError(f"decoder layer(s) {changed} modify their input in place; layer removal cannot reuse "
                            "their outputs for this model")
    return torch.stack(sums).cpu()  # one host sync per batch


def removal_figures(source: Any, batches: Sequence[tuple[Tensor, Tensor, Tensor]], top_k: tuple[int, ...], label: str,
                    progress: bool) -> dict:
    """`removal_totals` under a progress bar, as figures (`RemovalTotals.as_dict`). The bar counts layer passes,
    per batch: L for the model, L − ℓ for the variant without ℓ, plus one per forward pass (embeddings, LM head)."""
    num = source.num_layers
    passes = len(batches) * (num + num * (num - 1) // 2 + 1 + num + len(top_k))
    with progress_bar(passes, label, "layer", progress) as bar:
        return removal_totals(source, batches, top_k, bar.update).as_dict()


def removal_totals(source: Any, batches: Sequence[tuple[Tensor, Tensor, Tensor]], top_k: Sequence[int],
                   on_pass: Callable[[int], None] | None = None) -> RemovalTotals:
    """Σ CE of the model and every variant over right-padded (ids, mask, targets) batches; on_pass(n): layer passes."""
    ks = check_top_k(top_k, source.num_layers, "--top-k" if on_pass else "top_k")
    if hasattr(source, "stream_removal"):
        sums = source.stream_removal(list(batches), ks, ce_sum, on_pass)
    else:
        tick = (lambda n: on_pass(n + 1)) if on_pass else None
        sums = sum(batch_removal(source, ids, mask, targets, ks, tick) for ids, mask, targets in batches)
    return RemovalTotals(source.num_layers, ks, sums, sum(int((t != IGNORE).sum()) for _, _, t in batches))


# ----------------------------------------------------------------------------------------------------------
# The library entry.


def _as_source(model: Any, dtype: torch.dtype, device: torch.device | str | None, stream: bool,
               progress: bool = False) -> tuple[Any, bool]:
    """(source, owned) for a path, a `checkpoints.MegatronModel`, a transformers causal LM or a source; owned: loaded
    here, closed after."""
    if isinstance(model, (str, Path)):
        path = Path(model)
        kind, config, files = identify(path, "model")
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        with library_bars(progress):
            return load_source(ModelSpec(path, path.name, kind, config=config, files=files), dtype=dtype, device=device,
                               stream=stream and kind != "megatron", with_tokenizer=False), True
    if hasattr(model, "layers") and (hasattr(model, "logits") or hasattr(model, "stream_removal")):
        return model, False
    from megatron_jreg.checkpoints.model import MegatronModel

    if isinstance(model, MegatronModel):
        from megatron_jreg.analysis.megatron_source import MegatronSource

        return MegatronSource(model, model.path.name), False
    if isinstance(model, nn.Module) and hasattr(model, "config"):
        from megatron_jreg.analysis.hf_source import HFSource

        return HFSource(model, None, type(model).__name__), False
    raise AnalysisError(f"layer_removal: cannot use a {type(model).__name__} as a model; pass a path, a "
                        "checkpoints.MegatronModel, a transformers causal LM or an analysis source")


def check_windows(windows: Any, vocab_size: int | None) -> Tensor:
    """windows[N, S] of token ids, S ≥ 2, ids in [0, vocab_size): an AnalysisError names what is wrong."""
    if not isinstance(windows, Tensor) or windows.dim() != 2 or windows.dtype.is_floating_point \
            or windows.dtype == torch.bool:
        what = f"a {windows.dim()}-D {windows.dtype} tensor" if isinstance(windows, Tensor) else type(windows).__name__
        raise AnalysisError(f"windows: expected token ids as an integer tensor [N, S], got {what}")
    if windows.shape[0] < 1 or windows.shape[1] < 2:
        raise AnalysisError(f"windows: shape {tuple(windows.shape)} holds no prediction; pass [N ≥ 1, S ≥ 2]")
    low, high = int(windows.min()), int(windows.max())
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        raise AnalysisError(f"windows: token ids span {low}..{high}, outside the model's vocabulary of {vocab_size}; "
                            "tokenize with the model's tokenizer")
    return windows.long()


def layer_removal(model: Any, windows: Tensor, top_k: Sequence[int] | None = None, *, batch_size: int = 8,
                  dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                  stream: bool = False, progress: bool = False) -> dict:
    """`RemovalTotals.as_dict()` of `model` (a path or a loaded model: `_as_source`) on windows[N, S] of token ids:
    the model reads 0..S−2 and predicts 1..S−1."""
    if batch_size < 1:
        raise AnalysisError(f"batch_size must be >= 1, got {batch_size}")
    source, owned = _as_source(model, dtype, device, stream, progress)
    try:
        windows = check_windows(windows, getattr(source, "vocab_size", None))
        ks = check_top_k(default_top_k(source.num_layers) if top_k is None else top_k, source.num_layers)
        batches = [(w[:, :-1].contiguous(), torch.ones_like(w[:, :-1]), w[:, 1:].contiguous())
                   for w in windows.split(batch_size)]
        return removal_figures(source, batches, ks, "layer removal", progress)
    finally:
        if owned:
            source.close()
