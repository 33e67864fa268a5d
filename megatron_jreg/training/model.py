"""The model provider: Megatron-LM's GPT config with our layer spec and init hook, through its builder's extension
points only; Transformer Engine / FP8 that cannot run here stops before any work."""

from __future__ import annotations

import argparse

import torch

from megatron_jreg.errors import UsageError
from megatron_jreg.layer_spec import have_transformer_engine, model_layer_spec


def _have_apex() -> bool:
    try:
        import apex  # noqa: F401
        from apex.normalization import FusedLayerNorm  # noqa: F401 - not PyPI's unrelated "apex"
    except (ImportError, OSError):
        return False
    return True


def check_transformer_impl(args: argparse.Namespace) -> None:
    """Transformer Engine layers and FP8 that cannot run here stop with what is missing and what to use."""
    have_te = have_transformer_engine()
    if args.transformer_impl == "transformer_engine" and not have_te:
        raise UsageError(
            "--transformer-impl transformer_engine (Megatron-LM's default): Transformer Engine is not importable "
            "here; use the NGC PyTorch image (docker/Dockerfile) or add --transformer-impl local "
            "--no-gradient-accumulation-fusion --no-rope-fusion --no-masked-softmax-fusion (no flash attention)"
        )
    if torch.cuda.is_available() and not have_te:
        # Megatron-LM's default-on fused kernels that come from TE/apex or a CUDA extension the wheel lacks:
        # without them the run dies inside megatron-core (at the layer build or the first step).
        fused = [flag for name, flag in (("gradient_accumulation_fusion", "--no-gradient-accumulation-fusion"),
                                         ("apply_rope_fusion", "--no-rope-fusion"),
                                         ("masked_softmax_fusion", "--no-masked-softmax-fusion"))
                 if getattr(args, name, False)]
        if fused and not _have_apex():
            raise UsageError(f"Megatron-LM's fused kernels need Transformer Engine or apex, which are not installed: "
                             f"add {' '.join(fused)}")
        if args.use_cpu_initialization:
            raise UsageError("--use-cpu-initialization leaves megatron-core 0.19.2's model on the CPU of a GPU "
                             "machine: drop it (--init-mode layout-independent gives layout-free weights)")
    if args.fp8 is None:
        return
    flag = f"--fp8-format {args.fp8} --fp8-recipe {args.fp8_recipe}"
    if args.transformer_impl != "transformer_engine":
        raise UsageError(
            f"{flag}: FP8 runs inside Transformer Engine's layers and --transformer-impl {args.transformer_impl} "
            "was given; use --transformer-impl transformer_engine on the NGC PyTorch image, or drop --fp8-format"
        )
    if not (args.bf16 or args.fp16):
        raise UsageError(f"{flag}: FP8 runs the matmuls around --bf16 (or --fp16) weights and activations: add --bf16")
    min_te, min_cc, gpus, instead = {
        "delayed": (None, (8, 9), "Ada, Hopper or newer", "train in --bf16"),
        "tensorwise": ("2.2.0.dev0", (8, 9), "Ada, Hopper or newer", "train in --bf16"),
        "blockwise": ("2.3.0.dev0", (9, 0), "Hopper or newer", "use --fp8-recipe delayed or tensorwise"),
        "mxfp8": ("2.1.0", (10, 0), "Blackwell", "use --fp8-recipe delayed, tensorwise or blockwise"),
    }.get(args.fp8_recipe, (None, (8, 9), "Ada, Hopper or newer", "train in --bf16"))
    if not torch.cuda.is_available():
        raise UsageError(f"{flag} needs an FP8-capable GPU ({gpus}) and no CUDA device is visible here: {instead}")
    cc = tuple(torch.cuda.get_device_capability())
    if cc < min_cc:
        raise UsageError(f"{flag} needs a GPU of compute capability >= {min_cc[0]}.{min_cc[1]} ({gpus}); "
                         f"{torch.cuda.get_device_name()} is {cc[0]}.{cc[1]}: {instead}")
    from megatron.core import utils as mcore_utils

    if min_te is not None and not mcore_utils.is_te_min_version(min_te):
        raise UsageError(f"{flag} needs Transformer Engine >= {min_te} and this one is "
                         f"{mcore_utils.get_te_version()}: use a newer NGC PyTorch image or --fp8-recipe delayed")
    try:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager as te_fp8_state
    except (ImportError, OSError):
        te_fp8_state = None
    probe_name = {"mxfp8": "is_mxfp8_available", "blockwise": "is_fp8_block_scaling_available"}.get(
        args.fp8_recipe, "is_fp8_available")
    probe = getattr(te_fp8_state, probe_name, None)
    if probe is not None:
        available, reason = probe()
        if not available:
            raise UsageError(f"{flag}: Transformer Engine cannot run this recipe here ({reason}): {instead}")


def gpt_model_config(args: argparse.Namespace):
    """Megatron-LM's GPTModelConfig (pretrain_gpt.py:517-521 at core_v0.19.0) with our spec and init hook."""
    from megatron.training.argument_utils import gpt_config_from_args

    cfg = gpt_config_from_args(args)
    if (args.sft or args.dataloader_inter_document_masking) and args.pipeline_model_parallel_size > 1 \
            and args.micro_batch_size > 1:
        # Packed microbatches travel flattened, [micro-batch × seq-length, 1, hidden], but the pipeline's
        # receive buffers are sized [seq-length, micro-batch, hidden] (the same numel, another layout):
        # megatron-core's variable-sequence-length p2p sends the shape with each tensor.
        cfg.transformer.variable_seq_lengths = True
    if args.spec is None:
        cfg.transformer_layer_spec = model_layer_spec(args.layernorm_scaling)
    if args.init_mode == "layout-independent":
        from megatron_jreg.training.sharding import init_layout_independent

        def init(chunks: list) -> list:
            init_layout_independent(chunks, chunks[0].config, args.seed)
            return chunks

        cfg.pre_wrap_hooks.append(init)
    return cfg
