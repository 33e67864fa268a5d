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
