"""The JREG math against plain formulas written directly from the definitions."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch

# jreg.DISTANCES, written out so that collecting this file does not import torch (test_distances_are_all_tested).
DISTANCES = ("angular", "cosine")


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
def test_displacement_values_and_gradients_match_reference(kind):
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
def test_identical_and_parallel_vectors_give_zero_and_finite_gradient(kind):
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


def test_antiparallel_vectors_angular_is_one_with_finite_gradient():
    import torch

    from megatron_jreg import jreg

    a = torch.randn(4, 8, requires_grad=True)
    b = (-2.0 * a.detach()).requires_grad_(True)
    d = jreg.token_displacement(a, b, "angular")
    # Exact near 0 (where JREG drives Ψ); near π the angle is taken from 4 − |â − b̂|², good to ~3e-4.
    torch.testing.assert_close(d, torch.ones(4), atol=1e-3, rtol=0)
    d.sum().backward()
    assert torch.isfinite(a.grad).all()


@pytest.mark.parametrize("kind,value", [("angular", 0.5), ("cosine", 1.0)])
def test_zero_vectors_are_orthogonal_with_zero_gradient(kind, value):
    import torch

    from megatron_jreg import jreg

    z = torch.zeros(3, 8, requires_grad=True)
    b = torch.randn(3, 8, requires_grad=True)
    d = jreg.token_displacement(z, b, kind)
    torch.testing.assert_close(d, torch.full((3,), value))
    d.sum().backward()
    assert torch.equal(z.grad, torch.zeros_like(z)) and torch.equal(b.grad, torch.zeros_like(b))


def test_bf16_inputs_computed_in_fp32_with_bf16_gradients():
    import torch

    from megatron_jreg import jreg

    torch.manual_seed(1)
    a32, b32 = torch.randn(16, 2, 64), torch.randn(16, 2, 64)
    a = a32.bfloat16().requires_grad_(True)
    b = b32.bfloat16().requires_grad_(True)
    psi = jreg.displacement(a, b)
    assert psi.dtype == torch.float32
    ref = reference_displacement(a.detach().float(), b.detach().float(), "angular").mean()
    torch.testing.assert_close(psi.double(), ref, rtol=1e-5, atol=1e-6)
    psi.backward()
    assert a.grad.dtype == torch.bfloat16 and torch.isfinite(a.grad.float()).all()


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
