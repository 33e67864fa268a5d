"""Transformer Engine and FP8 without a GPU: the flag → TransformerConfig mapping for each recipe, which
implementation and layer spec a run gets, and every way an FP8 request stops before any work.

The GPU, its compute capability, Transformer Engine's presence, version and own FP8 verdict are set per
test (monkeypatch); megatron-core's TransformerConfig and its version comparison run for real.
"""

import dataclasses
import sys
import types

import pytest
import torch
from megatron.core import utils as mcore_utils
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import TransformerLayer
from packaging.version import Version

from megatron_jreg import jreg, plugin
from megatron_jreg.config import ConfigError, PrecisionConfig
from megatron_jreg.training import model
from megatron_jreg.training.args import config_from_args

TINY = ["--model-preset", "tiny", "--mock-data", "--vocab-size", "256", "--train-iters", "1"]
RECIPES = ["delayed", "tensorwise", "mxfp8", "blockwise"]
DEFAULTS = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}


@pytest.fixture
def machine(monkeypatch):
    """machine(cuda=..., cc=..., te=<version or None>, te_verdict=(ok, reason)): fake this process's GPU/TE."""

    def set_up(cuda: bool = True, cc: tuple[int, int] = (9, 0), name: str = "NVIDIA H100 80GB HBM3",
               te: str | None = "2.8.0", te_verdict: tuple[bool, str] = (True, "")) -> list[str]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(model, "have_transformer_engine", lambda: te is not None)
        monkeypatch.setattr(mcore_utils, "_te_version", Version(te or "0.0.0"))
        calls = []

        class FP8GlobalStateManager:  # what TE says about this GPU for each recipe family
            @staticmethod
            def is_fp8_available():
                calls.append("fp8")
                return te_verdict

            @staticmethod
            def is_mxfp8_available():
                calls.append("mxfp8")
                return te_verdict

            @staticmethod
            def is_fp8_block_scaling_available():
                calls.append("blockwise")
                return te_verdict

        if te is not None:
            fp8 = types.ModuleType("transformer_engine.pytorch.fp8")
            fp8.FP8GlobalStateManager = FP8GlobalStateManager
            for module in ("transformer_engine", "transformer_engine.pytorch"):
                monkeypatch.setitem(sys.modules, module, types.ModuleType(module))
            monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.fp8", fp8)
        return calls

    return set_up


def precision(*flags: str):
    return config_from_args(TINY + list(flags)).precision


def error_of(*flags: str) -> str:
    with pytest.raises(ConfigError) as e:
        model.resolve_transformer_impl(precision(*flags))
    return str(e.value)


# -- flags → TransformerConfig -------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_flags_map_onto_transformer_config(recipe):
    cfg = config_from_args(TINY + ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", recipe, "--fp8-param-gather",
                                   "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max"])
    tc = model.transformer_config(cfg.model, cfg.parallel, cfg.precision)
    assert (tc.fp8, tc.fp8_recipe, tc.fp8_param, tc.bf16) == ("hybrid", recipe, True, True)
    if recipe == "delayed":  # only delayed scaling keeps an amax history
        assert (tc.fp8_amax_history_len, tc.fp8_amax_compute_algo) == (16, "max")
    else:
        assert tc.fp8_amax_history_len == DEFAULTS["fp8_amax_history_len"]
        assert tc.fp8_amax_compute_algo == DEFAULTS["fp8_amax_compute_algo"]


def test_fp8_format_e4m3_and_no_fp8():
    cfg = config_from_args(TINY + ["--bf16", "--fp8-format", "e4m3"])
    assert model.transformer_config(cfg.model, cfg.parallel, cfg.precision).fp8 == "e4m3"
    cfg = config_from_args(TINY + ["--bf16"])
    assert model.fp8_fields(cfg.precision) == {}
    tc = model.transformer_config(cfg.model, cfg.parallel, cfg.precision)
    assert (tc.fp8, tc.fp8_param) == (None, False)


# -- which implementation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cuda,te,expected",
    [(True, "2.8.0", "transformer_engine"), (False, "2.8.0", "local"), (True, None, "local"), (False, None, "local")],
)
def test_default_implementation(machine, cuda, te, expected):
    machine(cuda=cuda, te=te)
    assert model.resolve_transformer_impl(PrecisionConfig(bf16=True)) == expected
    assert model.resolve_transformer_impl(PrecisionConfig(bf16=True, transformer_impl="local")) == "local"


def test_transformer_engine_asked_for_but_missing(machine):
    machine(te=None)
    message = error_of("--transformer-impl", "transformer_engine")
    assert "Transformer Engine is not importable" in message and "--transformer-impl local" in message


@pytest.mark.parametrize("recipe,cc,name", [("delayed", (9, 0), "NVIDIA H100"), ("tensorwise", (8, 9), "NVIDIA L40S"),
                                            ("blockwise", (9, 0), "NVIDIA H200"), ("mxfp8", (10, 0), "NVIDIA B200")])
def test_fp8_recipe_runs_where_it_can(machine, recipe, cc, name):
    calls = machine(cc=cc, name=name, te="2.8.0")
    impl = model.resolve_transformer_impl(precision("--bf16", "--fp8-format", "hybrid", "--fp8-recipe", recipe))
    assert impl == "transformer_engine"
    assert calls == [{"mxfp8": "mxfp8", "blockwise": "blockwise"}.get(recipe, "fp8")]  # TE's check for the recipe


# -- FP8 requests that stop before any work --------------------------------------------------------------


def test_fp8_without_transformer_engine(machine):
    machine(te=None)
    message = error_of("--bf16", "--fp8-format", "hybrid")
    assert "--fp8-format hybrid" in message and "Transformer Engine is not importable" in message
    assert "docker/Dockerfile" in message and "--bf16" in message


def test_fp8_with_local_layers(machine):
    machine()
    message = error_of("--bf16", "--fp8-format", "e4m3", "--transformer-impl", "local")
    assert "--transformer-impl local was given" in message and "--transformer-impl transformer_engine" in message


def test_fp8_without_gpu(machine):
    machine(cuda=False)
    message = error_of("--bf16", "--fp8-format", "hybrid", "--transformer-impl", "transformer_engine")
    assert "no CUDA device is visible" in message and "train in --bf16" in message


def test_fp8_needs_bf16_or_fp16(machine):
    machine()
    assert "add --bf16" in error_of("--fp8-format", "hybrid")


@pytest.mark.parametrize(
    "recipe,cc,name,needles",
    [
        ("delayed", (8, 0), "NVIDIA A100-SXM4-80GB", [">= 8.9", "A100", "is 8.0", "train in --bf16"]),
        ("blockwise", (8, 9), "NVIDIA L40S", [">= 9.0", "Hopper", "--fp8-recipe delayed or tensorwise"]),
        ("mxfp8", (9, 0), "NVIDIA H200", [">= 10.0", "Blackwell", "--fp8-recipe delayed, tensorwise or blockwise"]),
    ],
)
def test_fp8_recipe_needs_a_newer_gpu(machine, recipe, cc, name, needles):
    machine(cc=cc, name=name)
    message = error_of("--bf16", "--fp8-format", "hybrid", "--fp8-recipe", recipe)
    assert f"--fp8-recipe {recipe}" in message
    for needle in needles:
        assert needle in message


@pytest.mark.parametrize("recipe,te,needle", [("tensorwise", "2.1.0", ">= 2.2.0.dev0"),
                                              ("blockwise", "2.2.0", ">= 2.3.0.dev0"), ("mxfp8", "2.0.0", ">= 2.1.0")])
def test_fp8_recipe_needs_a_newer_transformer_engine(machine, recipe, te, needle):
    machine(cc=(10, 0), te=te)
    message = error_of("--bf16", "--fp8-format", "hybrid", "--fp8-recipe", recipe)
    assert f"Transformer Engine {needle}" in message and f"this one is {te}" in message
    assert "--fp8-recipe delayed" in message


def test_transformer_engine_verdict_is_reported(machine):
    machine(cc=(8, 9), name="NVIDIA L4", te_verdict=(False, "CUDA 12.1 or higher required for FP8 execution on Ada"))
    message = error_of("--bf16", "--fp8-format", "hybrid")
    assert "Transformer Engine cannot run this recipe here (CUDA 12.1 or higher required" in message


def test_fp8_param_gather_without_fp8(machine):
    machine()
    assert "--fp8-param-gather" in error_of("--bf16", "--fp8-param-gather")


# -- layer specs -----------------------------------------------------------------------------------------


class _FakeTESpecProvider:
    """Stands in for megatron-core's TESpecProvider (None without TE): one named class per TE module kind."""

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def __getattr__(self, kind: str):
        return lambda *args, **kwargs: type(f"TE_{kind}", (), {})


def test_transformer_engine_spec_is_the_layer_jreg_hooks(monkeypatch):
    """The TE spec keeps megatron's TransformerLayer (the class JregPlugin hooks) and fuses each pre-norm into
    the TE linear after it, so the layer's input and output are the residual stream, as in the local spec."""
    monkeypatch.setattr(model, "have_transformer_engine", lambda: True)
    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", _FakeTESpecProvider)
    spec = model.transformer_engine_layer_spec()
    assert spec.module is TransformerLayer and plugin.TransformerLayer is TransformerLayer
    sub = spec.submodules
    assert sub.input_layernorm is IdentityOp and sub.pre_mlp_layernorm is IdentityOp
    assert sub.self_attention.submodules.linear_qkv.__name__ == "TE_column_parallel_layer_norm_linear"
    local = model.local_layer_spec()
    assert local.module is TransformerLayer and local.submodules.input_layernorm is model.TorchNorm


def test_transformer_engine_spec_without_transformer_engine(monkeypatch):
    monkeypatch.setattr(model, "have_transformer_engine", lambda: False)
    with pytest.raises(ConfigError, match="--transformer-impl local"):
        model.transformer_engine_layer_spec()


@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
def test_build_model_chunks_uses_the_chosen_spec(monkeypatch, impl):
    from megatron.core import parallel_state
    from megatron.core.extensions.transformer_engine import TENorm

    te_spec = model.local_layer_spec()  # a stand-in object: only its identity matters here
    monkeypatch.setattr(model, "transformer_engine_layer_spec", lambda: te_spec)
    for name in ("is_pipeline_first_stage", "is_pipeline_last_stage"):
        monkeypatch.setattr(parallel_state, name, lambda **kwargs: True)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 0)
    built = []
    monkeypatch.setattr(model, "GPTModel", lambda **kwargs: built.append(kwargs))
    cfg = config_from_args(TINY + ["--bf16"])
    tc = model.transformer_config(cfg.model, cfg.parallel, cfg.precision)
    model.build_model_chunks(tc, cfg.model, 256, impl)
    (block,) = [b["transformer_layer_spec"] for b in built]
    assert len(block.layer_specs) == cfg.model.num_layers
    if impl == "transformer_engine":
        assert block.layer_specs[0] is te_spec and block.layer_norm is TENorm
    else:
        assert block.layer_norm is model.TorchNorm
        assert block.layer_specs[0].submodules.input_layernorm is model.TorchNorm


def test_jreg_displacement_is_fp32_from_bf16_activations():
    """What the hook gets on the TE path is the layers' bf16 output; Ψ is computed from it in fp32."""
    g = torch.Generator().manual_seed(0)
    h_in = torch.randn(64, 2, 96, generator=g).to(torch.bfloat16)
    h_out = (h_in.float() + 0.3 * torch.randn(64, 2, 96, generator=g)).to(torch.bfloat16)
    d = jreg.token_displacement(h_in, h_out)
    assert d.dtype == torch.float32
    a, b = h_in.double(), h_out.double()
    cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    torch.testing.assert_close(d.double(), torch.arccos(cos.clamp(-1, 1)) / torch.pi, atol=1e-6, rtol=0)
