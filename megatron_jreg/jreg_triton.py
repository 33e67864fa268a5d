"""Triton kernels of the fused displacement (`jreg_kernels`): each program holds its rows whole in registers, so each
kernel reads its operands once, writes once, in one launch. TRITON_INTERPRET=1 (set before import) runs them on CPU."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_WIDTH = 16384  # widest row held in registers (Llama-3 405B's hidden size)
_PI = tl.constexpr(math.pi)


@triton.jit
def _atan_ratio(c, s):
    """atan2(c, s) for c, s ≥ 0, in fp32 (Cephes' atanf polynomial after reducing to |y| ≤ tan(π/8))."""
    hi = tl.maximum(c, s)
    lo = tl.minimum(c, s)
    x = lo / tl.maximum(hi, 1e-30)  # c = s = 0 (two zero rows) gives 0
    big = x > 0.41421356237309503
    y = tl.where(big, (x - 1.0) / (x + 1.0), x)
    z = y * y
    p = (((8.05374449538e-2 * z - 1.38776856032e-1) * z + 1.99777106478e-1) * z - 3.33329491539e-1) * z * y + y
    r = tl.where(big, 0.7853981633974483 + p, p)
    return tl.where(c > s, 1.5707963267948966 - r, r)


@triton.jit
def _load(a_ptr, b_ptr, rows, rows_total, width, stride_a, stride_b, BLOCK_H: tl.constexpr):
    """Rows a, b [BLOCK_T, BLOCK_H] in fp32 (0 outside), the row mask and the element mask."""
    cols = tl.arange(0, BLOCK_H)
    live = rows < rows_total
    inside = live[:, None] & (cols[None, :] < width)
    r64 = rows.to(tl.int64)[:, None]
    a = tl.load(a_ptr + r64 * stride_a + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + r64 * stride_b + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    return a, b, live, inside


@triton.jit
def _vectors(a, b, ra, rb):
    """δ = b̂ − â as (b − a)·rb + a·(rb − ra) and σ = â + b̂ as (a + b)·ra + b·(rb − ra): exactly 0 where b = a
    (b = −a) whatever the compiler contracts into FMAs."""
    delta = (b - a) * rb[:, None] + a * (rb - ra)[:, None]
    summ = (a + b) * ra[:, None] + b * (rb - ra)[:, None]
    return delta, summ


@triton.jit
def _row_sums(a, b, EPS: tl.constexpr):
    """|a|², |b|², ra, rb (NaN for a row whose |x|² is not finite), δ, σ, c² = |δ|², s² = |σ|²."""
    sa = tl.sum(a * a, axis=1)
    sb = tl.sum(b * b, axis=1)
    ra = 1.0 / tl.maximum(tl.sqrt(sa), EPS) + sa * 0.0
    rb = 1.0 / tl.maximum(tl.sqrt(sb), EPS) + sb * 0.0
    delta, summ = _vectors(a, b, ra, rb)
    return sa, sb, ra, rb, delta, summ, tl.sum(delta * delta, axis=1), tl.sum(summ * summ, axis=1)


@triton.jit
def _regime(omc, opc):
    """α, β, m per row: b̂ − â·cos = α·δ + β·σ + â·m (jreg_kernels._regime)."""
    near = omc <= opc
    return near.to(tl.float32), 1.0 - near.to(tl.float32), tl.where(near, omc, -opc)


@triton.jit
def _forward_kernel(a_ptr, b_ptr, d_ptr, rows_total, width, stride_a, stride_b, EPS: tl.constexpr,
                    TINY: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    a, b, live, inside = _load(a_ptr, b_ptr, rows, rows_total, width, stride_a, stride_b, BLOCK_H)
    sa, sb, ra, rb, delta, summ, c2, s2 = _row_sums(a, b, EPS)
    zero = (tl.sqrt(sa) <= EPS) | (tl.sqrt(sb) <= EPS)
    poison = (sa + sb) * 0.0
    angular = tl.where(zero, 0.5, _atan_ratio(tl.sqrt(c2), tl.sqrt(s2)) * (2.0 / _PI)) + poison
    cosine = tl.where(zero, 1.0, 2.0 * c2 / tl.maximum(c2 + s2, TINY)) + poison
    tl.store(d_ptr + rows, angular, mask=live)
    tl.store(d_ptr + rows_total + rows, cosine, mask=live)
    tl.store(d_ptr + 2 * rows_total + rows, zero.to(tl.float32), mask=live)


@triton.jit
def _accumulate(grad, g_ptr, out_ptr, rows, cols, inside, stride_g, stride_gh, stride_out, HAS_G: tl.constexpr):
    """out = g + grad (g's row r at g_ptr + r·stride_g + c·stride_gh), in out's dtype."""
    r64 = rows.to(tl.int64)[:, None]
    if HAS_G:
        grad += tl.load(g_ptr + r64 * stride_g + cols[None, :] * stride_gh, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + r64 * stride_out + cols[None, :], grad.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _grad_b_kernel(a_ptr, b_ptr, up_ptr, g_ptr, out_ptr, fig_ptr, rows_total, width, factor, stride_a, stride_b,
                   stride_up, stride_g, stride_gh, stride_out, EPS: tl.constexpr, TINY: tl.constexpr,
                   SIN_FLOOR: tl.constexpr, ANGULAR: tl.constexpr, HAS_G: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    a, b, live, inside = _load(a_ptr, b_ptr, rows, rows_total, width, stride_a, stride_b, BLOCK_H)
    g = factor * tl.load(up_ptr + rows.to(tl.int64) * stride_up, mask=live, other=0).to(tl.float32)
    sa, sb, ra, rb, delta, summ, c2, s2 = _row_sums(a, b, EPS)
    zero = (tl.sqrt(sa) <= EPS) | (tl.sqrt(sb) <= EPS)
    off = (g == 0) | (zero & ((sa + sb) * 0.0 == 0.0))  # masked tokens, zero vectors beside a finite row: exactly 0
    both = tl.maximum(c2 + s2, TINY)
    omc = 2.0 * c2 / both  # 1 − cos: exactly 0 when δ is
    opc = 2.0 * s2 / both  # 1 + cos: exactly 0 when σ is
    k = g
    if ANGULAR:
        k = g / (_PI * tl.maximum(2.0 * tl.sqrt(c2 * s2) / both, SIN_FLOOR))
    ka = tl.where(off, 0.0, -k * ra)
    kb = tl.where(off, 0.0, -k * rb)
    alpha, beta, m = _regime(omc, opc)
    direction = beta[:, None] * summ - alpha[:, None] * delta + b * (rb * m)[:, None]  # â − b̂·cos
    grad = tl.where((kb == 0)[:, None], 0.0, kb[:, None] * direction)
    _accumulate(grad, g_ptr, out_ptr, rows, tl.arange(0, BLOCK_H), inside, stride_g, stride_gh, stride_out, HAS_G)
    tl.store(fig_ptr + rows, ra, mask=live)
    tl.store(fig_ptr + rows_total + rows, rb, mask=live)
    tl.store(fig_ptr + 2 * rows_total + rows, ka, mask=live)
    tl.store(fig_ptr + 3 * rows_total + rows, omc, mask=live)
    tl.store(fig_ptr + 4 * rows_total + rows, opc, mask=live)


@triton.jit
def _grad_a_kernel(a_ptr, b_ptr, fig_ptr, g_ptr, out_ptr, rows_total, width, stride_a, stride_b, stride_g, stride_gh,
                   stride_out, HAS_G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    a, b, live, inside = _load(a_ptr, b_ptr, rows, rows_total, width, stride_a, stride_b, BLOCK_H)
    ra = tl.load(fig_ptr + rows, mask=live, other=1.0)
    rb = tl.load(fig_ptr + rows_total + rows, mask=live, other=1.0)
    ka = tl.load(fig_ptr + 2 * rows_total + rows, mask=live, other=0.0)
    omc = tl.load(fig_ptr + 3 * rows_total + rows, mask=live, other=0.0)
    opc = tl.load(fig_ptr + 4 * rows_total + rows, mask=live, other=2.0)
    delta, summ = _vectors(a, b, ra, rb)
    alpha, beta, m = _regime(omc, opc)
    direction = alpha[:, None] * delta + beta[:, None] * summ + a * (ra * m)[:, None]  # b̂ − â·cos
    grad = tl.where((ka == 0)[:, None], 0.0, ka[:, None] * direction)
    _accumulate(grad, g_ptr, out_ptr, rows, tl.arange(0, BLOCK_H), inside, stride_g, stride_gh, stride_out, HAS_G)


def _launch(rows: int, width: int) -> tuple[tuple[int], dict]:
    """Grid and block sizes: ~4k elements of a row block per program, 4-16 warps."""
    block_h = triton.next_power_of_2(width)
    block_t = max(1, min(16, 4096 // block_h))
    warps = max(4, min(16, block_t * block_h // 512))
    return (triton.cdiv(rows, block_t),), {"BLOCK_T": block_t, "BLOCK_H": block_h, "num_warps": warps}


def _rows(x: Tensor) -> tuple[Tensor, int, int]:
    """x[..., h] as rows for a kernel: (a tensor whose rows are evenly strided, its row count, its row stride), with
    no op where x already is (a contiguous [..., h] or rows of unit inner stride): a kernel takes a pointer."""
    width = x.shape[-1]
    if x.is_contiguous():
        return x, x.numel() // max(width, 1), width
    if x.dim() == 2 and x.stride(-1) == 1:
        return x, x.shape[0], x.stride(0)
    x = x.reshape(-1, width).contiguous()
    return x, x.shape[0], width


def _source(g: Tensor | None, out: Tensor) -> tuple[Tensor, int, int]:
    """What the kernel reads as the incoming gradient (out itself, unread, where there is none) and its row and
    column strides."""
    if g is None:
        return out, 0, 0
    if g.dim() == 2:
        return g, g.stride(0), g.stride(1)
    g, _, stride = _rows(g)
    return g, stride, 1


def forward(a: Tensor, b: Tensor, eps: float, tiny: float) -> Tensor:
    """[3, T] fp32: angular d, cosine d, zero-vector flag of rows a, b[..., h]; h ≤ MAX_WIDTH."""
    (a, rows, stride_a), (b, _, stride_b) = _rows(a), _rows(b)
    out = torch.empty(3, rows, dtype=torch.float32, device=a.device)
    if rows:
        grid, meta = _launch(rows, a.shape[-1])
        _forward_kernel[grid](a, b, out, rows, a.shape[-1], stride_a, stride_b, EPS=eps, TINY=tiny, **meta)
    return out


def grad_b(a: Tensor, b: Tensor, up: Tensor, factor: float, angular: bool, g: Tensor | None, out: Tensor,
           eps: float, tiny: float, sin_floor: float) -> Tensor:
    """out ← g + factor·Σ_t up[t]·∂d_t/∂b (rows of [..., h]; out contiguous, may be g); returns the figures [5, T]."""
    (a, rows, stride_a), (b, _, stride_b) = _rows(a), _rows(b)
    source, stride_g, stride_gh = _source(g, out)
    figures = torch.empty(5, rows, dtype=torch.float32, device=a.device)
    if rows:
        grid, meta = _launch(rows, a.shape[-1])
        _grad_b_kernel[grid](a, b, up, source, out, figures, rows, a.shape[-1], factor, stride_a, stride_b,
                             up.stride(0), stride_g, stride_gh, a.shape[-1], EPS=eps, TINY=tiny,
                             SIN_FLOOR=sin_floor, ANGULAR=angular, HAS_G=g is not None, **meta)
    return figures


def grad_a(a: Tensor, b: Tensor, figures: Tensor, g: Tensor | None, out: Tensor) -> None:
    """out ← g + Σ_t up[t]·∂d_t/∂a from grad_b's figures (rows of [..., h]; out contiguous, may be g)."""
    (a, rows, stride_a), (b, _, stride_b) = _rows(a), _rows(b)
    source, stride_g, stride_gh = _source(g, out)
    if rows:
        grid, meta = _launch(rows, a.shape[-1])
        _grad_a_kernel[grid](a, b, figures, source, out, rows, a.shape[-1], stride_a, stride_b, stride_g, stride_gh,
                             a.shape[-1], HAS_G=g is not None, **meta)
