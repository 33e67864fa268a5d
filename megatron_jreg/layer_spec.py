"""The layer spec every model is built with: Megatron-LM's own, its bare torch norms made sequence-parallel capable,
and `--layernorm-scaling` (1/√ℓ on each layer's pre-norms; DEVELOPERS.md, "The layer spec")."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    LayerNormImpl,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset


class TorchNorm(torch.nn.Module):
    """RMSNorm/LayerNorm with megatron's norm-constructor signature and sequence-parallel support; `scale` multiplies
    the output (LayerNorm Scaling's 1/√ℓ), folded into the [h] weight and bias."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, scale: float = 1.0,
                 **_: object) -> None:
        super().__init__()
        self.scale = scale
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"--normalization {config.normalization}: the local spec's norm is RMSNorm or LayerNorm")
        dtype = config.params_dtype
        self.rms = config.normalization == "RMSNorm"
        self.eps = eps
        self.one_p = bool(config.layernorm_zero_centered_gamma)  # --apply-layernorm-1p: stores γ − 1, as TE's norms
        init = torch.zeros if self.one_p else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=dtype))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel  # megatron reduces these grads over TP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.one_p else self.weight
        bias = self.bias
        if self.scale != 1.0:
            weight = weight * self.scale
            bias = None if bias is None else bias * self.scale
        if self.rms:
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        return F.layer_norm(x, (x.shape[-1],), weight, bias, self.eps)


def _swap_norms(spec: object) -> object:
    if spec is WrappedTorchNorm:
        return TorchNorm
    if isinstance(spec, ModuleSpec):
        sub = spec.submodules
        if sub is not None and dataclasses.is_dataclass(sub):
            sub = dataclasses.replace(sub, **{f.name: _swap_norms(getattr(sub, f.name))
                                              for f in dataclasses.fields(sub)})
        return dataclasses.replace(spec, module=_swap_norms(spec.module), submodules=sub)
    if isinstance(spec, TransformerBlockSubmodules):
        return dataclasses.replace(spec, layer_specs=[_swap_norms(s) for s in spec.layer_specs],
                                   layer_norm=_swap_norms(spec.layer_norm))
    return spec


def _scale_norms(block: TransformerBlockSubmodules, config: TransformerConfig,
                 vp_stage: int | None) -> TransformerBlockSubmodules:
    """LayerNorm Scaling: layer ℓ's two pre-norms get scale 1/√ℓ (DEVELOPERS.md, "The layer spec")."""
    offset = get_transformer_layer_offset(config, vp_stage)
    specs = []
    for i, spec in enumerate(block.layer_specs):
        sub = spec.submodules
        names = ("input_layernorm", "pre_mlp_layernorm")
        if any(getattr(sub, name, None) is not TorchNorm for name in names):
            raise ValueError("--layernorm-scaling scales the local spec's norm modules; this model's norms are fused "
                             "into Transformer Engine's linear layers: add --transformer-impl local")
        norm = ModuleSpec(module=TorchNorm, params={"scale": 1.0 / math.sqrt(offset + i + 1)})
        specs.append(dataclasses.replace(spec, submodules=dataclasses.replace(sub, **dict.fromkeys(names, norm))))
    return dataclasses.replace(block, layer_specs=specs)


def layer_spec(model_config, vp_stage: int | None = None, layernorm_scaling: bool = False):
    """Megatron-LM's default spec for this config (training/models/gpt.py), norms made SP-capable (and scaled)."""
    from megatron.training.models.gpt import default_layer_spec

    spec = default_layer_spec(model_config, vp_stage)
    if isinstance(spec, ModuleSpec) and not isinstance(spec.submodules, TransformerBlockSubmodules):
        num = get_num_layers_to_build(model_config.transformer, vp_stage=vp_stage)
        spec = TransformerBlockSubmodules(layer_specs=[spec] * num, layer_norm=LayerNormImpl)
    spec = _swap_norms(spec)
    if not layernorm_scaling:
        return spec
    if isinstance(spec, ModuleSpec):  # a block's ModuleSpec
        return dataclasses.replace(spec, submodules=_scale_norms(spec.submodules, model_config.transformer, vp_stage))
    return _scale_norms(spec, model_config.transformer, vp_stage)


def model_layer_spec(layernorm_scaling: bool):
    """The spec callable a GPTModelConfig takes (`transformer_layer_spec`), with or without LayerNorm Scaling."""
    return functools.partial(layer_spec, layernorm_scaling=True) if layernorm_scaling else layer_spec


def add_flag(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--layernorm-scaling", action="store_true",
                       help="LayerNorm Scaling (Sun et al. 2025, 'The Curse of Depth in Large Language Models'): each "
                            "decoder layer ℓ's pre-attention and pre-MLP norm outputs × 1/√ℓ (--transformer-impl "
                            "local)")


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except (ImportError, OSError):
        return False
    return True
