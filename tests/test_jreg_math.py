"""The JREG math against plain formulas written directly from the definitions, float64.

The per-token displacement runs on one of jreg_kernels' backends: the tests taking the `kernel` fixture run on
each — the eager torch path, the Triton kernels through TRITON_INTERPRET=1 (on CPU tensors) and the
torch.compile'd C++ (slow: it compiles).
"""

from __future__ import annotations

import importlib.util
import math
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch

# jreg.DISTANCES, written out so that collecting this file does not import torch (test_distances_are_all_tested).
DISTANCES = ("angular", "cosine")
KERNELS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                                                     reason="triton is not installed")),
           pytest.param("compiled", marks=pytest.mark.slow)]


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch):
    """Forces jreg_kernels' backend for the test. "triton" runs the kernels in Triton's interpreter, which must be
    on before triton is first imported: it runs where TRITON_INTERPRET=1 was set at the start (the subprocess of
    test_jreg_kernels.py's test_triton_kernels_in_the_interpreter)."""
    import os

    from megatron_jreg import jreg_kernels

    if request.param == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter: run with TRITON_INTERPRET=1 (test_triton_kernels_in_the_interpreter does)")
    monkeypatch.setenv(jreg_kernels.ENV, request.param)
    if request.param != "compiled":
        yield request.param
        return
    import torch

    torch._dynamo.reset()  # this test's graphs only: far from Dynamo's recompile limit
    eager = jreg_kernels._COMPILED.eager_calls
    yield request.param
    assert jreg_kernels._COMPILED.failed is None and jreg_kernels._COMPILED.eager_calls == eager, "ran eagerly"


def test_distances_are_all_tested():
    from megatron_jreg import jreg

    assert jreg.DISTANCES == DISTANCES


def reference_displacement(a: torch.Tensor, b: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token Ψ in float64 straight from the definition."""
    import torch

    a, b = a.double(), b.double()
    cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    return torch.arccos(cos.clamp(-1, 1)) / math.pi if kind == "angular" else 1 - cos


@pytest.mark.parametrize("kind", DISTANCES)
def test_displacement_values_and_gradients_match_reference(kind, kernel):
    import torch

    from megatron_jreg import jreg

    torch.manual_seed(0)
    a = torch.randn(7, 3, 32, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, 3, 32, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(7, 3, dtype=torch.float64)
    ours = jreg.token_displacement(a, b, kind)
    assert ours.dtype == torch.float32 and ours.shape == (7, 3)
    (ours.double() * weights).sum().backward()
    ga, gb = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    ref = reference_displacement(a, b, kind)
    (ref * weights).sum().backward()
    torch.testing.assert_close(ours.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ga, a.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gb, b.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", DISTANCES)
def test_identical_and_parallel_vectors_give_zero_and_finite_gradient(kind, kernel):
    import torch

    from megatron_jreg import jreg

    a = torch.randn(5, 16, requires_grad=True)
    for b in (a.detach().clone(), 3.0 * a.detach()):
        b.requires_grad_(True)
        d = jreg.token_displacement(a, b, kind)
        assert d.abs().max() < 1e-6
        d.sum().backward()
        assert torch.isfinite(a.grad).all() and torch.isfinite(b.grad).all()
        # The angle's gradient is bounded by 1/|a| and 1 - cos has zero gradient at 0.
        assert (a.grad.norm(dim=-1) <= 1.0 / a.detach().norm(dim=-1) + 1e-4).all()
        a.grad = None


def test_antiparallel_vectors_angular_is_one_with_finite_gradient(kernel):
    import torch

    from megatron_jreg import jreg

    a = torch.randn(4, 8, requires_grad=True)
    b = (-2.0 * a.detach()).requires_grad_(True)
    d = jreg.token_displacement(a, b, "angular")
    # |â + b̂| is summed elementwise like |â − b̂|: exact at π as at 0.
    torch.testing.assert_close(d, torch.ones(4), atol=1e-6, rtol=0)
    d.sum().backward()
    assert torch.isfinite(a.grad).all()
    assert (a.grad.norm(dim=-1) <= 1.0 / a.detach().norm(dim=-1) + 1e-4).all()


@pytest.mark.parametrize("kind", DISTANCES)
def test_near_zero_and_near_pi_angles_are_accurate(kind, kernel):
    """Small and near-antiparallel angles, where arccos(cos) and 1 − cos lose their digits, to the fp64 truth."""
    import torch

    from megatron_jreg import jreg

    torch.manual_seed(5)
    a = torch.randn(6, 64, dtype=torch.float64)
    u = torch.randn(6, 64, dtype=torch.float64)
    u -= (u * a).sum(-1, keepdim=True) / (a * a).sum(-1, keepdim=True) * a  # ⟂ a
    u *= a.norm(dim=-1, keepdim=True) / u.norm(dim=-1, keepdim=True)
    theta = torch.tensor([1e-3, 3e-3, 1e-2, math.pi - 1e-2, math.pi - 3e-3, 1.0], dtype=torch.float64)
    b = torch.cos(theta)[:, None] * a + torch.sin(theta)[:, None] * u
    d = jreg.token_displacement(a.float(), b.float(), kind).double()
    truth = theta / math.pi if kind == "angular" else 1 - torch.cos(theta)
    # fp32 inputs: the rounding of the inputs themselves moves the angle by ~1e-7
    torch.testing.assert_close(d, truth, rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize("kind,value", [("angular", 0.5), ("cosine", 1.0)])
def test_zero_vectors_are_orthogonal_with_zero_gradient(kind, value, kernel):
    import torch

    from megatron_jreg import jreg

    z = torch.zeros(3, 8, requires_grad=True)
    b = torch.randn(3, 8, requires_grad=True)
    b.data[2] = 0.0  # both rows zero
    d = jreg.token_displacement(z, b, kind)
    torch.testing.assert_close(d, torch.full((3,), value))
    d.sum().backward()
    assert torch.equal(z.grad, torch.zeros_like(z)) and torch.equal(b.grad, torch.zeros_like(b))


@pytest.mark.parametrize("kind", DISTANCES)
def test_bf16_inputs_computed_in_fp32_with_bf16_gradients(kind, kernel):
    import torch

    from megatron_jreg import jreg

    torch.manual_seed(1)
    a = torch.randn(16, 2, 64).bfloat16().requires_grad_(True)
    b = torch.randn(16, 2, 64).bfloat16().requires_grad_(True)
    weights = torch.rand(16, 2)
    d = jreg.token_displacement(a, b, kind)
    assert d.dtype == torch.float32
    (d * weights).sum().backward()
    # fp64 truth of the same (bf16-exact) inputs: the values to fp32 precision, the gradients to bf16's rounding
    a64 = a.detach().double().requires_grad_(True)
    b64 = b.detach().double().requires_grad_(True)
    ref = reference_displacement(a64, b64, kind)
    (ref * weights.double()).sum().backward()
    torch.testing.assert_close(d.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    assert a.grad.dtype == torch.bfloat16 and b.grad.dtype == torch.bfloat16
    torch.testing.assert_close(a.grad.double(), a64.grad, rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(b.grad.double(), b64.grad, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("kind", DISTANCES)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # Triton's interpreter: inf · 0
def test_non_finite_states_give_nan_and_masked_ones_nothing(kind, kernel):
    """A real token whose state is inf/NaN has a NaN displacement (not the zero vector's 0.5); behind the mask
    it changes neither the sum nor any gradient."""
    import torch

    from megatron_jreg import jreg

    torch.manual_seed(3)
    a, b = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    a[1, 0, 3] = float("inf")
    b[2, 1] = float("nan")
    d = jreg.token_displacement(a, b, kind)
    broken = torch.zeros(5, 2, dtype=torch.bool)
    broken[1, 0] = broken[2, 1] = True
    assert d[broken].isnan().all() and d[~broken].isfinite().all()
    assert jreg.displacement(a, b, kind=kind).isnan()
    clean_a, clean_b = a.clone(), b.clone()
    clean_a[broken], clean_b[broken] = 1.0, 1.0
    for x, y in ((a, b), (clean_a, clean_b)):
        x.requires_grad_(True)
        y.requires_grad_(True)
        jreg.displacement_total(x, y, ~broken, kind).backward()
    torch.testing.assert_close(a.grad, clean_a.grad)
    torch.testing.assert_close(b.grad, clean_b.grad)
    assert torch.equal(a.grad[broken], torch.zeros_like(a.grad[broken]))


def test_upstream_gradient_may_be_expanded_or_strided(kernel):
    """sum's backward hands an expanded [T] gradient; a where's a dense one: both give the same gradients."""
    import torch

    from megatron_jreg import jreg

    torch.manual_seed(4)
    a = torch.randn(7, 24, requires_grad=True)
    b = torch.randn(7, 24, requires_grad=True)
    jreg.token_displacement(a, b).sum().backward()
    ga, gb = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    torch.autograd.backward(jreg.token_displacement(a, b), torch.ones(14)[::2])
    torch.testing.assert_close(a.grad, ga)
    torch.testing.assert_close(b.grad, gb)


def test_mask_averages_over_real_tokens_only():
    import torch

    from megatron_jreg import jreg

    torch.manual_seed(2)
    a, b = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    mask = torch.ones(6, 2, dtype=torch.bool)
    mask[4:, 1] = False  # padding at the end of sequence 1
    per_token = reference_displacement(a, b, "angular")
    expected = per_token[mask].mean()
    torch.testing.assert_close(jreg.displacement(a, b, mask).double(), expected, rtol=1e-5, atol=1e-6)
    # Changing padded positions changes nothing.
    a2 = a.clone()
    a2[4:, 1] = 100.0
    torch.testing.assert_close(jreg.displacement(a2, b, mask), jreg.displacement(a, b, mask))
    total, count = jreg.displacement_sum(a, b, mask)
    assert count.item() == 10
    torch.testing.assert_close(total, jreg.displacement_total(a, b, mask))
    assert jreg.displacement_sum(a, b)[1].item() == 12 and jreg.displacement_sum(a, b)[1].dtype == torch.float32


def test_layer_weights_are_softmax_of_alpha_times_layer():
    import torch

    from megatron_jreg import jreg

    w = jreg.layer_weights(5, 1.0)
    expected = torch.softmax(torch.arange(1, 6, dtype=torch.float64), 0)
    torch.testing.assert_close(w.double(), expected)
    torch.testing.assert_close(jreg.layer_weights(4, 0.0), torch.full((4,), 0.25))
    sub = jreg.layer_weights(6, 0.5, layers=[5, 6])
    assert sub[:4].abs().sum() == 0
    torch.testing.assert_close(sub[4:].double(), torch.softmax(torch.tensor([2.5, 3.0], dtype=torch.float64), 0))
    with pytest.raises(ValueError, match="1..4"):
        jreg.layer_weights(4, 1.0, layers=[0])


def test_jump_rates_follow_the_definition():
    import torch

    from megatron_jreg import jreg

    psi = torch.tensor([0.10, 0.30, 0.20, 0.25, 0.60])
    zeta = jreg.jump_rates(psi)
    L = len(psi)
    for ell in range(2, L + 1):
        expected = 100 * sum(max(0.0, psi[k - 1].item() - psi[k - 2].item()) for k in range(ell, L + 1))
        assert zeta[ell - 2].item() == pytest.approx(expected, rel=1e-6)
    jumps = jreg.final_jumps(psi)
    assert jumps["zeta_L"] == pytest.approx(35.0, rel=1e-5)
    assert jumps["zeta_L-1"] == pytest.approx(40.0, rel=1e-5)
    assert jumps["zeta_L-2"] == pytest.approx(40.0, rel=1e-5)


def test_jreg_loss_is_weighted_sum():
    import torch

    from megatron_jreg import jreg

    psi = torch.tensor([0.1, 0.2, 0.4])
    w = jreg.layer_weights(3, 1.0)
    assert jreg.jreg_loss(psi, w).item() == pytest.approx(float((w * psi).sum()))


def _record_where_kernels_write(monkeypatch) -> list:
    """A list that gets, per jreg_kernels.grad_b / grad_a call, whether it writes into the incoming gradient g
    (None: it has none)."""
    from megatron_jreg import jreg_kernels

    wrote: list = []

    def spy(original, g_at):
        def call(*args, **kwargs):
            g = args[g_at] if len(args) > g_at else None
            wrote.append(None if g is None else kwargs["out"].data_ptr() == g.data_ptr())
            return original(*args, **kwargs)

        return call

    for name, g_at in (("grad_b", 5), ("grad_a", 3)):
        monkeypatch.setattr(jreg_kernels, name, spy(getattr(jreg_kernels, name), g_at))
    return wrote


def _penalty_graph(x, y, g_in, g_out, up, factor, kind, watched=True, keep=None):
    """h_in = x·1 and h_out = h_in + y (neither a leaf), `LayerPenalty` between them as the plugin's hooks place it,
    and a loss that sends g_in into h_in and g_out into h_out: backward, then (x.grad, y.grad)."""
    from megatron_jreg import jreg

    x, y = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
    penalty = jreg.LayerPenalty(kind)
    h_in = x * 1
    if watched:
        h_in = penalty.watch(h_in)
    h_out = penalty.attach(h_in + y, h_in, up, factor)
    if keep is not None:  # someone else holds h_out's incoming gradient: JREG must not write into it
        h_out.register_hook(keep.append)
    ((h_in * g_in).sum() + (h_out * g_out).sum()).backward()
    return x.grad, y.grad


@pytest.mark.parametrize("kind", DISTANCES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["watched", "unwatched", "shared"])
def test_layer_penalty_adds_the_term_into_the_gradients_h_in_and_h_out_receive(kind, dtype, case, kernel,
                                                                               monkeypatch):
    """The training path: h_in, h_out not leaves, gradients g_in, g_out coming from the rest of the graph. The leaf
    gradients equal float64 autograd of ⟨h_in, g_in⟩ + ⟨h_out, g_out⟩ + factor·Σ_t up[t]·d_t on the same values
    (padding: up = 0). Watched (the plugin's hooks), both of JREG's gradients are written into the incoming ones in
    place; without the pre-hook (`unwatched`), ∂/∂h_in comes as a tensor autograd adds; where someone else holds
    the incoming gradient (`shared`), JREG leaves it as it was and writes a fresh one."""
    import torch


    torch.manual_seed(6)
    dt = getattr(torch, dtype)
    x, y = torch.randn(6, 3, 32).to(dt), (0.4 * torch.randn(6, 3, 32)).to(dt)
    g_in, g_out = torch.randn(6, 3, 32).to(dt), torch.randn(6, 3, 32).to(dt)
    up = torch.rand(18)
    up[::4] = 0.0  # padding
    factor = 20.0
    in_place = _record_where_kernels_write(monkeypatch)
    keep = [] if case == "shared" else None
    grad_x, grad_y = _penalty_graph(x, y, g_in, g_out, up, factor, kind, watched=case != "unwatched", keep=keep)
    x64, y64 = x.double().requires_grad_(True), y.double().requires_grad_(True)
    h_in = x64 * 1
    h_out = h_in + y64
    d = reference_displacement(h_in, h_out, kind).reshape(-1)
    ((h_in * g_in.double()).sum() + (h_out * g_out.double()).sum() + factor * (up.double() * d).sum()).backward()
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == "bfloat16" else {"rtol": 1e-5, "atol": 1e-5}
    assert grad_x.dtype == dt and grad_y.dtype == dt
    torch.testing.assert_close(grad_y.double(), y64.grad, **tol)
    torch.testing.assert_close(grad_x.double(), x64.grad, **tol)
    assert (grad_y.double() - g_out.double()).abs().max() > 0.2  # the term is really there
    expected = {"watched": [True, True], "unwatched": [True, None], "shared": [False, True]}[case]
    assert in_place == expected
    if keep is not None:
        assert torch.equal(keep[0], g_out)


@pytest.mark.parametrize("kind", DISTANCES)
def test_layer_penalty_computes_nothing_in_forward(kind):
    """Between forward and backward the term costs two aliases (`detach`): no op reads the hidden states until
    backward, whatever the backend (Ψ's value is computed only where it is logged: `token_figures`)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_jreg import jreg

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    x = torch.randn(8, 2, 16, requires_grad=True)
    h_in = x * 1
    up = torch.ones(16)
    penalty = jreg.LayerPenalty(kind)
    with Ops() as ops:
        watched = penalty.watch(h_in)
        layer_out = watched * 2  # the stand-in layer
        out = penalty.attach(layer_out, watched, up, 0.5)
    assert ops.names == ["detach", "mul", "detach"], ops.names
    # aliases, not views (megatron-core's pipeline frees what it sent, which must not be a view)
    assert watched.data_ptr() == h_in.data_ptr() and out.data_ptr() == layer_out.data_ptr()
    assert watched._base is None and out._base is None and out.grad_fn is not None


@pytest.mark.parametrize("kind", DISTANCES)
def test_overflow_and_nan_beside_a_zero_vector_are_not_finite(kind, kernel):
    """A row whose |x|² overflows fp32 (|x| ≳ 1.8e19: finite values) and a NaN row beside a zero row give d = NaN
    and a NaN gradient, never the zero vector's 0.5 (or 0 for an angle); behind the mask they give exactly 0."""
    import torch

    from megatron_jreg import jreg

    torch.manual_seed(8)
    a, b = torch.randn(4, 16), torch.randn(4, 16)
    a[0] *= 1e20  # |a|² = inf in fp32
    a[1], b[1] = 0.0, float("nan")  # a NaN row beside a zero row
    b[2] = 0.0  # a zero row beside a finite one: 0.5 / 1, flagged, no gradient
    figures = jreg.token_figures(a, b)
    assert torch.isnan(figures[:2, :2]).all() and torch.isfinite(figures[:2, 2:]).all()
    assert figures[:, 2].tolist() == [0.5, 1.0, 1.0] and figures[2].tolist() == [0.0, 1.0, 1.0, 0.0]
    a.requires_grad_(True)
    b.requires_grad_(True)
    d = jreg.token_displacement(a, b, kind)
    assert torch.isnan(d[:2]).all() and d[2] == (0.5 if kind == "angular" else 1.0)
    d.sum().backward()
    assert torch.isnan(a.grad[0]).all() and torch.isnan(b.grad[1]).all()
    assert torch.equal(a.grad[2], torch.zeros(16)) and torch.isfinite(a.grad[3]).all()
    a.grad = b.grad = None
    mask = torch.tensor([False, False, True, True])
    jreg.displacement_total(a, b, mask, kind).backward()
    assert torch.equal(a.grad[:3], torch.zeros(3, 16)) and torch.equal(b.grad[:3], torch.zeros(3, 16))


@pytest.mark.parametrize("kind", DISTANCES)
def test_identical_and_opposite_states_give_exactly_zero_gradient(kind, kernel):
    """h_out = h_in (an identity layer) and h_out = −h_in: the gradient is exactly 0, not rounding noise scaled by
    1/sin θ (the Triton kernels under an approximate division: test_triton_exact_zero_with_approximate_division)."""
    import torch

    from megatron_jreg import jreg

    torch.manual_seed(9)
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(9, 48).to(dtype)
        for b in (a.clone(), -a):  # (a scaled copy: bounded by 1/(π|a|), test_identical_and_parallel_vectors_...)
            if kind == "cosine" and not torch.equal(b, a):
                continue  # 1 − cos has a finite, nonzero gradient at θ = π
            x, y = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
            jreg.token_displacement(x, y, kind).sum().backward()
            assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(y.grad, torch.zeros_like(y))


@pytest.mark.parametrize("theta", [1e-3, 1e-5])
def test_fp32_gradient_at_tiny_angles_is_within_the_documented_bound(theta, kernel):
    """jreg_kernels' docstring: the fp32 gradient's direction at angle θ is off by about 1e-7/θ relative (â and b̂
    carry their rounding). Measured against float64 on the same fp32 values, h = 512."""
    import torch

    from megatron_jreg import jreg

    torch.manual_seed(5)
    a = torch.randn(16, 512, dtype=torch.float64)
    u = torch.randn(16, 512, dtype=torch.float64)
    u -= (u * a).sum(-1, keepdim=True) / (a * a).sum(-1, keepdim=True) * a
    u *= a.norm(dim=-1, keepdim=True) / u.norm(dim=-1, keepdim=True)
    x = a.float().requires_grad_(True)
    y = (math.cos(theta) * a + math.sin(theta) * u).float().requires_grad_(True)
    jreg.token_displacement(x, y).sum().backward()
    x64, y64 = x.detach().double().requires_grad_(True), y.detach().double().requires_grad_(True)
    xh, yh = x64 / x64.norm(dim=-1, keepdim=True), y64 / y64.norm(dim=-1, keepdim=True)
    (2 * torch.atan2((xh - yh).norm(dim=-1), (xh + yh).norm(dim=-1)) / math.pi).sum().backward()
    for ours, ref in ((x.grad, x64.grad), (y.grad, y64.grad)):
        error = ((ours.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
        assert error <= 2e-7 / theta, (theta, error)


def _interpreting_triton():
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter: run with TRITON_INTERPRET=1 (test_triton_kernels_in_the_interpreter does)")


def test_triton_exact_zero_with_approximate_division(monkeypatch):
    """On NVIDIA GPUs Triton's fp32 division is approximate (div.full.f32): emulated here by moving every division's
    nonzero result one ulp up (the interpreter divides exactly otherwise). h_out = h_in and h_out = −h_in still give
    exactly 0 gradient (written as the identity-layer case needs, not rounding noise times 1/sin θ); generic rows
    keep float64 accuracy; and the emulation is live (the displacements move)."""
    _interpreting_triton()
    import numpy as np
    import torch
    from triton.runtime import interpreter

    from megatron_jreg import jreg, jreg_kernels

    monkeypatch.setenv(jreg_kernels.ENV, "triton")
    torch.manual_seed(10)
    a = torch.randn(12, 40)
    generic = torch.randn(12, 40)
    exact = jreg.token_figures(a, generic)

    def off_by_an_ulp(x, y):
        r = np.divide(x, y)
        return np.where(r == 0, r, np.nextafter(r, np.asarray(np.inf, dtype=r.dtype)))

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fdiv",
                        lambda self, lhs, rhs: self.binary_op(lhs, rhs, off_by_an_ulp))
    assert not torch.equal(jreg.token_figures(a, generic)[:2], exact[:2])  # the emulation is live
    for kind in DISTANCES:
        for b in ((a.clone(), -a) if kind == "angular" else (a.clone(),)):
            for dtype in (torch.float32, torch.bfloat16):
                x, y = (v.to(dtype).clone().requires_grad_(True) for v in (a, b))
                jreg.token_displacement(x, y, kind).sum().backward()
                assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(y.grad, torch.zeros_like(y))
        x, y = a.double().requires_grad_(True), generic.double().requires_grad_(True)
        (jreg.token_displacement(x, y, kind).double() * 1.0).sum().backward()
        ref_x, ref_y = x.detach().clone().requires_grad_(True), y.detach().clone().requires_grad_(True)
        reference_displacement(ref_x, ref_y, kind).sum().backward()
        torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(y.grad, ref_y.grad, rtol=1e-4, atol=1e-6)


def test_triton_layer_penalty_is_two_launches_and_no_tensor_of_its_own(monkeypatch):
    """As training runs it on a GPU: in a graph where h_in and h_out are not leaves, JREG's backward launches two
    kernels (grad_b, grad_a) and creates no [T, h] tensor beyond those the same graph creates without it (its
    gradients go into the incoming ones); its forward launches none; logging Ψ is one more launch."""
    _interpreting_triton()
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_jreg import jreg, jreg_kernels, jreg_triton

    monkeypatch.setenv(jreg_kernels.ENV, "triton")
    launches = []

    class Counted:
        """A kernel whose launches are counted and run outside the dispatch mode below (the interpreter copies
        every argument to host memory and back: its own mechanics, not what a GPU launch allocates)."""

        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(self.kernel)
                with torch.utils._python_dispatch._disable_current_modes():
                    return self.kernel[grid](*args, **kwargs)

            return launch

    for name in ("_forward_kernel", "_grad_b_kernel", "_grad_a_kernel"):
        monkeypatch.setattr(jreg_triton, name, Counted(getattr(jreg_triton, name)))
    T, h = 24, 32

    class Fresh(TorchDispatchMode):
        """Outputs of ≥ T·h elements whose memory no tensor had before the op."""

        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.numel() >= T * h and t.untyped_storage().data_ptr() not in before:
                    self.count += 1
            return out

    def step(with_jreg: bool, dtype) -> tuple[int, int]:
        torch.manual_seed(11)
        x = torch.randn(T // 2, 2, h).to(dtype).requires_grad_(True)
        y = torch.randn(T // 2, 2, h).to(dtype).requires_grad_(True)
        g = torch.randn(T // 2, 2, h).to(dtype)
        penalty = jreg.LayerPenalty()
        h_in = x * 1
        h_in = penalty.watch(h_in) if with_jreg else h_in
        h_out = h_in + y
        if with_jreg:
            h_out = penalty.attach(h_out, h_in, torch.ones(1).expand(T), 0.5)
        loss = (h_out * g).sum() + (h_in * g).sum()
        forward_launches = len(launches)
        with Fresh() as fresh:
            loss.backward()
        return forward_launches, fresh.count

    for dtype in (torch.float32, torch.bfloat16):
        launches.clear()
        _, without = step(False, dtype)
        assert launches == []
        forward_launches, with_jreg = step(True, dtype)
        assert forward_launches == 0 and with_jreg == without > 0, (launches, with_jreg, without)
        assert [k.fn.__name__ for k in launches] == ["_grad_b_kernel", "_grad_a_kernel"]
    launches.clear()
    jreg.token_figures(torch.randn(T, h), torch.randn(T, h))
    assert [k.fn.__name__ for k in launches] == ["_forward_kernel"]


def test_consecutive_layers_hand_each_other_the_gradient_in_place(kernel, monkeypatch):
    """Three layers in a row (layer ℓ's output is layer ℓ+1's input, as in a decoder): every grad_b and grad_a of
    every layer writes into the gradient it was handed (none is a view or held elsewhere), and the leaf gradients
    equal float64 autograd of the loss plus the three terms."""
    import torch

    from megatron_jreg import jreg

    torch.manual_seed(12)
    in_place = _record_where_kernels_write(monkeypatch)
    x = torch.randn(5, 2, 24)
    adds = [0.5 * torch.randn(5, 2, 24) for _ in range(3)]
    g = torch.randn(5, 2, 24)
    up = torch.rand(10)
    factors = (1.0, 4.0, 9.0)

    def run(dtype, jreg_on):
        leaves = [t.to(dtype).clone().requires_grad_(True) for t in (x, *adds)]
        h, terms = leaves[0] * 1, 0.0
        for add, factor in zip(leaves[1:], factors):
            if jreg_on:
                penalty = jreg.LayerPenalty()
                h_in = penalty.watch(h)
                h = penalty.attach(torch.tanh(h_in) + add, h_in, up, factor)
            else:
                h_in, h = h, torch.tanh(h) + add
                terms = terms + factor * (up.double() * reference_displacement(h_in, h, "angular").reshape(-1)).sum()
        ((h * g.to(dtype)).sum() + terms).backward()
        return [t.grad for t in leaves]

    ours = run(torch.float32, True)
    assert in_place == [True] * 6
    for mine, ref in zip(ours, run(torch.float64, False)):
        torch.testing.assert_close(mine.double(), ref, rtol=1e-5, atol=1e-5)
