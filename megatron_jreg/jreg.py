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

Everything is computed in fp32 whatever the activation dtype. The per-token displacement is a custom
autograd function: it saves only references to the two hidden states plus per-token scalars, and
recomputes the rest in backward. Where the layers keep those hidden states anyway (norms that save their
input: Transformer Engine's, apex's) it adds no activation memory; a torch norm that saves an fp32 upcast
of a bf16 input instead leaves JREG's references as the only holders of the bf16 states (measured: +3 %
saved bytes on the tiny bf16 CPU model; benchmarks/jreg_overhead.py reports it).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

DISTANCES = ("angular", "cosine")
NORM_EPS = 1e-8  # a hidden state whose norm is below this counts as the zero vector
_CHUNK_ELEMENTS = 1 << 22  # fp32 temporaries are bounded to this many elements per chunk


def _check_kind(kind: str) -> None:
    if kind not in DISTANCES:
        raise ValueError(f"unknown distance {kind!r}: use one of {DISTANCES}")


def _row_chunks(rows: int, width: int) -> list[tuple[int, int]]:
    step = max(1, _CHUNK_ELEMENTS // max(width, 1))
    return [(i, min(i + step, rows)) for i in range(0, rows, step)]


def _unit(x: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 unit vectors and norms of the rows of x[T, h]; zero rows stay zero."""
    x = x.float()
    norm = torch.linalg.vector_norm(x, dim=-1)
    return x / norm.clamp_min(NORM_EPS).unsqueeze(-1), norm


class _TokenDisplacement(torch.autograd.Function):
    """Per-token displacement d[T] between rows of a[T, h] and b[T, h] (any float dtype).

    Written for few passes over [T, h] (this runs for every layer of every microbatch): the angle comes
    from the chord |â − b̂| (exact near 0, where arccos(cos) loses digits), and backward reuses its
    buffers in place.
    """

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, angular: bool) -> Tensor:  # type: ignore[override]
        rows, width = a.shape
        out = torch.empty(rows, dtype=torch.float32, device=a.device)
        for lo, hi in _row_chunks(rows, width):
            ua, na = _unit(a[lo:hi])
            ub, nb = _unit(b[lo:hi])
            if angular:
                chord = torch.linalg.vector_norm(ua.sub_(ub), dim=-1)  # |â − b̂|
                # angle = 2·atan2(|â − b̂|, |â + b̂|), and |â + b̂|² = 4 − |â − b̂|² for unit vectors.
                angle = 2.0 * torch.atan2(chord, (4.0 - chord.square()).clamp_min(0.0).sqrt())
                live = (na > NORM_EPS) & (nb > NORM_EPS)
                out[lo:hi] = torch.where(live, angle / math.pi, 0.5)  # a zero vector counts as orthogonal
            else:
                out[lo:hi] = 1.0 - torch.linalg.vecdot(ua, ub)
        ctx.save_for_backward(a, b)
        ctx.angular = angular
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        a, b = ctx.saved_tensors
        grad_a = torch.empty_like(a)
        grad_b = torch.empty_like(b)
        for lo, hi in _row_chunks(*a.shape):
            ua, na = _unit(a[lo:hi])
            ub, nb = _unit(b[lo:hi])
            cos = torch.linalg.vecdot(ua, ub).unsqueeze(-1)
            # Components of b̂ orthogonal to â and of â orthogonal to b̂; |perp| = sin(angle).
            perp_a = torch.addcmul(ub, ua, cos, value=-1.0)
            perp_b = ua.addcmul_(ub, cos, value=-1.0)
            # d(1 − cos)/da = −perp_a/|a|; d angle/da = −perp_a/(|a| sin): bounded by 1/|a|, 0 when a ∥ b.
            g = grad[lo:hi].float() * ((na > NORM_EPS) & (nb > NORM_EPS))  # zero vectors: no gradient
            coef_a = -g / na.clamp_min(NORM_EPS)
            coef_b = -g / nb.clamp_min(NORM_EPS)
            if ctx.angular:
                coef_a = coef_a / (math.pi * torch.linalg.vector_norm(perp_a, dim=-1).clamp_min(1e-12))
                coef_b = coef_b / (math.pi * torch.linalg.vector_norm(perp_b, dim=-1).clamp_min(1e-12))
            grad_a[lo:hi] = perp_a.mul_(coef_a.unsqueeze(-1))
            grad_b[lo:hi] = perp_b.mul_(coef_b.unsqueeze(-1))
        return grad_a, grad_b, None


def token_displacement(h_in: Tensor, h_out: Tensor, kind: str = "angular") -> Tensor:
    """Per-token displacement between h_in[..., h] and h_out[..., h] → fp32 tensor of shape [...].

    `angular` is arccos(cos)/π ∈ [0, 1] with a gradient that stays finite when the two vectors are
    parallel; `cosine` is the smooth 1 − cos ∈ [0, 2]. A zero vector has cos = 0 and no gradient.
    """
    _check_kind(kind)
    if h_in.shape != h_out.shape:
        raise ValueError(f"hidden state shapes differ: {tuple(h_in.shape)} vs {tuple(h_out.shape)}")
    lead = h_in.shape[:-1]
    width = h_in.shape[-1]
    d = _TokenDisplacement.apply(h_in.reshape(-1, width), h_out.reshape(-1, width), kind == "angular")
    return d.view(lead)


def displacement_sum(
    h_in: Tensor, h_out: Tensor, mask: Tensor | None = None, kind: str = "angular"
) -> tuple[Tensor, Tensor]:
    """Sum of per-token displacements over real tokens and the number of real tokens (both fp32).

    h_in, h_out: [s, b, h] (megatron's layout; any leading shape works); mask: [s, b] (True/1 = real
    token) or None for all tokens. Sums rather than means because sharded tokens (sequence and
    context parallelism) are reduced as sums and counts.
    """
    d = token_displacement(h_in, h_out, kind)
    if mask is None:
        return d.sum(), torch.tensor(float(d.numel()), device=d.device)
    if mask.shape != d.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match tokens {tuple(d.shape)}")
    real = mask.bool()
    # where, not multiply: a padded position may hold anything (even inf/NaN) and must not leak in.
    return torch.where(real, d, 0.0).sum(), real.sum().to(torch.float32)


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
