"""Transformer Engine and FP8 without a GPU: the flag → TransformerConfig mapping for each recipe, which
implementation and layer spec a run gets, and every way an FP8 request stops before any work.

The flags are Megatron-LM's and so is their mapping (core_transformer_config_from_args); megatron-jreg adds
the checks that stop an FP8 run that cannot work here before any work. The GPU, its compute capability,
Transformer Engine's presence, version and own FP8 verdict are set per test (monkeypatch); megatron-core's
TransformerConfig and its version comparison run for real.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import TYPE_CHECKING

import pytest
from packaging.version import Version

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

TINY = ["--model-preset", "tiny", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
        "--train-iters", "1"]
NO_FUSION = ["--no-gradient-accumulation-fusion", "--no-rope-fusion", "--no-masked-softmax-fusion"]
RECIPES = ["delayed", "tensorwise", "mxfp8", "blockwise"]


@pytest.fixture
def machine(monkeypatch):
    """machine(cuda=..., cc=..., te=<version or None>, te_verdict=(ok, reason)): fake this process's GPU/TE."""
    import torch
    from megatron.core import utils as mcore_utils

    from megatron_jreg.training import model

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


def args_of(*flags: str):
    from megatron_jreg.training.flags import parse_args

    return parse_args(TINY + list(flags))


def error_of(*flags: str) -> str:
    from megatron_jreg.errors import UsageError
    from megatron_jreg.training import model

    with pytest.raises(UsageError) as e:
        model.check_transformer_impl(args_of(*flags))
    return str(e.value)


def transformer_config(*flags: str) -> TransformerConfig:
    """Megatron-LM's own flags → TransformerConfig mapping, on megatron-jreg's parser."""
    import torch
    from megatron.training.argument_utils import core_transformer_config_from_args

    args = args_of("--no-rope-fusion", "--no-bias-swiglu-fusion", "--no-gradient-accumulation-fusion", *flags)
    args.params_dtype = torch.bfloat16 if args.bf16 else torch.float32
    args.padded_vocab_size = 256
    args.kv_channels = args.hidden_size // args.num_attention_heads
    return core_transformer_config_from_args(args)


# -- flags → TransformerConfig -------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_flags_map_onto_transformer_config(recipe):
    tc = transformer_config("--bf16", "--fp8-format", "hybrid", "--fp8-recipe", recipe, "--fp8-param-gather",
                            "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max")
    assert (tc.fp8, tc.fp8_recipe, tc.fp8_param, tc.bf16) == ("hybrid", recipe, True, True)
    assert (tc.fp8_amax_history_len, tc.fp8_amax_compute_algo) == (16, "max")


def test_no_fp8_by_default():
    tc = transformer_config("--bf16")
    assert (tc.fp8, tc.fp8_param) == (None, False)


# -- which implementation --------------------------------------------------------------------------------


@pytest.mark.parametrize("te", ["2.8.0", None])
def test_default_implementation_is_megatron_lms(machine, te):
    """Megatron-LM's default --transformer-impl is transformer_engine: it runs where TE imports; elsewhere
    the run stops before any work and names the flag that gives the local spec."""
    from megatron_jreg.training import model

    machine(te=te)
    assert args_of().transformer_impl == "transformer_engine"
    if te is None:
        message = error_of()
        assert "Transformer Engine is not importable" in message and "--transformer-impl local" in message
        # a GPU without TE or apex: the local spec runs once Megatron-LM's default-on fused kernels are off
        message = error_of("--transformer-impl", "local")
        assert "fused kernels need Transformer Engine or apex" in message and "--no-rope-fusion" in message
        model.check_transformer_impl(args_of("--transformer-impl", "local", *NO_FUSION))
    else:
        model.check_transformer_impl(args_of())
        model.check_transformer_impl(args_of("--transformer-impl", "local"))


@pytest.mark.parametrize("recipe,cc,name", [("delayed", (9, 0), "NVIDIA H100"), ("tensorwise", (8, 9), "NVIDIA L40S"),
                                            ("blockwise", (9, 0), "NVIDIA H200"), ("mxfp8", (10, 0), "NVIDIA B200")])
def test_fp8_recipe_runs_where_it_can(machine, recipe, cc, name):
    from megatron_jreg.training import model

    calls = machine(cc=cc, name=name, te="2.8.0")
    model.check_transformer_impl(args_of("--bf16", "--fp8-format", "hybrid", "--fp8-recipe", recipe))
    assert calls == [{"mxfp8": "mxfp8", "blockwise": "blockwise"}.get(recipe, "fp8")]  # TE's check for the recipe


# -- FP8 requests that stop before any work --------------------------------------------------------------


def test_fp8_without_transformer_engine(machine):
    machine(te=None)
    message = error_of("--bf16", "--fp8-format", "hybrid")
    assert "Transformer Engine is not importable" in message and "docker/Dockerfile" in message


def test_fp8_with_local_layers(machine):
    machine()
    message = error_of("--bf16", "--fp8-format", "e4m3", "--transformer-impl", "local")
    assert "--fp8-format e4m3" in message and "--transformer-impl local" in message
    assert "--transformer-impl transformer_engine" in message


def test_fp8_without_gpu(machine):
    machine(cuda=False)
    message = error_of("--bf16", "--fp8-format", "hybrid", "--transformer-impl", "transformer_engine")
    assert "no CUDA device is visible" in message and "train in --bf16" in message and "--fp8-format hybrid" in message


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


# -- layer specs -----------------------------------------------------------------------------------------


class _FakeTESpecProvider:
    """Stands in for megatron-core's TESpecProvider (None without TE): one named class per TE module kind."""

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def __getattr__(self, kind: str):
        return lambda *args, **kwargs: type(f"TE_{kind}", (), {})


@pytest.fixture
def one_rank():
    """A one-rank gloo group with megatron-core's parallel state (specs ask for the pipeline layout)."""
    from megatron.core import parallel_state

    from megatron_jreg.checkpoints.model import init_process_group

    init_process_group()
    if parallel_state.model_parallel_is_initialized():  # left by an earlier test's in-process checkpoint load
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()


def _model_config(*flags: str):
    from megatron.training.argument_utils import gpt_config_from_args

    tc = transformer_config(*flags)
    args = args_of("--no-rope-fusion", *flags)
    args.padded_vocab_size = 256
    return gpt_config_from_args(args, tc)


def test_transformer_engine_spec_is_the_layer_jreg_hooks(monkeypatch, one_rank):
    """With TE, megatron-jreg keeps Megatron-LM's TE spec as it is: megatron's TransformerLayer (the class
    JregPlugin hooks) with each pre-norm fused into the TE linear after it, so the layer's input and output
    are the residual stream, as in the local spec."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_jreg import layer_spec as model
    from megatron_jreg import plugin

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", _FakeTESpecProvider)
    monkeypatch.setattr(transformer_block, "LayerNormImpl", type("TENorm", (), {}))
    monkeypatch.setattr(model, "LayerNormImpl", transformer_block.LayerNormImpl)
    block = model.layer_spec(_model_config("--transformer-impl", "transformer_engine"))
    spec = block.layer_specs[0]
    assert spec.module is TransformerLayer and plugin.TransformerLayer is TransformerLayer
    assert spec.submodules.input_layernorm is IdentityOp and spec.submodules.pre_mlp_layernorm is IdentityOp
    assert spec.submodules.self_attention.submodules.linear_qkv.__name__ == "TE_column_parallel_layer_norm_linear"
    assert block.layer_norm.__name__ == "TENorm"


def test_local_spec_is_megatron_lms_with_sequence_parallel_norms(one_rank):
    """Without TE or apex, Megatron-LM's local spec uses a bare torch norm that refuses sequence parallelism;
    megatron-jreg's spec is the same layer with TorchNorm (same math) in the three norm places."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_jreg import layer_spec as model

    block = model.layer_spec(_model_config("--transformer-impl", "local"))
    assert len(block.layer_specs) == 4 and block.layer_norm is model.TorchNorm
    layer = block.layer_specs[0]
    assert layer.module is TransformerLayer
    norm = model.TorchNorm
    assert layer.submodules.input_layernorm is norm and layer.submodules.pre_mlp_layernorm is norm


def test_torch_norm_equals_torch_rmsnorm_and_supports_zero_centered_gamma():
    import torch
    from megatron.core.transformer import TransformerConfig

    from megatron_jreg import layer_spec as model

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm")
    x = torch.randn(3, 2, 8)
    ours = model.TorchNorm(config, 8, eps=1e-5)
    ours.weight.data = torch.linspace(0.5, 1.5, 8)
    ref = torch.nn.RMSNorm(8, eps=1e-5)
    ref.weight.data = ours.weight.data.clone()
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)
    one_p = model.TorchNorm(dataclasses.replace(config, layernorm_zero_centered_gamma=True), 8, eps=1e-5)
    assert torch.equal(one_p.weight, torch.zeros(8))  # γ − 1 is stored, as Transformer Engine's norms do
    one_p.weight.data = ours.weight.data - 1
    torch.testing.assert_close(one_p(x), ref(x))


def test_jreg_displacement_is_fp32_from_bf16_activations():
    """What the hook gets on the TE path is the layers' bf16 output; Ψ is computed from it in fp32."""
    import torch

    from megatron_jreg import jreg

    g = torch.Generator().manual_seed(0)
    h_in = torch.randn(64, 2, 96, generator=g).to(torch.bfloat16)
    h_out = (h_in.float() + 0.3 * torch.randn(64, 2, 96, generator=g)).to(torch.bfloat16)
    d = jreg.token_displacement(h_in, h_out)
    assert d.dtype == torch.float32
    a, b = h_in.double(), h_out.double()
    cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    torch.testing.assert_close(d.double(), torch.arccos(cos.clamp(-1, 1)) / torch.pi, atol=1e-6, rtol=0)
