"""JregConfig is the one home of JREG's settings: the --jreg-* flags come from its fields, a run's config comes
from the parsed flags, bad values are refused there with the flag's name, and a checkpoint keeps it whole."""

from __future__ import annotations

import argparse
import math
from dataclasses import fields

import pytest


def _parse(*argv: str) -> argparse.Namespace:
    from megatron_jreg.plugin import JregConfig

    parser = argparse.ArgumentParser()
    JregConfig.add_flags(parser.add_argument_group("jreg"))
    return parser.parse_args(list(argv))


def test_flags_are_generated_from_the_fields_with_their_defaults():
    from megatron_jreg.plugin import JregConfig

    args = _parse()
    assert JregConfig.from_args(args) == JregConfig()
    assert {k for k in vars(args)} == {f"jreg_{f.metadata['flag'][7:].replace('-', '_')}" for f in fields(JregConfig)}
    cfg = JregConfig.from_args(_parse("--jreg-lambda", "1", "--jreg-alpha", "0.3", "--jreg-distance", "cosine",
                                      "--jreg-layers", "11", "12", "--jreg-min-weight", "0.01"))
    assert cfg == JregConfig(lam=1.0, alpha=0.3, distance="cosine", layers=(11, 12), min_weight=0.01)
    assert cfg.record() == {"lambda": 1.0, "alpha": 0.3, "distance": "cosine", "layers": [11, 12],
                            "min-weight": 0.01}
    assert JregConfig(**{f.name: v for f, v in zip(fields(JregConfig), cfg.record().values())}) == cfg


@pytest.mark.parametrize("kwargs, message", [
    ({"lam": -1.0}, "--jreg-lambda must be >= 0"),
    ({"lam": math.nan}, "--jreg-lambda must be >= 0"),
    ({"alpha": math.inf}, "--jreg-alpha must be a finite number"),
    ({"distance": "euclid"}, "--jreg-distance must be one of angular, cosine"),
    ({"layers": [0, 3]}, "--jreg-layers [0, 3]: layers are numbered from 1"),
    ({"min_weight": -0.1}, "--jreg-min-weight must be in [0, 1)"),
    ({"min_weight": math.nan}, "--jreg-min-weight must be in [0, 1)"),
])
def test_bad_values_are_refused_naming_the_flag(kwargs, message):
    from megatron_jreg.errors import UsageError
    from megatron_jreg.plugin import JregConfig

    with pytest.raises(UsageError) as e:
        JregConfig(**kwargs)
    assert message in str(e.value)


def test_an_unknown_kernel_in_the_environment_is_refused_with_the_config(monkeypatch):
    from megatron_jreg.errors import UsageError
    from megatron_jreg.plugin import JregConfig

    monkeypatch.setenv("MEGATRON_JREG_KERNEL", "cuda")
    with pytest.raises(UsageError, match=r"^MEGATRON_JREG_KERNEL='cuda': use one of auto, triton, compiled, torch"):
        JregConfig()
    monkeypatch.setenv("MEGATRON_JREG_KERNEL", "torch")
    assert JregConfig(lam=1.0).lam == 1.0


def test_layers_beyond_the_model_are_refused_once_its_depth_is_known():
    from megatron_jreg.errors import UsageError
    from megatron_jreg.plugin import JregConfig

    args = _parse("--jreg-layers", "13")
    JregConfig.from_args(args)  # depth unknown yet: nothing to check against
    args.num_layers = 12
    with pytest.raises(UsageError, match=r"--jreg-layers \[13\]: layers are numbered 1..12"):
        JregConfig.from_args(args)


def test_min_weight_skips_the_light_layers_and_must_leave_one():
    """--jreg-min-weight W: a layer whose softmax weight is below W gets no term (weight 0 where training reads it);
    a W above every weight is refused once the depth is known. Args saved before the flag existed read its default."""
    import torch

    from megatron_jreg import jreg
    from megatron_jreg.errors import UsageError
    from megatron_jreg.plugin import JregConfig

    full = jreg.layer_weights(16, 1.0)
    cfg = JregConfig(lam=1.0, alpha=1.0, min_weight=0.01)
    w = cfg.weights(16)
    assert torch.equal(w == 0, full < 0.01) and 0 < int((w == 0).sum()) < 16
    assert torch.equal(w[w > 0], full[full >= 0.01])
    assert torch.equal(JregConfig(lam=1.0).weights(16), full)
    with pytest.raises(UsageError, match=r"--jreg-min-weight 0.9 skips every layer \(the largest weight is 0.63"):
        JregConfig(lam=1.0, alpha=1.0, min_weight=0.9).check_layers(16)
    JregConfig(lam=0.0, min_weight=0.9).check_layers(16)  # λ = 0 penalizes nothing anyway
    old = _parse("--jreg-lambda", "1")
    del old.jreg_min_weight
    assert JregConfig.from_args(old).min_weight == 0.0
