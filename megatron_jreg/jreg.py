"""The JREG math: displacement Ψ, jump rates ζ, layer weights w and the JREG loss.

Torch only (no megatron imports), so the training plugin, the analysis of open-weight models and the
tests share one definition.

Notation (layers ℓ = 1..L; h_0 = embeddings, h_L = last layer output *before* the final norm):

    cos_ℓ(t) = <h_{ℓ-1}(t), h_ℓ(t)> / (|h_{ℓ-1}(t)| |h_ℓ(t)|)          per token t
    Ψ_ℓ      = mean over real tokens of  arccos(cos_ℓ(t)) / π            ("angular", in [0, 1])
                                     or  1 - cos_ℓ(t)                    ("cosine",  in [0, 2])
    ζ_ℓ      = 100 · Σ_{k=ℓ..L} max(0, Ψ_k - Ψ_{k-1})                    for ℓ ≥ 2
    w_ℓ      = softmax_ℓ(α · ℓ)                                          over the penalized layers
    L_cos    = Σ_ℓ w_ℓ Ψ_ℓ ;   loss = L_CE + λ · L_cos

Everything is computed in fp32 whatever the activation dtype, by one fused kernel per direction
(`jreg_kernels`: Triton on CUDA, torch.compile'd C++ on CPU, eager torch elsewhere; benchmarks/jreg_op.py).
The per-token displacement is a custom autograd function that saves references to the two hidden states plus
four fp32 figures per token, and reads the states once more in backward. Where the layers keep those states
anyway (norms that save their input: Transformer Engine's, apex's, torch's in fp32) that adds no activation
memory; a torch norm that saves an fp32 upcast of a bf16 input leaves JREG's references as the only holders
of the bf16 states. At PP > 1 the output of a stage's last layer, which Megatron-LM frees once it is sent,
stays until JREG's backward has read it: measured per microbatch by tests/test_jreg_hot_path.py (PP = 2).

A hidden state that is not finite gives a NaN displacement (never 0.5), so Ψ and ζ of a broken step are NaN.
"""

from __future__ import annotations

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
    the forward reads a and b once, the backward reads them once more and writes the two gradients."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, angular: bool) -> Tensor:  # type: ignore[override]
        d, *rows = jreg_kernels.forward(a.detach(), b.detach(), angular)
        ctx.save_for_backward(a, b, *rows)
        ctx.angular = angular
        return d

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        a, b, *rows = ctx.saved_tensors
        grad_a, grad_b = jreg_kernels.backward(a.detach(), b.detach(), grad, tuple(rows), ctx.angular)
        return grad_a, grad_b, None


def token_displacement(h_in: Tensor, h_out: Tensor, kind: str = "angular") -> Tensor:
    """Per-token displacement between h_in[..., h] and h_out[..., h] → fp32 tensor of shape [...].

    `angular` is arccos(cos)/π ∈ [0, 1] with a gradient that stays finite when the two vectors are
    parallel; `cosine` is the smooth 1 − cos ∈ [0, 2]. A zero vector has cos = 0 and no gradient; a
    token whose state is not finite gives NaN.
    """
    _check_kind(kind)
    if h_in.shape != h_out.shape:
        raise ValueError(f"hidden state shapes differ: {tuple(h_in.shape)} vs {tuple(h_out.shape)}")
    lead = h_in.shape[:-1]
    width = h_in.shape[-1]
    d = _TokenDisplacement.apply(h_in.reshape(-1, width), h_out.reshape(-1, width), kind == "angular")
    return d.view(lead)


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
    """Sum of per-token displacements over real tokens and the number of real tokens (both fp32).

    h_in, h_out: [s, b, h] (megatron's layout; any leading shape works); mask: [s, b] (True/1 = real
    token) or None for all tokens. Sums rather than means because sharded tokens (sequence and
    context parallelism) are reduced as sums and counts. Both stay on the device (no host sync).
    """
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


def layer_weights(num_layers: int, alpha: float, layers: list[int] | None = None) -> Tensor:
    """w[L] = softmax(α·ℓ) over the penalized layers ℓ (1-based; default all), zero elsewhere.

    α = 0 is uniform, α ≈ 0.1 near-linear, large α puts the weight on the last layers.
    """
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
    """ζ for ℓ = 2..L from psi[L] → tensor [L-1] (index 0 is ζ_2, index -1 is ζ_L).

    ζ_ℓ = 100 · Σ_{k=ℓ..L} max(0, Ψ_k − Ψ_{k−1}): the total rise of Ψ from layer ℓ−1 to the top.
    """
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
