"""The fused per-token displacement: d[T] between the rows of a[T, h] and b[T, h], and its two gradients, in as
few passes over [T, h] as the math allows (forward: read a and b; backward: read them again and write the two
gradients; the upstream gradient and the per-row figures are [T]).

The math, fp32 whatever the input dtype, per row t (ε = NORM_EPS: a row shorter than ε is the zero vector):

    ra = 1/max(|a|, ε),  rb = 1/max(|b|, ε),  â = a·ra,  b̂ = b·rb
    c² = |â − b̂|²,  s² = |â + b̂|²             (elementwise sums: exact near θ = 0 and near θ = π)
    angular  d = 2·atan2(c, s)/π ∈ [0, 1]      cosine  d = 1 − cos = 2c²/(c² + s²) ∈ [0, 2]
    zero vector: d = 0.5 (angular) / 1 (cosine) with no gradient; a non-finite row: d = NaN

The forward also returns the per-row (|a|², |b|², c², s²) [T] (16 bytes a token), so the backward needs no
reduction, only one elementwise pass:

    cos = (s² − c²)/(s² + c²),  sin = 2cs/(s² + c²)
    ∂d/∂a = −k·ra·(b̂ − â·cos),  ∂d/∂b = −k·rb·(â − b̂·cos),  k = 1 (cosine) or 1/(π·sin) (angular)

|b̂ − â·cos| = sin, so the angular gradient is bounded by 1/(π|a|), and 0 when a ∥ b (sin = 0, b̂ = â). A
row whose upstream gradient is 0 (a masked token) gets exactly 0, even if its state is not finite.

Three ways to run it, chosen per call from the tensors' device (`backend_for`), or forced with
MEGATRON_JREG_KERNEL=triton|compiled|torch:
- "triton" (CUDA, h ≤ jreg_triton.MAX_WIDTH): `jreg_triton`'s two kernels, each row whole in registers:
  2 launches per layer call.
- "compiled" (CPU, from COMPILE_MIN_ELEMENTS elements): the torch bodies below compiled by torch.compile
  (inductor's C++/OpenMP), which fuses each row's passes into one loop over the rows. The first call in a
  process compiles (or loads inductor's on-disk cache); if compiling fails (no C++ compiler, say) it warns
  once and uses "torch" from then on.
- "torch": the same per-row math with its [T, h] passes written for eager torch (`_eager_row_sums`,
  `_eager_backward`), in row chunks that bound the fp32 temporaries. It
  compiles nothing: below COMPILE_MIN_ELEMENTS (tests, the demo, the study's small models) a process would
  spend longer compiling than the compiled calls save.
Figures (ops per call, time against a plain copy of the bytes, compile cost): benchmarks/jreg_op.py,
docs/results/jreg_op.txt.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

NORM_EPS = 1e-8  # a hidden state whose norm is at most this counts as the zero vector
BACKENDS = ("triton", "compiled", "torch")
ENV = "MEGATRON_JREG_KERNEL"
_CHUNK_ELEMENTS = 1 << 22  # the eager path's fp32 temporaries are bounded to this many elements per chunk
COMPILE_MIN_ELEMENTS = _CHUNK_ELEMENTS  # CPU calls from this size compile (benchmarks/jreg_op.py --compile-cost)
_SIN_FLOOR = 1e-12  # sin θ below this is 0: b̂ = ±â there and the direction b̂ − â·cos is exactly 0
_TINY = 1e-30  # keeps c² + s² (≈ 4, 0 only for two zero rows) off 0 in divisions


def _inverse_norm(sq: Tensor) -> Tensor:
    """1/max(|x|, ε) from |x|² [T]: one expression for every path, so that the backward rebuilds â and b̂ bit for
    bit as the forward had them (their difference, not their rounding, must set the gradient's direction)."""
    return 1.0 / sq.sqrt().clamp_min(NORM_EPS)


def _row_sums(a: Tensor, b: Tensor) -> tuple[Tensor, ...]:
    """|a|², |b|², c², s² [T] (fp32) of rows a, b[T, h], written for inductor (the compiled path).

    Inductor fuses each row's two passes (squares, then â ± b̂) into one loop over the rows when the norms are
    recomputed from the sums where used, and when d is left to `_displacement` (a [T] epilogue in the same
    graph keeps its C++ from fusing the passes)."""
    a, b = a.float(), b.float()
    sa, sb = (a * a).sum(-1), (b * b).sum(-1)
    ua = a * _inverse_norm(sa).unsqueeze(-1)
    ub = b * _inverse_norm(sb).unsqueeze(-1)
    return sa, sb, (ua - ub).square().sum(-1), (ua + ub).square().sum(-1)


def _eager_row_sums(a: Tensor, b: Tensor) -> tuple[Tensor, ...]:
    """`_row_sums` in few eager passes and allocations (each fresh [T, h] buffer costs page faults on CPU): over
    fp32 copies (torch's CPU kernels take a slow, unvectorised path on mixed bf16/fp32 operands), scaled in place
    when the copies are ours, â + b̂ built in place of â."""
    owned = a.dtype != torch.float32  # a.float() made copies we may overwrite
    a, b = a.float(), b.float()
    sa, sb = torch.linalg.vecdot(a, a), torch.linalg.vecdot(b, b)
    ra, rb = _inverse_norm(sa).unsqueeze_(-1), _inverse_norm(sb).unsqueeze_(-1)
    ua, ub = (a.mul_(ra), b.mul_(rb)) if owned else (a * ra, b * rb)
    diff = ua - ub
    summ = ua.add_(ub)
    return sa, sb, torch.linalg.vecdot(diff, diff), torch.linalg.vecdot(summ, summ)


def _displacement(sa: Tensor, sb: Tensor, c2: Tensor, s2: Tensor, angular: bool) -> Tensor:
    """d [T] from the row sums: 2·atan2(c, s)/π or 2c²/(c² + s²); 0.5 / 1 for a zero vector."""
    zero = (sa.sqrt() <= NORM_EPS) | (sb.sqrt() <= NORM_EPS)
    if angular:
        return torch.where(zero, 0.5, torch.atan2(c2.sqrt(), s2.sqrt()) * (2.0 / math.pi))
    return torch.where(zero, 1.0, 2.0 * c2 / (c2 + s2).clamp_min(_TINY))


def _row_factors(grad: Tensor, sa: Tensor, sb: Tensor, c2: Tensor, s2: Tensor, angular: bool) -> tuple[Tensor, ...]:
    """Per row [T, 1]: 1/|a|, 1/|b|, the gradients' factors −k/|a|, −k/|b|, cos θ, and `off` (no gradient)."""
    na, nb = sa.sqrt(), sb.sqrt()
    k = grad.float()
    # zero vectors and tokens without upstream gradient (masked) get exactly 0, whatever their state holds
    off = (na <= NORM_EPS) | (nb <= NORM_EPS) | (k == 0)
    both = (s2 + c2).clamp_min(_TINY)  # ≈ 4; 0 only when both rows are zero
    cos = (s2 - c2) / both
    if angular:
        k = k / (math.pi * (2.0 * (c2 * s2).sqrt() / both).clamp_min(_SIN_FLOOR))  # 1/(π·sin θ)
    ra, rb = _inverse_norm(sa), _inverse_norm(sb)
    return tuple(x.unsqueeze(-1) for x in (ra, rb, -k * ra, -k * rb, cos, off))


def _backward_body(a: Tensor, b: Tensor, grad: Tensor, sa: Tensor, sb: Tensor, c2: Tensor, s2: Tensor,
                   angular: bool) -> tuple[Tensor, Tensor]:
    """∂/∂a, ∂/∂b [T, h] (dtypes of a, b) of Σ_t grad[t]·d[t] (the compiled path: one fused pass)."""
    ra, rb, ka, kb, cos, off = _row_factors(grad, sa, sb, c2, s2, angular)
    ua, ub = a.float() * ra, b.float() * rb
    grad_a = torch.where(off, 0.0, ka * (ub - ua * cos))
    grad_b = torch.where(off, 0.0, kb * (ua - ub * cos))
    return grad_a.to(a.dtype), grad_b.to(b.dtype)


def _eager_backward(a: Tensor, b: Tensor, grad: Tensor, sa: Tensor, sb: Tensor, c2: Tensor, s2: Tensor,
                    angular: bool) -> tuple[Tensor, Tensor]:
    """`_backward_body` in few eager passes, â and b̂ scaled in place where the fp32 copies are ours and ∂/∂b
    built in place of â."""
    ra, rb, ka, kb, cos, off = _row_factors(grad, sa, sb, c2, s2, angular)
    owned = a.dtype != torch.float32
    a32, b32 = a.float(), b.float()
    ua, ub = (a32.mul_(ra), b32.mul_(rb)) if owned else (a32 * ra, b32 * rb)
    grad_a = torch.addcmul(ub, ua, cos, value=-1.0).mul_(ka).masked_fill_(off, 0.0)  # ka·(b̂ − â·cos)
    grad_b = ua.addcmul_(ub, cos, value=-1.0).mul_(kb).masked_fill_(off, 0.0)  # kb·(â − b̂·cos)
    return grad_a.to(a.dtype), grad_b.to(b.dtype)


def _chunked_forward(a: Tensor, b: Tensor, angular: bool) -> tuple[Tensor, ...]:
    chunks = _row_chunks(*a.shape)
    if len(chunks) == 1:
        sums = _eager_row_sums(a, b)
        return _displacement(*sums, angular), *sums
    outs = [torch.empty(a.shape[0], dtype=torch.float32, device=a.device) for _ in range(5)]
    for lo, hi in chunks:
        sums = _eager_row_sums(a[lo:hi], b[lo:hi])
        for out, part in zip(outs, (_displacement(*sums, angular), *sums)):
            out[lo:hi] = part
    return tuple(outs)


def _chunked_backward(a: Tensor, b: Tensor, grad: Tensor, sa: Tensor, sb: Tensor, c2: Tensor, s2: Tensor,
                      angular: bool) -> tuple[Tensor, Tensor]:
    chunks = _row_chunks(*a.shape)
    if len(chunks) == 1:
        return _eager_backward(a, b, grad, sa, sb, c2, s2, angular)
    grad_a, grad_b = torch.empty_like(a), torch.empty_like(b)
    for lo, hi in chunks:
        rows = slice(lo, hi)
        grad_a[rows], grad_b[rows] = _eager_backward(a[rows], b[rows], grad[rows], sa[rows], sb[rows], c2[rows],
                                                     s2[rows], angular)
    return grad_a, grad_b


def _row_chunks(rows: int, width: int) -> list[tuple[int, int]]:
    step = max(1, _CHUNK_ELEMENTS // max(width, 1))
    return [(i, min(i + step, rows)) for i in range(0, rows, step)]


class _Compiled:
    """torch.compile'd bodies, built on first use; `failed` says why once compiling has failed. A call whose
    guards would need more graphs than Dynamo's recompile limit (a process calling with many dtypes, distances
    and gradient layouts) runs eagerly, counted in `eager_calls`, and compiling stays on for the others."""

    BODIES: dict[str, Callable] = {"row_sums": _row_sums, "displacement": _displacement, "backward": _backward_body}

    def __init__(self) -> None:
        self.fns: dict[str, Callable] = {}
        self.failed: str | None = None
        self.eager_calls = 0

    def __call__(self, name: str, *args: object) -> Tensor | tuple[Tensor, ...] | None:
        if self.failed is not None:
            return None
        try:
            if name not in self.fns:  # a second number of tokens recompiles once, for any number (dynamic)
                self.fns[name] = torch.compile(self.BODIES[name], fullgraph=True)
            return self.fns[name](*args)
        except Exception as e:  # noqa: BLE001 - any compiler failure: fall back to the eager bodies
            if type(e).__name__ == "FailOnRecompileLimitHit":
                self.eager_calls += 1
                return None
            self.failed = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
            warnings.warn(f"megatron-jreg: torch.compile of the JREG displacement kernel failed ({self.failed}); "
                          f"using the eager torch path (slower; {ENV}=torch skips the attempt)", stacklevel=2)
            return None


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
    """The backend a call on rows t[T, h] takes: MEGATRON_JREG_KERNEL if set, else triton on CUDA, compiled on CPU
    from COMPILE_MIN_ELEMENTS elements (smaller calls take the eager path in one chunk, as fast as the compiled
    one there, without its compile), torch elsewhere or once compiling has failed."""
    forced = forced_backend()
    if forced is not None:
        return forced
    if t.is_cuda and t.shape[-1] <= _triton_max_width():
        return "triton"
    if t.device.type == "cpu" and t.numel() >= COMPILE_MIN_ELEMENTS and _COMPILED.failed is None:
        return "compiled"
    return "torch"


def _triton_max_width() -> int:
    try:
        from megatron_jreg import jreg_triton
    except ImportError:  # no triton: the eager path
        return 0
    return jreg_triton.MAX_WIDTH


def forward(a: Tensor, b: Tensor, angular: bool, backend: str | None = None) -> tuple[Tensor, ...]:
    """d, |a|², |b|², c², s² [T] (fp32) of the rows of a, b[T, h] (same shape, any float dtype, no autograd)."""
    backend = backend or backend_for(a)
    if backend == "triton":
        from megatron_jreg import jreg_triton

        return jreg_triton.forward(a, b, angular, NORM_EPS, _TINY)
    if backend == "compiled":
        sums = _COMPILED("row_sums", a, b)
        d = _COMPILED("displacement", *sums, angular) if sums is not None else None
        if d is not None:
            return d, *sums
    return _chunked_forward(a, b, angular)


def backward(a: Tensor, b: Tensor, grad: Tensor, rows: tuple[Tensor, ...], angular: bool,
             backend: str | None = None) -> tuple[Tensor, Tensor]:
    """∂/∂a, ∂/∂b of Σ_t grad[t]·d[t], from a, b[T, h], grad[T] and the forward's rows = (|a|², |b|², c², s²)."""
    backend = backend or backend_for(a)
    if backend == "triton":
        from megatron_jreg import jreg_triton

        return jreg_triton.backward(a, b, grad, *rows, angular, NORM_EPS, _TINY, _SIN_FLOOR)
    if backend == "compiled":
        out = _COMPILED("backward", a, b, grad, *rows, angular)
        if out is not None:
            return out
    return _chunked_backward(a, b, grad, *rows, angular)
