"""Triton kernels of the fused per-token displacement (CUDA; with TRITON_INTERPRET=1 set before this module is
imported they run on CPU tensors, which is how the tests check them).

The math and its notation are `jreg_kernels`' docstring. Each program holds BLOCK_T rows whole in registers
(BLOCK_H = the next power of two ≥ h, at most MAX_WIDTH), so the forward reads a and b once and writes five
[T] figures, and the backward reads a, b and the [T] figures once and writes the two gradients once:
2 launches per layer call. Wider rows take jreg_kernels' eager path.
"""

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
def _forward_kernel(a_ptr, b_ptr, d_ptr, sa_ptr, sb_ptr, c2_ptr, s2_ptr, rows_total, width, stride_a, stride_b,
                    EPS: tl.constexpr, TINY: tl.constexpr, ANGULAR: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_H)
    live_rows = rows < rows_total
    inside = live_rows[:, None] & (cols[None, :] < width)
    r64 = rows.to(tl.int64)[:, None]
    a = tl.load(a_ptr + r64 * stride_a + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + r64 * stride_b + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    sa = tl.sum(a * a, axis=1)
    sb = tl.sum(b * b, axis=1)
    na = tl.sqrt(sa)
    nb = tl.sqrt(sb)
    ua = a * (1.0 / tl.maximum(na, EPS))[:, None]
    ub = b * (1.0 / tl.maximum(nb, EPS))[:, None]
    diff = ua - ub
    summ = ua + ub
    c2 = tl.sum(diff * diff, axis=1)
    s2 = tl.sum(summ * summ, axis=1)
    zero = (na <= EPS) | (nb <= EPS)
    if ANGULAR:
        d = tl.where(zero, 0.5, _atan_ratio(tl.sqrt(c2), tl.sqrt(s2)) * (2.0 / _PI))
    else:
        d = tl.where(zero, 1.0, 2.0 * c2 / tl.maximum(c2 + s2, TINY))
    tl.store(d_ptr + rows, d, mask=live_rows)
    tl.store(sa_ptr + rows, sa, mask=live_rows)
    tl.store(sb_ptr + rows, sb, mask=live_rows)
    tl.store(c2_ptr + rows, c2, mask=live_rows)
    tl.store(s2_ptr + rows, s2, mask=live_rows)


@triton.jit
def _backward_kernel(a_ptr, b_ptr, g_ptr, sa_ptr, sb_ptr, c2_ptr, s2_ptr, ga_ptr, gb_ptr, rows_total, width,
                     stride_a, stride_b, stride_g, stride_ga, stride_gb,
                     EPS: tl.constexpr, TINY: tl.constexpr, SIN_FLOOR: tl.constexpr, ANGULAR: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_H)
    live_rows = rows < rows_total
    inside = live_rows[:, None] & (cols[None, :] < width)
    r64 = rows.to(tl.int64)[:, None]
    g = tl.load(g_ptr + rows.to(tl.int64) * stride_g, mask=live_rows, other=0.0).to(tl.float32)
    na = tl.sqrt(tl.load(sa_ptr + rows, mask=live_rows, other=1.0))
    nb = tl.sqrt(tl.load(sb_ptr + rows, mask=live_rows, other=1.0))
    c2 = tl.load(c2_ptr + rows, mask=live_rows, other=0.0)
    s2 = tl.load(s2_ptr + rows, mask=live_rows, other=4.0)
    off = (na <= EPS) | (nb <= EPS) | (g == 0)  # zero vectors, masked tokens: exactly 0
    both = tl.maximum(s2 + c2, TINY)
    cos = (s2 - c2) / both
    k = g
    if ANGULAR:
        k = k / (_PI * tl.maximum(2.0 * tl.sqrt(c2 * s2) / both, SIN_FLOOR))
    ra = 1.0 / tl.maximum(na, EPS)
    rb = 1.0 / tl.maximum(nb, EPS)
    ka = -k * ra
    kb = -k * rb
    ua = tl.load(a_ptr + r64 * stride_a + cols[None, :], mask=inside, other=0.0).to(tl.float32) * ra[:, None]
    ub = tl.load(b_ptr + r64 * stride_b + cols[None, :], mask=inside, other=0.0).to(tl.float32) * rb[:, None]
    ga = tl.where(off[:, None], 0.0, ka[:, None] * (ub - ua * cos[:, None]))
    gb = tl.where(off[:, None], 0.0, kb[:, None] * (ua - ub * cos[:, None]))
    tl.store(ga_ptr + r64 * stride_ga + cols[None, :], ga.to(ga_ptr.dtype.element_ty), mask=inside)
    tl.store(gb_ptr + r64 * stride_gb + cols[None, :], gb.to(gb_ptr.dtype.element_ty), mask=inside)


def _launch(rows: int, width: int) -> tuple[tuple[int], dict]:
    """Grid and block sizes: ~4k elements of a row block per program, 4-16 warps."""
    block_h = triton.next_power_of_2(width)
    block_t = max(1, min(16, 4096 // block_h))
    warps = max(4, min(16, block_t * block_h // 512))
    return (triton.cdiv(rows, block_t),), {"BLOCK_T": block_t, "BLOCK_H": block_h, "num_warps": warps}


def _rows_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def forward(a: Tensor, b: Tensor, angular: bool, eps: float, tiny: float) -> tuple[Tensor, ...]:
    """d, |a|², |b|², c², s² [T] (fp32) of rows a, b[T, h]; h ≤ MAX_WIDTH; rows with norm ≤ eps are zero vectors."""
    a, b = _rows_contiguous(a), _rows_contiguous(b)
    rows, width = a.shape
    outs = [torch.empty(rows, dtype=torch.float32, device=a.device) for _ in range(5)]
    if rows:
        grid, meta = _launch(rows, width)
        _forward_kernel[grid](a, b, *outs, rows, width, a.stride(0), b.stride(0), EPS=eps, TINY=tiny,
                                 ANGULAR=angular, **meta)
    return tuple(outs)


def backward(a: Tensor, b: Tensor, grad: Tensor, sa: Tensor, sb: Tensor, c2: Tensor, s2: Tensor, angular: bool,
             eps: float, tiny: float, sin_floor: float) -> tuple[Tensor, Tensor]:
    """∂/∂a, ∂/∂b [T, h] (dtypes of a, b) of Σ_t grad[t]·d[t]; grad[T] may be an expanded view (stride 0)."""
    a, b = _rows_contiguous(a), _rows_contiguous(b)
    rows, width = a.shape
    grad_a, grad_b = torch.empty_like(a), torch.empty_like(b)
    if rows:
        grid, meta = _launch(rows, width)
        _backward_kernel[grid](a, b, grad, sa, sb, c2, s2, grad_a, grad_b, rows, width, a.stride(0), b.stride(0),
                               grad.stride(0), grad_a.stride(0), grad_b.stride(0), EPS=eps, TINY=tiny,
                               SIN_FLOOR=sin_floor, ANGULAR=angular, **meta)
    return grad_a, grad_b
