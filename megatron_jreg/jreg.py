"""The JREG math (Ψ, ζ, the layer weights w and the loss), torch only, so that training, analysis and tests share one
definition. Notation and the two ways in (autograd sums, `LayerPenalty`): DEVELOPERS.md, "JREG math"."""

from __future__ import annotations

import functools
import sys

import torch
from torch import Tensor

from megatron_jreg import jreg_kernels
from megatron_jreg.jreg_kernels import NORM_EPS as NORM_EPS  # a state whose norm is at most this is zero

DISTANCES = ("angular", "cosine")


def _check_kind(kind: str) -> None:
    if kind not in DISTANCES:
        raise ValueError(f"unknown distance {kind!r}: use one of {DISTANCES}")


class _TokenDisplacement(torch.autograd.Function):
    """Per-token displacement d[T] between rows of a[T, h] and b[T, h] (any float dtype), fused (jreg_kernels):
    the forward reads a and b once, the backward reads them once more per gradient and writes the gradients."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, angular: bool) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(a, b)
        ctx.angular = angular
        return jreg_kernels.forward(a.detach(), b.detach())[0 if angular else 1]

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor, None]:  # type: ignore[override]
        a, b = (x.detach() for x in ctx.saved_tensors)
        grad_b, figures = jreg_kernels.grad_b(a, b, grad, 1.0, ctx.angular)
        grad_a = jreg_kernels.grad_a(a, b, figures) if ctx.needs_input_grad[0] else None
        return grad_a, grad_b, None


def token_displacement(h_in: Tensor, h_out: Tensor, kind: str = "angular") -> Tensor:
    """Per-token displacement between h_in[..., h] and h_out[..., h] → fp32 [...]: `angular` arccos(cos)/π ∈ [0, 1]
    (its gradient finite at parallel vectors), `cosine` 1 − cos ∈ [0, 2]; a zero vector has cos = 0, no gradient."""
    _check_kind(kind)
    if h_in.shape != h_out.shape:
        raise ValueError(f"hidden state shapes differ: {tuple(h_in.shape)} vs {tuple(h_out.shape)}")
    lead = h_in.shape[:-1]
    width = h_in.shape[-1]
    d = _TokenDisplacement.apply(h_in.reshape(-1, width), h_out.reshape(-1, width), kind == "angular")
    return d.view(lead)


def token_figures(h_in: Tensor, h_out: Tensor) -> Tensor:
    """[3, ...] fp32 per token of h_in, h_out[..., h], without autograd: the angular d, the cosine d, and 1.0 where
    either state is the zero vector (what d reads as orthogonal)."""
    if h_in.shape != h_out.shape:
        raise ValueError(f"hidden state shapes differ: {tuple(h_in.shape)} vs {tuple(h_out.shape)}")
    with torch.no_grad():
        return jreg_kernels.forward(h_in, h_out).view(3, *h_in.shape[:-1])


def displacement_total(h_in: Tensor, h_out: Tensor, mask: Tensor | None = None, kind: str = "angular") -> Tensor:
    """Sum of per-token displacements over real tokens (fp32 scalar); h[s, b, h], mask[s, b] as below."""
    d = token_displacement(h_in, h_out, kind)
    if mask is None:
        return d.sum()
    if mask.shape != d.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match tokens {tuple(d.shape)}")
    # where, not multiply: a padded position may hold anything (even inf/NaN) and must not leak in.
    return torch.where(mask.bool(), d, 0.0).sum()


def displacement_sum(
    h_in: Tensor, h_out: Tensor, mask: Tensor | None = None, kind: str = "angular"
) -> tuple[Tensor, Tensor]:
    """(Σ displacements over real tokens, their count), fp32 on the device; mask [s, b]: True = real, None = all.
    Sums, not a mean: sharded tokens (sequence and context parallelism) are reduced as sums and counts."""
    total = displacement_total(h_in, h_out, mask, kind)
    if mask is None:
        count = torch.full((), float(h_in.shape[:-1].numel()), dtype=torch.float32, device=total.device)
    else:
        count = mask.bool().sum().to(torch.float32)
    return total, count


def displacement(h_in: Tensor, h_out: Tensor, mask: Tensor | None = None, kind: str = "angular") -> Tensor:
    """Ψ for one layer: the mean per-token displacement over real tokens (fp32 scalar)."""
    total, count = displacement_sum(h_in, h_out, mask, kind)
    return total / count.clamp_min(1.0)


@functools.cache
def _unheld_references() -> int:
    """sys.getrefcount that `_target` sees for a gradient nothing else holds (the references torch's call of a
    backward and the call of `_target` make), measured once on a probe."""
    seen: list[int] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
            return x.detach()

        @staticmethod
        def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
            _target(grad, seen)  # as the backwards below ask
            return grad

    with torch.enable_grad():
        x = torch.zeros(2, requires_grad=True)
        (Probe.apply(x * 1) * 2).sum().backward()
    return seen[0]


class LayerPenalty:
    """The term factor·Σ_t up[t]·d_t of one layer call (the plugin's λ·w_ℓ·Ψ_ℓ, scaled like the main loss), added to
    backward without computing anything in forward and without a [T, h] tensor of its own (DEVELOPERS.md, "JREG
    math"): `h_in = penalty.watch(h_in)` before the layer runs, `h_out = penalty.attach(h_out, h_in, up, factor)`
    after it; up: [T] per token of the flattened leading dimensions (the token mask times the microbatch's scale).
    Each backward adds in place where autograd handed it the gradient alone (`_target`), else writes a fresh tensor
    (Megatron-LM's full recompute keeps each chunk's output gradient): one pass either way, never a separate add."""

    def __init__(self, kind: str = "angular") -> None:
        _check_kind(kind)
        _unheld_references()  # measured here, outside any backward
        self.angular = kind == "angular"
        self.watching = False  # h_in's gradient passes through `watch`'s identity
        self.handoff: tuple[Tensor, Tensor, Tensor] | None = None  # (h_in, h_out, figures), h_out's backward → h_in's

    def watch(self, h_in: Tensor) -> Tensor:
        """h_in unchanged (an alias), through an identity whose backward adds ∂/∂h_in; h_in itself if it needs none."""
        if not (torch.is_grad_enabled() and h_in.requires_grad):
            return h_in
        self.watching = True
        return _WatchInput.apply(h_in, self)

    def attach(self, h_out: Tensor, h_in: Tensor, up: Tensor, factor: float) -> Tensor:
        """h_out unchanged (an alias), through an identity whose backward adds ∂/∂h_out and readies ∂/∂h_in for
        `watch`'s identity. An h_in that was not watched (the layer has run on it already) gets ∂/∂h_in as a fresh
        tensor that autograd adds to its gradient (one more pass and tensor: the way in without a pre-hook)."""
        if h_in.shape != h_out.shape:
            raise ValueError(f"hidden state shapes differ: {tuple(h_in.shape)} vs {tuple(h_out.shape)}")
        return _AttachOutput.apply(h_out, h_in, up, factor, self)


def _target(grad: Tensor, calibrating: list[int] | None = None) -> Tensor:
    """Where a backward writes grad + its term (asked before any view of grad exists): grad itself when nothing else
    holds it, so that adding into it changes no other value: no other reference to the tensor (C++: `_use_count`;
    Python: a hook that kept it) or to its storage (a view), and dense rows, the test autograd makes before it
    accumulates in place; else a fresh tensor of its shape (not a view, so that the next backward may own it)."""
    references = sys.getrefcount(grad)
    if calibrating is not None:
        calibrating.append(references)
    elif (grad._use_count() == 1 and references <= _unheld_references() and grad.is_contiguous()
          and not grad._is_view() and torch._C._storage_Use_Count(grad.untyped_storage()._cdata) == 2):  # + ours
        return grad
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


class _AttachOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_out: Tensor, h_in: Tensor, up: Tensor, factor: float,  # type: ignore[override]
                penalty: LayerPenalty) -> Tensor:
        ctx.save_for_backward(h_in, h_out, up)
        ctx.factor, ctx.penalty = factor, penalty
        return h_out.detach()  # an alias, not a view: what megatron-core's pipeline sends must not be a view

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor | None, None, None, None]:  # type: ignore[override]
        h_in, h_out, up = ctx.saved_tensors
        penalty, out = ctx.penalty, _target(grad)
        _, figures = jreg_kernels.grad_b(h_in, h_out, up, ctx.factor, penalty.angular, grad, out=out)
        grad_in = None
        if penalty.watching:
            penalty.handoff = (h_in, h_out, figures)
        elif ctx.needs_input_grad[1]:
            grad_in = jreg_kernels.grad_a(h_in, h_out, figures)
        return out, grad_in, None, None, None


class _WatchInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_in: Tensor, penalty: LayerPenalty) -> Tensor:  # type: ignore[override]
        ctx.penalty = penalty
        return h_in.detach()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        penalty = ctx.penalty
        handoff, penalty.handoff = penalty.handoff, None
        if handoff is None:  # h_out got no gradient: the term is not in this backward
            return grad, None
        h_in, h_out, figures = handoff
        out = _target(grad)
        return jreg_kernels.grad_a(h_in, h_out, figures, grad, out=out), None


def layer_weights(num_layers: int, alpha: float, layers: list[int] | None = None) -> Tensor:
    """w[L] = softmax(α·ℓ) over the penalized layers ℓ (1-based; default all), zero elsewhere."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    chosen = list(range(1, num_layers + 1)) if layers is None else sorted(set(layers))
    if not chosen or chosen[0] < 1 or chosen[-1] > num_layers:
        raise ValueError(f"penalized layers must lie in 1..{num_layers}, got {layers}")
    idx = torch.tensor(chosen, dtype=torch.float64)
    w = torch.zeros(num_layers, dtype=torch.float64)
    w[idx.long() - 1] = torch.softmax(alpha * idx, dim=0)
    return w.float()


def jump_rates(psi: Tensor) -> Tensor:
    """ζ_ℓ = 100 · Σ_{k=ℓ..L} max(0, Ψ_k − Ψ_{k−1}) for ℓ = 2..L (index 0 is ζ_2): the total rise of Ψ to the top."""
    psi = psi.double()
    if psi.numel() < 2:
        raise ValueError("jump rates need at least 2 layers")
    rises = torch.clamp(psi[1:] - psi[:-1], min=0.0)
    return (100.0 * rises.flip(0).cumsum(0).flip(0)).float()


def final_jumps(psi: Tensor) -> dict[str, float]:
    """The paper's three reported figures {zeta_L, zeta_L-1, zeta_L-2} (NaN where L is too small)."""
    zeta = jump_rates(psi).tolist()
    names = ("zeta_L", "zeta_L-1", "zeta_L-2")
    return {name: (zeta[-1 - i] if i < len(zeta) else float("nan")) for i, name in enumerate(names)}


def jreg_loss(psi: Tensor, weights: Tensor) -> Tensor:
    """L_cos = Σ_ℓ w_ℓ Ψ_ℓ (fp32 scalar); the training loss adds λ · L_cos to the cross-entropy."""
    return (weights.to(device=psi.device, dtype=torch.float32) * psi.float()).sum()
