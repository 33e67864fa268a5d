"""Hidden states that are the zero vector: d reads them as orthogonal (Ψ 0.5), so a run whose states are zero would
report Ψ = 0.5 and a jump where none is measured. The plugin counts them (JregStats.zero_fraction), ζ is not
computed then (NaN, never a jump), and `megatron-jreg train` says so once, at the first logging step, naming the
layers."""

from __future__ import annotations

import math

import pytest

from tests.distributed import run_ranks


def test_zero_states_make_zeta_nan_and_are_named():
    import torch

    from megatron_jreg import jreg
    from megatron_jreg.plugin import JregStats
    from megatron_jreg.training.loop import zero_state_warning

    psi = torch.tensor([0.10, 0.20, 0.50, 0.50])
    weights = jreg.layer_weights(4, 1.0)
    clean = JregStats.from_psi(psi, weights)
    assert clean.zero_layers == [] and all(math.isfinite(z) for z in clean.zeta.values())
    assert clean.zeta["zeta_L-1"] == pytest.approx(30.0)  # the rise to 0.5 would read as a jump
    zero = JregStats.from_psi(psi, weights, zero=torch.tensor([0.0, 0.0, 1.0, 0.25]))
    assert zero.zero_layers == [3, 4] and zero.zero_fraction == [0.0, 0.0, 1.0, 0.25]
    assert zero.zeta and all(math.isnan(z) for z in zero.zeta.values())
    assert zero.psi == clean.psi and zero.jreg_loss == clean.jreg_loss  # reported as measured
    line = zero_state_warning(zero)
    assert line.startswith("megatron-jreg train: warning: hidden states that are the zero vector at layer(s) "
                           "3 (every token), 4 (25 %)")
    assert "Ψ reads 0.5" in line and "ζ is not computed" in line and "--init-method-std" in line


def _zero_init_run(rank: int, world: int) -> tuple[int, str]:
    from tests._train_runs import TINY, train

    rc, stdout, _ = train([*TINY, "--init-method-std", "0", "--train-iters", "2", "--eval-iters", "0",
                           "--eval-interval", "1000"])
    return rc, stdout


@pytest.mark.multirank
def test_training_from_all_zero_states_warns_once_naming_the_layers():
    """`--init-method-std 0 --jreg-lambda 1`: every hidden state is the zero vector. The run trains (exit 0) and says
    so once, at its first logging step, naming every layer; ζ is nan on its console line."""
    rc, stdout = run_ranks(_zero_init_run, 1)[0]
    assert rc == 0, stdout[-3000:]
    warnings = [line for line in stdout.splitlines() if "hidden states that are the zero vector" in line]
    assert len(warnings) == 1, stdout[-3000:]
    assert "layer(s) 1 (every token), 2 (every token), 3 (every token), 4 (every token)" in warnings[0]
    iterations = [line for line in stdout.splitlines() if " iteration " in line and "zeta_L" in line]
    assert iterations and all("zeta_L: nan" in line for line in iterations), iterations
