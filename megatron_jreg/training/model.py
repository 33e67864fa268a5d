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
    """transformer_engine or local; FP8 that cannot run here stops with what is missing and what to use.

    Without --transformer-impl: Transformer Engine when it imports and a GPU is visible, else local. The
    trainer calls this before any process group, model or data exists, so an FP8 run that cannot work
    fails in seconds, not after the model is built. FP8 needs, in this order: TE layers (FP8 lives only in
    TE's GEMMs), --bf16/--fp16 around them, a GPU whose tensor cores have the recipe's FP8 GEMMs, a TE new
    enough for the recipe (the versions megatron-core's `get_fp8_recipe` asks for), and TE's own verdict
    on this GPU and CUDA (e.g. FP8 on Ada also needs CUDA >= 12.1).
    """
    impl = precision.transformer_impl
    have_te = have_transformer_engine()
    if impl is None:
        impl = "transformer_engine" if torch.cuda.is_available() and have_te else "local"
    if impl == "transformer_engine" and not have_te:
        raise ConfigError(
            "--transformer-impl transformer_engine: Transformer Engine is not importable here; use the NGC "
            "PyTorch image (docker/Dockerfile) or --transformer-impl local"
        )
    if precision.fp8_format is None:
        if precision.fp8_param_gather:
            raise ConfigError(
                "--fp8-param-gather keeps the weights in FP8 and needs --fp8-format e4m3|hybrid; drop it to train "
                "in --bf16"
            )
        return impl
    flag = f"--fp8-format {precision.fp8_format} --fp8-recipe {precision.fp8_recipe}"
    if impl != "transformer_engine":
        missing = "--transformer-impl local was given" if have_te else "Transformer Engine is not importable here"
        raise ConfigError(
            f"{flag}: FP8 runs inside Transformer Engine's layers and {missing}; use the NGC PyTorch image "
            "(docker/Dockerfile) with --transformer-impl transformer_engine, or drop --fp8-format and train in --bf16"
        )
    if not (precision.bf16 or precision.fp16):
        raise ConfigError(f"{flag}: FP8 runs the matmuls around --bf16 (or --fp16) weights and activations: add --bf16")
    # recipe: (oldest TE that megatron-core 0.19 builds it with, compute capability, GPU, what to use instead)
    min_te, min_cc, gpus, instead = {
        "delayed": (None, (8, 9), "Ada, Hopper or newer", "train in --bf16"),
        "tensorwise": ("2.2.0.dev0", (8, 9), "Ada, Hopper or newer", "train in --bf16"),
        "blockwise": ("2.3.0.dev0", (9, 0), "Hopper or newer", "use --fp8-recipe delayed or tensorwise"),
        "mxfp8": ("2.1.0", (10, 0), "Blackwell", "use --fp8-recipe delayed, tensorwise or blockwise"),
    }[precision.fp8_recipe]
    if not torch.cuda.is_available():
        raise ConfigError(
            f"{flag} needs an FP8-capable GPU ({gpus}) and no CUDA device is visible here; train in --bf16 "
            "(FP8 runs are launched on GPU nodes: see examples/gpu_smoke.sh and examples/slurm/)"
        )
    cc = tuple(torch.cuda.get_device_capability())
    if cc < min_cc:
        raise ConfigError(
            f"{flag} needs a GPU of compute capability >= {min_cc[0]}.{min_cc[1]} ({gpus}); "
            f"{torch.cuda.get_device_name()} is {cc[0]}.{cc[1]}: {instead}"
        )
    from megatron.core import utils as mcore_utils

    if min_te is not None and not mcore_utils.is_te_min_version(min_te):
        raise ConfigError(
            f"{flag} needs Transformer Engine >= {min_te} and this one is {mcore_utils.get_te_version()}: use a "
            "newer NGC PyTorch image (docker/Dockerfile) or --fp8-recipe delayed"
        )
    try:  # TE's own verdict on this GPU, driver and CUDA for the recipe (what fp8_autocast would raise later)
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager as te_fp8_state
    except (ImportError, OSError):
        te_fp8_state = None  # a TE without it gives no verdict; the checks above stand
    probe_name = {"mxfp8": "is_mxfp8_available", "blockwise": "is_fp8_block_scaling_available"}.get(
        precision.fp8_recipe, "is_fp8_available"
    )
    probe = getattr(te_fp8_state, probe_name, None)
    if probe is not None:
        available, reason = probe()
        if not available:
            raise ConfigError(f"{flag}: Transformer Engine cannot run this recipe here ({reason}): {instead}")
    return impl


def fp8_fields(precision: PrecisionConfig) -> dict:
    """Megatron-LM's FP8 flags as megatron-core TransformerConfig fields (empty without --fp8-format).

    --fp8-format → `fp8`, --fp8-recipe → `fp8_recipe`, --fp8-param-gather → `fp8_param` (Megatron-LM
    feeds the same flag to the DDP config's `fp8_param_gather`). The amax history and how it is reduced
    belong to delayed scaling only: tensorwise scales each tensor from its current amax and blockwise/mxfp8
    per block, and megatron-core ignores the amax fields for them, so they are passed with `delayed` only
    and the config shows what will run.
    """
    if precision.fp8_format is None:
        return {}
    fields = {"fp8": precision.fp8_format, "fp8_recipe": precision.fp8_recipe, "fp8_param": precision.fp8_param_gather}
    if precision.fp8_recipe == "delayed":
        fields["fp8_amax_history_len"] = precision.fp8_amax_history_len
        fields["fp8_amax_compute_algo"] = precision.fp8_amax_compute_algo
    return fields


def transformer_config(
    model: ModelConfig,
    parallel: ParallelConfig,
    precision: PrecisionConfig | None = None,
    fused: bool = False,
    **overrides: object,
) -> TransformerConfig:
    """The megatron-core TransformerConfig for a Llama-style model (overrides: any config field).

    fused: megatron's fused kernels (bias-activation, bias-dropout-add, RoPE, masked softmax, fused
    weight-gradient accumulation), as Megatron-LM enables them by default; they need a GPU with Transformer
    Engine, so the trainer turns them on with the TE implementation only.
    """
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
        bias_activation_fusion=fused,
        bias_dropout_fusion=fused,
        apply_rope_fusion=fused,
        masked_softmax_fusion=fused,
        gradient_accumulation_fusion=fused,
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
    """megatron-core's Transformer Engine layer spec (fused norm+linear, TE attention).

    Still megatron's `TransformerLayer`, with each pre-norm fused into the TE linear after it, so the
    layer's input and output are the residual stream exactly as in the local spec: JREG's hook on
    `TransformerLayer` sees the same bf16 hidden states on both paths (FP8 exists only inside TE's GEMMs).
    """
    if not have_transformer_engine():  # megatron-core would fail with "'NoneType' object is not callable"
        raise ConfigError(
            "the Transformer Engine layer spec needs Transformer Engine, which is not importable here: use "
            "--transformer-impl local, or the NGC PyTorch image (docker/Dockerfile)"
        )
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
