"""Hidden-state sources: the protocol every framework's model implements for the analysis, and the layer hooks they
share."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from megatron_jreg import jreg
from megatron_jreg.errors import JregError, ModelFileError

# The convention labels that end up in results.json and in the plot legends.
LAYER_IO = "decoder layer input/output (hooks)"
FINAL_NORM = "output_hidden_states (final norm applied to the last layer's output)"


class AnalysisError(JregError, ValueError):
    """A problem the user can fix (a flag, a path, a model we cannot read); the CLI prints it."""


class UnsupportedArchitectureError(AnalysisError):
    """The decoder layers of a model could not be found."""


@contextlib.contextmanager
def refused_as_analysis(prefix: str = "") -> Iterator[None]:
    """A model-file refusal as an AnalysisError, its message kept: what a --checkpoints series skips in one line."""
    try:
        yield
    except ModelFileError as e:
        raise AnalysisError(f"{prefix}{e}") from None


class HiddenStateSource(Protocol):
    """A model the analysis can measure (`HFSource`, `MegatronSource`, `StreamingSource`)."""

    label: str
    num_layers: int
    context_length: int | None  # None: no truncation
    pad_id: int
    convention: str
    model_class: str
    streamed: bool = False

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text as the model normally sees it (special tokens included), untruncated."""
        ...

    def layer_sums(self, input_ids: Tensor, attention_mask: Tensor, kind: str) -> tuple[Tensor, Tensor]:
        """(sums[L], counts[L]) float64 on the CPU for input_ids/attention_mask[b, t]: Σ d(h_{ℓ−1}, h_ℓ) over the
        real tokens, and their count."""
        stats = self.layer_stats(input_ids, attention_mask, kind)
        return stats["sums"], stats["counts"]

    def layer_stats(self, input_ids: Tensor, attention_mask: Tensor, kind: str, select: Tensor | None = None
                    ) -> dict[str, Tensor]:
        """`layer_sums` and `state_totals` of one batch over the tokens of select[b, t] (default: the real ones), as
        `batch_stats` returns them."""
        ...

    def close(self) -> None:
        """Release the model (the CLI measures several models one after the other)."""
        ...

    # A source that measures all batches one layer at a time (`StreamingSource`) has `stream_stats` instead:
    # `measure` then hands it every batch at once, so only one layer's weights are in memory.


def real_rows(mask: Tensor | None) -> Tensor | None:
    """Flat indices [n] of the real tokens of mask[...] (True/1 = real), or None when all are real."""
    if mask is None or bool(mask.all()):
        return None
    return mask.reshape(-1).nonzero().squeeze(1)


def last_token_mask(mask: Tensor) -> Tensor:
    """mask[b, t] (1 = real) → bool [b, t] true at each row's last real token (`--positions last`)."""
    real = mask.bool()
    return real & real.long().cumsum(1).eq(real.long().sum(1, keepdim=True))


def masked_displacement_sum(h_in: Tensor, h_out: Tensor, rows: Tensor | None, kind: str) -> tuple[Tensor, Tensor]:
    """(Σ d, count) over rows of h_in/h_out[..., h]; real rows are gathered (not masked), so a NaN at padding cannot
    poison the sum, while a non-finite real token makes it NaN without a host sync."""
    h_in, h_out = gather_rows(h_in, rows), gather_rows(h_out, rows)
    total, count = jreg.displacement_sum(h_in, h_out, None, kind)
    finite = torch.isfinite(h_in).all() & torch.isfinite(h_out).all()
    return torch.where(finite, total, torch.full_like(total, float("nan"))), count


def first_tensor(value: Any) -> Tensor | None:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], Tensor):
        return value[0]
    return None


def layer_input(module: nn.Module, args: tuple, kwargs: dict) -> Tensor:
    """A decoder layer's input hidden states: its first positional argument or its `hidden_states=` keyword."""
    h = args[0] if args and isinstance(args[0], Tensor) else kwargs.get("hidden_states")
    if not isinstance(h, Tensor):
        raise UnsupportedArchitectureError(f"{type(module).__name__} (a decoder layer) was called without its hidden "
                                           "states as first argument or `hidden_states=` keyword; cannot capture "
                                           "its input")
    return h


def with_hidden(output: Any, hidden: Tensor) -> Any:
    """`output` (a layer's hidden states, or a tuple starting with them) with `hidden` in their place."""
    if isinstance(output, Tensor):
        return hidden
    return type(output)((hidden, *output[1:]))


@contextlib.contextmanager
def planned_layers(layers: Sequence[nn.Module], answer: Any, answering: int, skipped: Sequence[int] = ()
                   ) -> Iterator[None]:
    """Within the block: layers[:answering] return `answer` without computing (a recorded output of layer
    `answering`, so the next layer receives it), layers[i] for i in `skipped` return their input in the
    structure of `answer`, the rest compute. Instance `forward`s are set and removed; hooks stay."""
    touched = [*layers[:answering], *(layers[i] for i in skipped)]
    try:
        for layer in layers[:answering]:
            layer.forward = lambda *args, **kwargs: answer
        for i in skipped:
            layers[i].forward = lambda *a, layer=layers[i], **kw: with_hidden(answer, layer_input(layer, a, kw))
        yield
    finally:
        for layer in touched:
            if "forward" in vars(layer):
                del layer.forward


class LayerDisplacementHooks:
    """Forward hooks around one pass: sums/counts float64 [L] (filled on exit) and states [h_0..h_L] at the selected
    tokens. kind=None: states only; `last`: a module whose output replaces h_L. In-place changes to h_in are detected
    (version counter) and refused."""

    def __init__(self, layers: Sequence[nn.Module], mask: Tensor | None, kind: str | None,
                 clone_inputs: bool = False, last: nn.Module | None = None):
        self.layers = list(layers)
        self.mask = mask
        self.rows = real_rows(mask)
        self.kind = kind
        self.clone_inputs = clone_inputs
        self.last = last
        self.states: list[Tensor | None] = [None] * (len(self.layers) + 1)
        self._partial: list[list[tuple[Tensor, Tensor]]] = [[] for _ in self.layers]
        self._inputs: dict[int, tuple[Tensor, int]] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _keep(self, index: int, h: Tensor | None) -> None:
        if h is not None:
            self.states[index] = gather_rows(h, self.rows)

    def _pre_hook(self, index: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        h_in = layer_input(module, args, kwargs)
        if index == 0:
            self._keep(0, h_in)
        if self.kind is None:
            return
        if self.mask is not None and tuple(self.mask.shape) != tuple(h_in.shape[:-1]):
            raise ValueError(f"mask shape {tuple(self.mask.shape)} does not match the hidden states "
                             f"{tuple(h_in.shape)} of {type(module).__name__}")
        if self.clone_inputs:
            h_in = h_in.clone()
        self._inputs[index] = (h_in, h_in._version)

    def _post_hook(self, index: int, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        h_out = first_tensor(output)
        self._keep(index + 1, h_out)
        if self.kind is None:
            return
        h_in, version = self._inputs.pop(index)
        if h_out is None or h_out.shape != h_in.shape:
            raise UnsupportedArchitectureError(
                f"{type(module).__name__} (decoder layer {index + 1}) returned {type(output).__name__}, "
                f"not hidden states of shape {tuple(h_in.shape)}"
            )
        if h_in._version != version:
            raise RuntimeError(f"{type(module).__name__} modified its input hidden states in place, so h_in is "
                               "lost; measure with LayerDisplacementHooks(..., clone_inputs=True)")
        # Kept on the model's device until exit: one host sync per batch, not one per layer.
        self._partial[index].append(masked_displacement_sum(h_in, h_out, self.rows, self.kind))

    def __enter__(self) -> LayerDisplacementHooks:
        for i, layer in enumerate(self.layers):
            self._handles += [layer.register_forward_pre_hook(functools.partial(self._pre_hook, i), with_kwargs=True),
                              layer.register_forward_hook(functools.partial(self._post_hook, i), with_kwargs=True)]
        if self.last is not None:  # runs after layer L: its output replaces h_L
            self._handles.append(self.last.register_forward_hook(lambda m, a, out: self._keep(-1, first_tensor(out))))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._inputs.clear()
        if exc[0] is not None:
            return
        missing = [i for i, s in enumerate(self.states) if s is None]
        if missing:
            raise UnsupportedArchitectureError(f"hidden states h_ℓ for ℓ in {missing} were not seen in the forward "
                                               "pass")
        if self.kind is None:
            return
        calls = [len(p) for p in self._partial]
        if any(c != 1 for c in calls):
            raise RuntimeError(f"each decoder layer should run once per forward pass; calls per layer: {calls}")
        pairs = torch.stack([torch.stack(p[0]) for p in self._partial]).double().cpu()  # [L, 2]
        self.sums, self.counts = pairs[:, 0].clone(), pairs[:, 1].clone()


def state_totals(states: Sequence[Tensor], kind: str) -> dict[str, Tensor]:
    """norm_sums[L+1], zero_tokens[L+1], distance_sums[L+1, L+1] (Σ d(h_i, h_j), i < j) of states [h_0..h_L]
    (each [n, h]), float64 on their device: the residual norms and Gromov et al.'s distances, per batch."""
    size = len(states)
    norms = torch.stack([torch.linalg.vector_norm(h.float(), dim=-1) for h in states])  # [L+1, n]
    distance = torch.zeros(size, size, dtype=torch.float64, device=norms.device)
    for i in range(size - 1):
        later = torch.stack(list(states[i + 1 :]))  # [L - i, n, h]
        d = jreg.token_displacement(states[i].unsqueeze(0).expand_as(later), later, kind)
        distance[i, i + 1 :] = d.double().sum(-1)
    return {"norm_sums": norms.double().sum(-1), "zero_tokens": (norms <= jreg.NORM_EPS).double().sum(-1),
            "distance_sums": distance}


def gather_rows(h: Tensor, rows: Tensor | None) -> Tensor:
    """h[..., w] → [n, w]: the rows `real_rows` selected (all when None)."""
    flat = h.reshape(-1, h.shape[-1])
    return flat if rows is None else flat.index_select(0, rows.to(h.device))


def batch_stats(sums: Tensor, counts: Tensor, states: Sequence[Tensor], kind: str) -> dict[str, Tensor]:
    """What `HiddenStateSource.layer_stats` returns: {"sums", "counts"} (Ψ totals, [L]) and `state_totals`,
    float64 on the CPU, brought over in one transfer."""
    totals, size = state_totals(states, kind), len(states)
    on = totals["norm_sums"].device
    flat = torch.cat([sums.double().to(on), counts.double().to(on), totals["norm_sums"], totals["zero_tokens"],
                      totals["distance_sums"].reshape(-1)]).cpu()
    sums, counts, norms, zeros, distances = flat.split([size - 1, size - 1, size, size, size * size])
    return {"sums": sums, "counts": counts, "norm_sums": norms, "zero_tokens": zeros,
            "distance_sums": distances.reshape(size, size)}
