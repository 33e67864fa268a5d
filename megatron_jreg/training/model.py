"""Build the Llama-style megatron-core `GPTModel` (one chunk per virtual pipeline stage).

Two layer specs: megatron-core's Transformer Engine spec on GPU images, and its local spec with our
`TorchNorm` in place of megatron's wrapped torch norm, because megatron's refuses sequence parallelism
without apex/TE. `TorchNorm` marks its weight `sequence_parallel` so megatron all-reduces its gradient
over TP, as it does for TE's norms.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from megatron_jreg.config import ModelConfig, ParallelConfig


class TorchNorm(torch.nn.Module):
    """RMSNorm/LayerNorm with megatron's norm-constructor signature and sequence-parallel support."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object) -> None:
        super().__init__()
        dtype = config.params_dtype
        self.rms = config.normalization == "RMSNorm"
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel  # megatron reduces these grads over TP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x[s, b, h] → normalized x (same shape, dtype)."""
        if self.rms:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


@dataclass
class Precision:
    bf16: bool = False
    fp16: bool = False

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32


def transformer_config(
    model: ModelConfig,
    parallel: ParallelConfig,
    precision: Precision | None = None,
    **overrides: object,
) -> TransformerConfig:
    """The megatron-core TransformerConfig for a Llama-style model (overrides: any config field)."""
    precision = precision or Precision()
    kwargs: dict = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        add_bias_linear=not model.disable_bias_linear,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_size(model, parallel),
        num_layers_in_first_pipeline_stage=parallel.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=parallel.decoder_last_pipeline_num_layers,
        sequence_parallel=parallel.sequence_parallel,
        context_parallel_size=parallel.context_parallel_size,
        bf16=precision.bf16,
        fp16=precision.fp16,
        params_dtype=precision.params_dtype,
        pipeline_dtype=precision.params_dtype,
        autocast_dtype=precision.params_dtype,
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def virtual_pipeline_size(model: ModelConfig, parallel: ParallelConfig) -> int | None:
    per_stage = parallel.num_layers_per_virtual_pipeline_stage
    if per_stage is None:
        return None
    return model.num_layers // (parallel.pipeline_model_parallel_size * per_stage)


def local_layer_spec() -> ModuleSpec:
    """megatron-core's local (no TE) Llama layer spec with TorchNorm norms."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm"))
    spec.submodules.input_layernorm = TorchNorm
    spec.submodules.pre_mlp_layernorm = TorchNorm
    return spec


def transformer_engine_layer_spec() -> ModuleSpec:
    """megatron-core's Transformer Engine layer spec (fused norm+linear, TE attention)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec()


def block_spec(config: TransformerConfig, layer: ModuleSpec, vp_stage: int | None, use_te: bool):
    """Block spec for one model chunk: this chunk's layers plus the final norm implementation."""
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        norm = TENorm
    else:
        norm = TorchNorm
    num = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * num, layer_norm=norm)


def build_model_chunks(
    config: TransformerConfig,
    model: ModelConfig,
    padded_vocab_size: int,
    transformer_impl: str = "local",
) -> list[GPTModel]:
    """GPTModel chunks for this rank: one per virtual pipeline stage (one without VPP)."""
    use_te = transformer_impl == "transformer_engine"
    layer = transformer_engine_layer_spec() if use_te else local_layer_spec()
    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp) if vpp else [None]:
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=block_spec(config, layer, vp_stage, use_te),
                vocab_size=padded_vocab_size,
                max_sequence_length=model.max_position_embeddings,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
                position_embedding_type=model.position_embedding_type,
                rotary_base=model.rotary_base,
                vp_stage=vp_stage,
            )
        )
    return chunks
