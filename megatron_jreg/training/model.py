"""Build the Llama-style megatron-core `GPTModel` (one chunk per virtual pipeline stage).

Two layer specs: megatron-core's Transformer Engine spec on GPU images, and its local spec with our
`TorchNorm` in place of megatron's wrapped torch norm, because megatron's refuses sequence parallelism
without apex/TE. `TorchNorm` marks its weight `sequence_parallel` so megatron all-reduces its gradient
over TP, as it does for TE's norms.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from megatron_jreg.config import ConfigError, ModelConfig, ParallelConfig, PrecisionConfig


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


def params_dtype(precision: PrecisionConfig) -> torch.dtype:
    return torch.bfloat16 if precision.bf16 else torch.float16 if precision.fp16 else torch.float32


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def resolve_transformer_impl(precision: PrecisionConfig) -> str:
    """transformer_engine or local; FP8 without TE or without an FP8-capable GPU stops here."""
    impl = precision.transformer_impl
    if impl is None:
        impl = "transformer_engine" if torch.cuda.is_available() and have_transformer_engine() else "local"
    if impl == "transformer_engine" and not have_transformer_engine():
        raise ConfigError(
            "--transformer-impl transformer_engine: Transformer Engine is not importable here; use the NGC "
            "PyTorch image (docker/Dockerfile) or --transformer-impl local"
        )
    if precision.fp8_format is not None:
        if impl != "transformer_engine":
            raise ConfigError(
                f"--fp8-format {precision.fp8_format} needs Transformer Engine (--transformer-impl "
                "transformer_engine on a GPU image with TE); without it train in --bf16"
            )
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
            raise ConfigError(
                f"--fp8-format {precision.fp8_format} needs an FP8-capable GPU (Ada/Hopper/Blackwell, compute "
                "capability >= 8.9); on this machine train in --bf16"
            )
        if precision.fp8_recipe == "mxfp8" and torch.cuda.get_device_capability() < (10, 0):
            raise ConfigError("--fp8-recipe mxfp8 needs a Blackwell GPU; use delayed, tensorwise or blockwise")
        if not (precision.bf16 or precision.fp16):
            raise ConfigError("--fp8-format trains the matmuls in FP8 around --bf16 (or --fp16): add --bf16")
    return impl


def fp8_fields(precision: PrecisionConfig) -> dict:
    """Megatron-LM's FP8 flags as megatron-core TransformerConfig fields (empty without FP8)."""
    if precision.fp8_format is None:
        return {}
    return {
        "fp8": precision.fp8_format,
        "fp8_recipe": precision.fp8_recipe,
        "fp8_amax_history_len": precision.fp8_amax_history_len,
        "fp8_amax_compute_algo": precision.fp8_amax_compute_algo,
        "fp8_param": precision.fp8_param_gather,
    }


def transformer_config(
    model: ModelConfig,
    parallel: ParallelConfig,
    precision: PrecisionConfig | None = None,
    **overrides: object,
) -> TransformerConfig:
    """The megatron-core TransformerConfig for a Llama-style model (overrides: any config field)."""
    precision = precision or PrecisionConfig()
    dtype = params_dtype(precision)
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
        params_dtype=dtype,
        pipeline_dtype=dtype,
        autocast_dtype=dtype,
        use_cpu_initialization=not torch.cuda.is_available(),
        **fp8_fields(precision),
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
