"""JREG on megatron-core: the penalty, Ψ and gradients agree across parallel layouts (real gloo ranks)."""

import pytest

from tests._layouts import LAYERS, SINGLE_LAYOUTS, TWO_RANK_LAYOUTS, single_rank_suite, two_rank_suite
from tests.distributed import run_ranks

pytestmark = pytest.mark.multirank

RTOL = 1e-5


@pytest.fixture(scope="module")
def single():
    return run_ranks(single_rank_suite, 1)[0]


@pytest.fixture(scope="module")
def two():
    return run_ranks(two_rank_suite, 2)


def max_rel_diff(grads: dict, ref: dict, scale: float = 1.0) -> float:
    assert set(grads) == set(ref)
    return max(((grads[k] / scale - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-12)).item() for k in ref)


def by_name(layouts, results):
    return {layout.name: r for layout, r in zip(layouts, results)}


def test_plugin_gradients_equal_the_explicitly_written_loss(single):
    ref = by_name(SINGLE_LAYOUTS, single["layouts"])["single"]
    explicit = single["explicit"]
    assert ref["psi"] == pytest.approx(explicit["psi"], rel=RTOL)
    assert max_rel_diff(ref["grads"], explicit["grads"]) < RTOL


def test_cosine_distance_trains_on_one_minus_cos_and_logs_angular_psi(single):
    results = by_name(SINGLE_LAYOUTS, single["layouts"])
    cos, ref = results["cosine"], results["single"]
    explicit = single["explicit-cosine"]
    assert cos["psi"] == pytest.approx(ref["psi"], rel=RTOL)  # ζ's Ψ is angular whatever the training distance
    assert cos["psi_distance"] == pytest.approx(explicit["psi"], rel=RTOL)
    assert max_rel_diff(cos["grads"], explicit["grads"]) < RTOL
    assert max_rel_diff(cos["grads"], ref["grads"]) > 1e-3


@pytest.mark.parametrize("name", ["full-recompute", "selective-recompute", "per-token-loss"])
def test_recompute_and_per_token_loss_give_identical_results(single, name):
    results = by_name(SINGLE_LAYOUTS, single["layouts"])
    ref, other = results["single"], results[name]
    assert other["lm_loss"] == pytest.approx(ref["lm_loss"], rel=RTOL)
    assert other["psi"] == pytest.approx(ref["psi"], rel=RTOL)
    assert max_rel_diff(other["grads"], ref["grads"]) < RTOL


def test_penalty_is_scaled_like_the_main_loss(single):
    results = by_name(SINGLE_LAYOUTS, single["layouts"])
    assert max_rel_diff(results["loss-scale-8"]["grads"], results["single"]["grads"], scale=8.0) < RTOL
    # ... and it is really there: without it the gradients differ.
    assert max_rel_diff(results["lambda-0"]["grads"], results["single"]["grads"]) > 1e-2


@pytest.mark.parametrize("name", [layout.name for layout in TWO_RANK_LAYOUTS])
def test_two_rank_layouts_match_single_rank(single, two, name):
    ref = by_name(SINGLE_LAYOUTS, single["layouts"])["single"]
    results = [by_name(TWO_RANK_LAYOUTS, rank_result["layouts"])[name] for rank_result in two]
    for r in results:  # every rank reports the same Ψ vector and L_cos
        assert len(r["psi"]) == LAYERS
        assert r["psi"] == pytest.approx(ref["psi"], rel=RTOL)
        assert r["jreg_loss"] == pytest.approx(ref["jreg_loss"], rel=RTOL)
        assert r["lm_loss"] == pytest.approx(ref["lm_loss"], rel=RTOL)
    assert max_rel_diff(results[0]["grads"], ref["grads"]) < RTOL


def test_context_parallel_split_equals_unsplit(two):
    import torch

    for r in (rank_result["cp"] for rank_result in two):
        assert r["psi"] == pytest.approx(r["psi_ref"], rel=RTOL)
        torch.testing.assert_close(r["w_grad"], r["w_grad_ref"], rtol=RTOL, atol=1e-9)
        torch.testing.assert_close(r["x_grad"], r["x_grad_ref"], rtol=RTOL, atol=1e-9)
        assert r["x_grad_ref"].abs().max() > 0


def test_jreg_lowers_last_layer_displacement(single):
    train = single["train"]
    base, jreg1, jreg5 = train[0.0], train[1.0], train[5.0]
    assert base[0] == jreg1[0] == jreg5[0]  # same start
    assert jreg1[-1] < 0.8 * base[-1]
    assert jreg5[-1] < jreg1[-1]
    assert sum(jreg1[1:]) < sum(base[1:])


def test_lambda_zero_installs_no_hooks_unless_recording(single):
    hooks = single["hooks"]
    assert hooks[0.0] == {"silent": 0, "recording": LAYERS, "after": 0}
    assert hooks[1.0]["silent"] == LAYERS
