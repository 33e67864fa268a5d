"""The fused per-token displacement of a layer's (h_in, h_out) and its two gradient kernels, in as few passes over
[T, h] as the math allows, on the backend the tensors' device calls for. Math, edge cases and backends: DEVELOPERS.md,
"The fused op"."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

NORM_EPS = 1e-8  # a hidden state whose norm is at most this counts as the zero vector
BACKENDS = ("triton", "compiled", "torch")
ENV = "MEGATRON_JREG_KERNEL"
_CHUNK_ELEMENTS = 1 << 22  # the eager path's fp32 temporaries are bounded to this many elements per chunk
COMPILE_MIN_ELEMENTS = _CHUNK_ELEMENTS  # CPU calls from this size compile (benchmarks/jreg_op.py --compile-cost)
_SIN_FLOOR = 1e-12  # sin θ below this is 0: δ and 1 − cos are exactly 0 there when b = a
_TINY = 1e-30  # keeps c² + s² (≈ 4, 0 only for two zero rows) off 0 in divisions
FIGURES = 5  # per-row figures grad_b hands to grad_a: ra, rb, ka = −k·ra (0: no gradient), 1 − cos, 1 + cos


# -- the per-row math, shared by the compiled and the eager bodies ----------------------------------------------------
def _inverse_norm(sq: Tensor) -> Tensor:
    """1/max(|x|, ε) from |x|² [T]; NaN where |x|² is not finite (an overflowing row is not a zero vector)."""
    return 1.0 / sq.sqrt().clamp_min(NORM_EPS) + sq * 0.0


def _flat(x: Tensor) -> Tensor:
    """Rows x[T, h] of x[..., h] (a view where the leading dimensions allow)."""
    return x.reshape(-1, x.shape[-1])


def _chord(a: Tensor, b: Tensor, ra: Tensor, rb: Tensor) -> Tensor:
    """δ = b̂ − â [T, h] (fp32) as (b − a)·rb + a·(rb − ra): exactly 0 where b = a. ra, rb: [T, 1]."""
    return (b - a).mul_(rb).addcmul_(a, rb - ra)


def _sum_vector(a: Tensor, b: Tensor, ra: Tensor, rb: Tensor) -> Tensor:
    """σ = â + b̂ [T, h] (fp32) as (a + b)·ra + b·(rb − ra): exactly 0 where b = −a. ra, rb: [T, 1]."""
    return (a + b).mul_(ra).addcmul_(b, rb - ra)


def _displacements(sa: Tensor, sb: Tensor, c2: Tensor, s2: Tensor) -> Tensor:
    """[3, T]: angular d = 2·atan2(c, s)/π, cosine d = 2c²/(c² + s²) (0.5 / 1 for a zero vector, NaN where a row is
    not finite), and 1.0 where a row is the zero vector."""
    zero = (sa.sqrt() <= NORM_EPS) | (sb.sqrt() <= NORM_EPS)
    poison = (sa + sb) * 0.0  # NaN where a row is not finite or overflows, so that it wins over the zero vector
    angular = torch.where(zero, 0.5, torch.atan2(c2.sqrt(), s2.sqrt()) * (2.0 / math.pi)) + poison
    cosine = torch.where(zero, 1.0, 2.0 * c2 / (c2 + s2).clamp_min(_TINY)) + poison
    return torch.stack([angular, cosine, zero.float()])


def _row_factors(sa: Tensor, sb: Tensor, ra: Tensor, rb: Tensor, c2: Tensor, s2: Tensor, g: Tensor,
                 angular: bool) -> tuple[Tensor, ...]:
    """Per row [T] (ra, rb: _inverse_norm of sa, sb): ka = −k·ra, kb = −k·rb (both 0 where the row gets no gradient:
    zero vectors beside a finite row, and rows whose upstream gradient g is 0), 1 − cos and 1 + cos."""
    zero = (sa.sqrt() <= NORM_EPS) | (sb.sqrt() <= NORM_EPS)
    off = (g == 0) | (zero & ((sa + sb) * 0.0 == 0.0))
    both = (c2 + s2).clamp_min(_TINY)
    omc, opc = 2.0 * c2 / both, 2.0 * s2 / both
    k = g / (math.pi * (2.0 * (c2 * s2).sqrt() / both).clamp_min(_SIN_FLOOR)) if angular else g
    return torch.where(off, 0.0, -k * ra), torch.where(off, 0.0, -k * rb), omc, opc


def _regime(omc: Tensor, opc: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per row [T]: the weights α, β of δ and σ in a direction and its â (or b̂) coefficient m: (1, 0, 1 − cos)
    for θ ≤ π/2, (0, 1, −(1 + cos)) beyond. b̂ − â·cos = α·δ + β·σ + â·m,  â − b̂·cos = −α·δ + β·σ + b̂·m."""
    near = omc <= opc
    return near.float(), (~near).float(), torch.where(near, omc, -opc)


# -- the compiled bodies (inductor fuses each into one C++ kernel) ----------------------------------------------------
def _row_sums(a: Tensor, b: Tensor) -> tuple[Tensor, ...]:
    """|a|², |b|², c², s² [T] (fp32) of rows a, b[..., h]; d is left to `_displacements` (a [T] epilogue in the
    same graph keeps inductor's C++ from fusing the passes)."""
    a, b = _flat(a).float(), _flat(b).float()
    sa, sb = (a * a).sum(-1), (b * b).sum(-1)
    ra, rb = _inverse_norm(sa).unsqueeze(-1), _inverse_norm(sb).unsqueeze(-1)
    delta, summ = (b - a) * rb + a * (rb - ra), (a + b) * ra + b * (rb - ra)
    return sa, sb, delta.square().sum(-1), summ.square().sum(-1)


def _grad_b_body(a: Tensor, b: Tensor, up: Tensor, factor: float, g: Tensor | None, out: Tensor,
                 angular: bool) -> Tensor:
    """out ← g + factor·Σ_t up[t]·∂d_t/∂b (out may be g); returns the figures."""
    a, b = _flat(a).float(), _flat(b).float()
    sa, sb = (a * a).sum(-1), (b * b).sum(-1)
    ra, rb = _inverse_norm(sa), _inverse_norm(sb)
    delta = (b - a) * rb.unsqueeze(-1) + a * (rb - ra).unsqueeze(-1)
    summ = (a + b) * ra.unsqueeze(-1) + b * (rb - ra).unsqueeze(-1)
    ka, kb, omc, opc = _row_factors(sa, sb, ra, rb, delta.square().sum(-1), summ.square().sum(-1),
                                    factor * up.float(), angular)
    alpha, beta, m = (x.unsqueeze(-1) for x in _regime(omc, opc))
    kb = kb.unsqueeze(-1)
    grad = torch.where(kb == 0, 0.0, kb * (beta * summ - alpha * delta + b * (rb.unsqueeze(-1) * m)))
    out.copy_((grad if g is None else _flat(g).float() + grad).view(out.shape))
    return torch.stack([ra, rb, ka, omc, opc])


def _grad_a_body(a: Tensor, b: Tensor, figures: Tensor, g: Tensor | None, out: Tensor) -> None:
    """out ← g + Σ_t up[t]·∂d_t/∂a from grad_b's figures (out may be g)."""
    a, b = _flat(a).float(), _flat(b).float()
    ra, rb, ka, omc, opc = figures.unbind(0)
    alpha, beta, m = (x.unsqueeze(-1) for x in _regime(omc, opc))
    ra, rb, ka = ra.unsqueeze(-1), rb.unsqueeze(-1), ka.unsqueeze(-1)
    delta, summ = (b - a) * rb + a * (rb - ra), (a + b) * ra + b * (rb - ra)
    grad = torch.where(ka == 0, 0.0, ka * (alpha * delta + beta * summ + a * (ra * m)))
    out.copy_((grad if g is None else _flat(g).float() + grad).view(out.shape))


# -- the eager bodies: few passes and allocations (each fresh [T, h] buffer costs page faults on CPU) -----------------
def _eager_sums(a: Tensor, b: Tensor) -> tuple[Tensor, ...]:
    """a, b, |a|², |b|², ra, rb [T, 1], δ, σ [T, h] (fp32), c², s² [T], in few passes over fp32 copies of a, b."""
    a, b = a.float(), b.float()  # torch's CPU kernels take a slow, unvectorised path on mixed bf16/fp32 operands
    sa, sb = torch.linalg.vecdot(a, a), torch.linalg.vecdot(b, b)
    ra, rb = _inverse_norm(sa).unsqueeze_(-1), _inverse_norm(sb).unsqueeze_(-1)
    delta, summ = _chord(a, b, ra, rb), _sum_vector(a, b, ra, rb)
    return a, b, sa, sb, ra, rb, delta, summ, torch.linalg.vecdot(delta, delta), torch.linalg.vecdot(summ, summ)


def _eager_grad_b(a: Tensor, b: Tensor, up: Tensor, factor: float, angular: bool) -> tuple[Tensor, Tensor]:
    """(factor·Σ_t up[t]·∂d_t/∂b [T, h] fp32, the [5, T] figures)."""
    _, b, sa, sb, ra, rb, delta, summ, c2, s2 = _eager_sums(a, b)
    ra, rb = ra.squeeze(-1), rb.squeeze(-1)
    ka, kb, omc, opc = _row_factors(sa, sb, ra, rb, c2, s2, factor * up.float(), angular)
    alpha, beta, m = (x.unsqueeze(-1) for x in _regime(omc, opc))
    kb = kb.unsqueeze(-1)
    grad = delta.mul_(-alpha).addcmul_(summ, beta).addcmul_(b, rb.unsqueeze(-1) * m).mul_(kb)
    return grad.masked_fill_(kb == 0, 0.0), torch.stack([ra, rb, ka, omc, opc])


def _eager_grad_a(a: Tensor, b: Tensor, figures: Tensor) -> Tensor:
    """Σ_t up[t]·∂d_t/∂a [T, h] fp32 from grad_b's figures."""
    a, b = a.float(), b.float()
    ra, rb, ka, omc, opc = figures.unbind(0)
    alpha, beta, m = (x.unsqueeze(-1) for x in _regime(omc, opc))
    ra, rb, ka = ra.unsqueeze(-1), rb.unsqueeze(-1), ka.unsqueeze(-1)
    grad = _chord(a, b, ra, rb).mul_(alpha).addcmul_(_sum_vector(a, b, ra, rb), beta).addcmul_(a, ra * m).mul_(ka)
    return grad.masked_fill_(ka == 0, 0.0)


def _row_chunks(rows: int, width: int) -> list[tuple[int, int]]:
    step = max(1, _CHUNK_ELEMENTS // max(width, 1))
    return [(i, min(i + step, rows)) for i in range(0, rows, step)]


def _eager_forward(a: Tensor, b: Tensor) -> Tensor:
    a, b = _flat(a), _flat(b)
    out = torch.empty(3, a.shape[0], dtype=torch.float32, device=a.device)
    for lo, hi in _row_chunks(*a.shape):
        _, _, sa, sb, _, _, _, _, c2, s2 = _eager_sums(a[lo:hi], b[lo:hi])
        out[:, lo:hi] = _displacements(sa, sb, c2, s2)
    return out


def _eager_grad(which: str, a: Tensor, b: Tensor, rows: Tensor, g: Tensor | None, out: Tensor,
                factor: float = 1.0, angular: bool = True) -> Tensor | None:
    """grad_b (`rows` = up [T]; returns the figures) or grad_a (`rows` = the figures [5, T]) over row chunks, each
    chunk's g + term written into out."""
    in_place = g is out
    a, b, out, g = _flat(a), _flat(b), _flat(out), None if g is None else _flat(g)
    figures = torch.empty(FIGURES, a.shape[0], dtype=torch.float32, device=a.device) if which == "b" else None
    for lo, hi in _row_chunks(*a.shape):
        if which == "b":
            grad, figures[:, lo:hi] = _eager_grad_b(a[lo:hi], b[lo:hi], rows[lo:hi], factor, angular)
        else:
            grad = _eager_grad_a(a[lo:hi], b[lo:hi], rows[:, lo:hi])
        if g is None:
            out[lo:hi] = grad
        elif in_place:
            out[lo:hi].add_(grad)
        else:
            out[lo:hi] = grad.add_(g[lo:hi])
    return figures


class _Compiled:
    """torch.compile'd bodies, built on first use; `failed` says why once compiling has failed. A call whose
    guards would need more graphs than Dynamo's recompile limit (a process calling with many dtypes, distances
    and gradient layouts) runs eagerly, counted in `eager_calls`, and compiling stays on for the others."""

    BODIES: dict[str, Callable] = {"row_sums": _row_sums, "displacements": _displacements, "grad_b": _grad_b_body,
                                   "grad_a": _grad_a_body}

    EAGER = object()  # what a call returns where the caller must run the eager path

    def __init__(self) -> None:
        self.fns: dict[str, Callable] = {}
        self.failed: str | None = None
        self.eager_calls = 0

    def __call__(self, name: str, *args: object) -> object:
        if self.failed is not None:
            return self.EAGER
        try:
            if name not in self.fns:  # a second number of tokens recompiles once, for any number (dynamic)
                self.fns[name] = torch.compile(self.BODIES[name], fullgraph=True)
            return self.fns[name](*args)
        except Exception as e:  # noqa: BLE001 - any compiler failure: fall back to the eager bodies
            if type(e).__name__ == "FailOnRecompileLimitHit":
                self.eager_calls += 1
                return self.EAGER
            self.failed = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
            warnings.warn(f"megatron-jreg: torch.compile of the JREG displacement kernel failed ({self.failed}); "
                          f"using the eager torch path (slower; {ENV}=torch skips the attempt)", stacklevel=2)
            return self.EAGER


_COMPILED = _Compiled()


def forced_backend() -> str | None:
    """The backend MEGATRON_JREG_KERNEL names (None: unset or auto); ValueError naming the variable otherwise."""
    forced = os.environ.get(ENV, "").strip()
    if forced in ("", "auto"):
        return None
    if forced not in BACKENDS:
        raise ValueError(f"{ENV}={forced!r}: use one of auto, {', '.join(BACKENDS)} (or leave it unset)")
    return forced


def backend_for(t: Tensor) -> str:
    """The backend a call on rows t[T, h] takes; on CPU, smaller calls than COMPILE_MIN_ELEMENTS take the eager path
    in one chunk, as fast as the compiled one there, without its compile."""
    forced = forced_backend()
    if forced is not None:
        return forced
    if t.is_cuda and t.shape[-1] <= getattr(_triton(), "MAX_WIDTH", 0):
        return "triton"
    if t.device.type == "cpu" and t.numel() >= COMPILE_MIN_ELEMENTS and _COMPILED.failed is None:
        return "compiled"
    return "torch"


def _triton() -> Any:
    """jreg_triton, imported on first use (None without triton)."""
    try:
        from megatron_jreg import jreg_triton
    except ImportError:
        return None
    return jreg_triton


def forward(a: Tensor, b: Tensor, backend: str | None = None) -> Tensor:
    """[3, T] fp32 of the rows of a, b[..., h] (same shape, any float dtype, no autograd; T = the leading
    dimensions' product): the angular d, the cosine d, and 1.0 where a row is the zero vector."""
    backend = backend or backend_for(a)
    if backend == "triton":
        return _triton().forward(a, b, NORM_EPS, _TINY)
    if backend == "compiled":
        sums = _COMPILED("row_sums", a, b)
        d = _COMPILED("displacements", *sums) if sums is not _COMPILED.EAGER else sums
        if d is not _COMPILED.EAGER:
            return d
    return _eager_forward(a, b)


def grad_b(a: Tensor, b: Tensor, up: Tensor, factor: float, angular: bool, g: Tensor | None = None,
           out: Tensor | None = None, backend: str | None = None) -> tuple[Tensor, Tensor]:
    """(out = g + factor·Σ_t up[t]·∂d_t/∂b [T, h] in b's dtype, the figures [5, T] for `grad_a`); a, b: [..., h];
    up: [T], any dtype and stride; g: b's gradient so far (or None); out: b's shape, contiguous (g to add in place)."""
    backend = backend or backend_for(a)
    out = torch.empty_like(b, memory_format=torch.contiguous_format) if out is None else out
    if backend == "triton":
        return out, _triton().grad_b(a, b, up, factor, angular, g, out, NORM_EPS, _TINY, _SIN_FLOOR)
    if backend == "compiled":
        figures = _COMPILED("grad_b", a, b, up, factor, g, out, angular)
        if figures is not _COMPILED.EAGER:
            return out, figures
    return out, _eager_grad("b", a, b, up, g, out, factor, angular)


def grad_a(a: Tensor, b: Tensor, figures: Tensor, g: Tensor | None = None, out: Tensor | None = None,
           backend: str | None = None) -> Tensor:
    """out = g + Σ_t up[t]·∂d_t/∂a [T, h] in a's dtype, from `grad_b`'s figures of the same a, b and up; g and out
    as for `grad_b`."""
    backend = backend or backend_for(a)
    out = torch.empty_like(a, memory_format=torch.contiguous_format) if out is None else out
    if backend == "triton":
        _triton().grad_a(a, b, figures, g, out)
    elif backend != "compiled" or _COMPILED("grad_a", a, b, figures, g, out) is _COMPILED.EAGER:
        _eager_grad("a", a, b, figures, g, out)
    return out
