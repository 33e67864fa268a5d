"""`megatron-jreg train` flags (Megatron-LM's `pretrain_gpt.py` names) → `TrainConfig`.

Each flag is declared once with the config section and field it fills. Model flags default to None so a
`--model-preset` fills them first and explicit flags override the preset.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

from megatron_jreg.config import PRESETS, ConfigError, TrainConfig

# (flag, section, field, argparse kwargs). section None = top-level TrainConfig field.
FLAGS: list[tuple[str, str | None, str, dict[str, Any]]] = [
    # model
    ("--num-layers", "model", "num_layers", {"type": int}),
    ("--hidden-size", "model", "hidden_size", {"type": int}),
    ("--ffn-hidden-size", "model", "ffn_hidden_size", {"type": int}),
    ("--num-attention-heads", "model", "num_attention_heads", {"type": int}),
    ("--num-query-groups", "model", "num_query_groups", {"type": int}),
    ("--seq-length", "model", "seq_length", {"type": int}),
    ("--max-position-embeddings", "model", "max_position_embeddings", {"type": int}),
    ("--position-embedding-type", "model", "position_embedding_type", {"choices": ["rope", "learned_absolute"]}),
    ("--rotary-base", "model", "rotary_base", {"type": int}),
    ("--normalization", "model", "normalization", {"choices": ["RMSNorm", "LayerNorm"]}),
    ("--norm-epsilon", "model", "norm_epsilon", {"type": float}),
    ("--swiglu", "model", "swiglu", {"action": "store_true", "default": None}),
    ("--disable-bias-linear", "model", "disable_bias_linear", {"action": "store_true", "default": None}),
    ("--untie-embeddings-and-output-weights", "model", "untie_embeddings_and_output_weights",
     {"action": "store_true", "default": None}),
    ("--init-method-std", "model", "init_method_std", {"type": float}),
    ("--make-vocab-size-divisible-by", "model", "make_vocab_size_divisible_by", {"type": int}),
    # parallelism
    ("--tensor-model-parallel-size", "parallel", "tensor_model_parallel_size", {"type": int, "default": 1}),
    ("--pipeline-model-parallel-size", "parallel", "pipeline_model_parallel_size", {"type": int, "default": 1}),
    ("--num-layers-per-virtual-pipeline-stage", "parallel", "num_layers_per_virtual_pipeline_stage",
     {"type": int}),
    ("--decoder-first-pipeline-num-layers", "parallel", "decoder_first_pipeline_num_layers", {"type": int}),
    ("--decoder-last-pipeline-num-layers", "parallel", "decoder_last_pipeline_num_layers", {"type": int}),
    ("--sequence-parallel", "parallel", "sequence_parallel", {"action": "store_true"}),
    ("--context-parallel-size", "parallel", "context_parallel_size", {"type": int, "default": 1}),
    ("--use-distributed-optimizer", "parallel", "use_distributed_optimizer", {"action": "store_true"}),
    ("--overlap-grad-reduce", "parallel", "overlap_grad_reduce", {"action": "store_true"}),
    ("--overlap-param-gather", "parallel", "overlap_param_gather", {"action": "store_true"}),
    # optimization
    ("--micro-batch-size", "optim", "micro_batch_size", {"type": int, "default": 1}),
    ("--global-batch-size", "optim", "global_batch_size", {"type": int}),
    ("--train-iters", "optim", "train_iters", {"type": int, "required": True}),
    ("--lr", "optim", "lr", {"type": float, "default": 3e-4}),
    ("--min-lr", "optim", "min_lr", {"type": float, "default": 0.0}),
    ("--lr-warmup-iters", "optim", "lr_warmup_iters", {"type": int, "default": 0}),
    ("--lr-decay-iters", "optim", "lr_decay_iters", {"type": int}),
    ("--lr-decay-style", "optim", "lr_decay_style", {"default": "cosine"}),
    ("--weight-decay", "optim", "weight_decay", {"type": float, "default": 0.1}),
    ("--adam-beta1", "optim", "adam_beta1", {"type": float, "default": 0.9}),
    ("--adam-beta2", "optim", "adam_beta2", {"type": float, "default": 0.95}),
    ("--adam-eps", "optim", "adam_eps", {"type": float, "default": 1e-8}),
    ("--clip-grad", "optim", "clip_grad", {"type": float, "default": 1.0}),
    ("--calculate-per-token-loss", "optim", "calculate_per_token_loss", {"action": "store_true"}),
    ("--recompute-granularity", "optim", "recompute_granularity", {"choices": ["full", "selective"]}),
    ("--recompute-method", "optim", "recompute_method", {"choices": ["uniform", "block"]}),
    ("--recompute-num-layers", "optim", "recompute_num_layers", {"type": int}),
    ("--initial-loss-scale", "optim", "initial_loss_scale", {"type": float, "default": 2.0**16}),
    # precision / kernels
    ("--bf16", "precision", "bf16", {"action": "store_true"}),
    ("--fp16", "precision", "fp16", {"action": "store_true"}),
    ("--transformer-impl", "precision", "transformer_impl", {"choices": ["transformer_engine", "local"]}),
    ("--fp8-format", "precision", "fp8_format", {"choices": ["e4m3", "hybrid"]}),
    ("--fp8-recipe", "precision", "fp8_recipe",
     {"choices": ["delayed", "tensorwise", "mxfp8", "blockwise"], "default": "delayed"}),
    ("--fp8-amax-history-len", "precision", "fp8_amax_history_len", {"type": int, "default": 1024}),
    ("--fp8-amax-compute-algo", "precision", "fp8_amax_compute_algo",
     {"choices": ["max", "most_recent"], "default": "max"}),
    ("--fp8-param-gather", "precision", "fp8_param_gather", {"action": "store_true"}),
    # data
    ("--data-path", "data", "data_path", {"nargs": "+"}),
    ("--train-data-path", "data", "train_data_path", {"nargs": "+"}),
    ("--valid-data-path", "data", "valid_data_path", {"nargs": "+"}),
    ("--test-data-path", "data", "test_data_path", {"nargs": "+"}),
    ("--split", "data", "split", {"default": "969,30,1"}),
    ("--mock-data", "data", "mock_data", {"action": "store_true"}),
    ("--tokenizer-type", "data", "tokenizer_type", {}),
    ("--tokenizer-model", "data", "tokenizer_model", {}),
    ("--vocab-file", "data", "vocab_file", {}),
    ("--merge-file", "data", "merge_file", {}),
    ("--vocab-size", "data", "vocab_size", {"type": int}),
    ("--data-cache-path", "data", "data_cache_path", {}),
    ("--eod-mask-loss", "data", "eod_mask_loss", {"action": "store_true"}),
    ("--reset-position-ids", "data", "reset_position_ids", {"action": "store_true"}),
    ("--reset-attention-mask", "data", "reset_attention_mask", {"action": "store_true"}),
    # checkpointing
    ("--save", "checkpoint", "save", {}),
    ("--load", "checkpoint", "load", {}),
    ("--save-interval", "checkpoint", "save_interval", {"type": int}),
    ("--no-load-optim", "checkpoint", "no_load_optim", {"action": "store_true"}),
    ("--no-load-rng", "checkpoint", "no_load_rng", {"action": "store_true"}),
    ("--finetune", "checkpoint", "finetune", {"action": "store_true"}),
    ("--no-exit-signal-handler", "checkpoint", "exit_signal_handler", {"action": "store_false"}),
    ("--exit-interval", "checkpoint", "exit_interval", {"type": int}),
    # logging and evaluation
    ("--log-interval", "logging", "log_interval", {"type": int, "default": 10}),
    ("--eval-interval", "logging", "eval_interval", {"type": int, "default": 1000}),
    ("--eval-iters", "logging", "eval_iters", {"type": int, "default": 10}),
    ("--tensorboard-dir", "logging", "tensorboard_dir", {}),
    ("--wandb-project", "logging", "wandb_project", {}),
    ("--wandb-exp-name", "logging", "wandb_exp_name", {}),
    ("--wandb-save-dir", "logging", "wandb_save_dir", {}),
    ("--metrics-file", "logging", "metrics_file", {}),
    ("--skip-train", "logging", "skip_train", {"action": "store_true"}),
    ("--progress", "logging", "progress", {"action": argparse.BooleanOptionalAction, "default": None}),
    # JREG
    ("--jreg-lambda", "jreg", "lam", {"type": float, "default": 0.0}),
    ("--jreg-alpha", "jreg", "alpha", {"type": float, "default": 1.0}),
    ("--jreg-distance", "jreg", "distance", {"choices": ["angular", "cosine"], "default": "angular"}),
    ("--jreg-layers", "jreg", "layers", {"type": int, "nargs": "+"}),
    # run
    ("--seed", None, "seed", {"type": int, "default": 1234}),
    ("--init-mode", None, "init_mode",
     {"choices": ["layout-independent", "megatron"], "default": "layout-independent"}),
    ("--model-preset", None, "preset", {"choices": sorted(PRESETS)}),
]

HELP = {
    "--jreg-lambda": "λ of the JREG penalty (0 = plain baseline)",
    "--jreg-alpha": "α of the layer weights w_ℓ = softmax(α·ℓ); the paper's best is 1.0",
    "--jreg-distance": "displacement: angular = arccos(cos)/π (paper), cosine = 1 − cos (smooth)",
    "--jreg-layers": "penalize only these global layers (1-based); default all",
    "--model-preset": "fill the architecture from the paper (12×768, 16×2048, 30×3072); flags override",
    "--init-mode": "layout-independent: the same seed gives the same weights at any TP/PP layout",
    "--metrics-file": "write one JSON object per logged iteration (and validation) to this file",
    "--no-exit-signal-handler": "do not save-and-exit on SIGTERM (Slurm preemption)",
    "--data-path": "indexed dataset prefix(es), optionally weighted: W1 PREFIX1 W2 PREFIX2",
    "--skip-train": "load the checkpoint, evaluate on the validation split once and exit",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-jreg train",
        description="Pretrain a Llama-style GPT on megatron-core with the Jump-Suppressing Regularizer.",
    )
    groups: dict[str | None, argparse._ArgumentGroup] = {}
    for flag, section, name, kwargs in FLAGS:
        group = groups.setdefault(section, parser.add_argument_group(section or "run"))
        group.add_argument(flag, dest=f"{section or 'run'}.{name}", help=HELP.get(flag), **kwargs)
    # Megatron-LM compatibility: accepted, implied by --num-query-groups
    parser.add_argument("--group-query-attention", action="store_true", help=argparse.SUPPRESS)
    return parser


def config_from_args(argv: list[str] | None) -> TrainConfig:
    """Parse flags into a TrainConfig (not yet validated against the world size)."""
    ns = vars(build_parser().parse_args(argv))
    cfg = TrainConfig()
    preset = ns.get("run.preset")
    if preset is not None:
        cfg.model = copy.deepcopy(PRESETS[preset].model)
    model_values = {}
    for key, value in ns.items():
        if "." not in key:
            continue
        section, name = key.split(".", 1)
        if section == "model":
            if value is not None:
                model_values[name] = value
            continue
        target = cfg if section == "run" else getattr(cfg, section)
        setattr(target, name, value)
    for name, value in model_values.items():
        setattr(cfg.model, name, value)
    if "ffn_hidden_size" not in model_values and preset is None:
        cfg.model.ffn_hidden_size = None
    if "max_position_embeddings" not in model_values:
        cfg.model.max_position_embeddings = None
    cfg.model.__post_init__()  # derived defaults (FFN width, max positions) after overrides
    if ns.get("run.preset") is None and "num_layers" not in model_values:
        raise ConfigError("give the architecture: --model-preset NAME or --num-layers/--hidden-size/...")
    return cfg
