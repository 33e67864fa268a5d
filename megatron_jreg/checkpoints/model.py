"""Any Megatron-LM GPT checkpoint as a one-process model (analyze, evaluate, generate, convert), rebuilt from its
saved args so Megatron-LM's own checkpoints load too; non-finite weights are refused once here for every command."""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import logging
import os
import random
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from megatron_jreg.checkpoints.files import (
    CheckpointError,
    failure_text,
    install_safe_checkpoint_reader,
    resolve,
    verify_integrity,
)
from megatron_jreg.model_files import check_finite_weights

# Transformer Engine fuses each pre-norm into the linear after it; the local spec keeps it separate.
_TE_TO_LOCAL = {f"{te}.layer_norm_{p}": f"{local}.{p}" for p in ("weight", "bias") for te, local in
                (("self_attention.linear_qkv", "input_layernorm"), ("mlp.linear_fc1", "pre_mlp_layernorm"))}


@dataclass
class MegatronModel:
    model: torch.nn.Module  # GPTModel, eval mode
    args: argparse.Namespace  # the checkpoint's Megatron-LM args (parallel sizes as saved)
    iteration: int
    path: Path
    tokenizer: object | None  # megatron_jreg.data.tokenizers.Tokenizer, when the run had one

    @property
    def vocab_size(self) -> int:
        """The true vocabulary (megatron pads its embedding)."""
        if self.tokenizer is not None:
            return int(self.tokenizer.vocab_size)
        return int(self.args.vocab_size or self.args.padded_vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.args.num_layers)

    @property
    def seq_length(self) -> int:
        return int(self.args.seq_length)

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens[b, t] int64 → fp32 logits[b, t, V] over the true vocabulary (padding columns cut)."""
        tokens = tokens.to(next(self.model.parameters()).device)
        position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        out = self.model(tokens, position_ids, None)
        return out[..., : self.vocab_size].float()


# What megatron-core and torch print on every one-process CPU load, by how it starts: the fallbacks for absent
# Transformer Engine/Apex, DCP reading without a process group, deprecations aimed at megatron-core's developers;
# loggers: torch's "No CUDA runtime is found", GPTModel's deprecation, the legacy async-save strategy.
_NOISE_WARNINGS = ("Transformer Engine and Apex are not installed", "Apex is not installed",
                   "Only transformer-engine>=", "torch.distributed is disabled, unavailable or uninitialized",
                   "The argument order of load has been changed", "Please use DTensor instead",
                   "Overriding default arguments for")
_NOISE_LOGGERS = ("torch.utils.cpp_extension", "megatron.core.models.gpt.gpt_model",
                  "megatron.core.dist_checkpointing.strategies.torch")


@contextlib.contextmanager
def quiet_megatron() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _NOISE_LOGGERS]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        for text in _NOISE_WARNINGS:
            warnings.filterwarnings("ignore", message=re.escape(text))
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


@contextlib.contextmanager
def _reading(ckpt: Path, what: str) -> Iterator[None]:
    """What a truncated or corrupt checkpoint raises (many types; DCP's is a BaseException) as one line."""
    try:
        yield
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        raise CheckpointError(f"{ckpt}: cannot read {what} ({failure_text(e)}); the checkpoint is truncated or "
                              "corrupt") from None


def read_args(ckpt: Path) -> argparse.Namespace:
    with quiet_megatron():
        from megatron.core import dist_checkpointing

        install_safe_checkpoint_reader()  # megatron-core's safe globals too
        init_process_group()
    with _reading(ckpt, "the checkpoint's common state"), quiet_megatron():
        common = dist_checkpointing.load_common_state_dict(str(ckpt))
    args = common.get("args") if isinstance(common, dict) else None
    if not isinstance(args, argparse.Namespace) or getattr(args, "num_layers", None) is None:
        raise CheckpointError(f"{ckpt}: holds no Megatron-LM `args` (saved by another tool?); it cannot be rebuilt "
                              "as a GPT model here")
    return args


def run_tokenizer_type(args: argparse.Namespace) -> str | None:
    """The run's --tokenizer-type as `build_tokenizer` takes it (SFTTokenizer: a HuggingFace one + a prompt format)."""
    kind = getattr(args, "tokenizer_type", None)
    return "HuggingFaceTokenizer" if kind == "SFTTokenizer" else kind


def tokenizer_options(args: argparse.Namespace) -> dict:
    """`build_tokenizer`'s options from a run's saved tokenizer flags (each tokenizer reads its own)."""
    options = {name.removeprefix("tokenizer_"): name for name in (
        "tiktoken_pattern", "tiktoken_num_special_tokens", "vocab_size", "special_tokens",
        "tokenizer_sentencepiece_legacy", "tokenizer_sentencepiece_ignore_extra_whitespaces")}
    kwargs = {ours: getattr(args, name) for ours, name in options.items() if getattr(args, name, None) is not None}
    if getattr(args, "tokenizer_hf_no_include_special_tokens", False):
        kwargs["include_special_tokens"] = False
    return kwargs


def tokenizer_from_args(args: argparse.Namespace, tokenizer_model: str | None = None):
    """The run's tokenizer from its saved options; not Megatron-LM's builder, which fetches gpt2 from the Hub and may
    run a tokenizer's code."""
    from megatron_jreg.data.tokenizers import build_tokenizer

    kind = run_tokenizer_type(args)
    if kind in (None, "NullTokenizer"):
        return None if tokenizer_model is None else _given_tokenizer(args, tokenizer_model)
    model = tokenizer_model or getattr(args, "tokenizer_model", None)
    try:
        return build_tokenizer(kind, model, getattr(args, "vocab_file", None), getattr(args, "merge_file", None),
                               **tokenizer_options(args))
    except (ValueError, OSError, KeyError) as e:
        raise CheckpointError(f"tokenizer of the run ({kind} {model}): {e}; pass the tokenizer's current path "
                              "(--tokenizer)") from None


def _given_tokenizer(args: argparse.Namespace, folder: str):
    from megatron_jreg.data.tokenizers import build_tokenizer

    try:
        tokenizer = build_tokenizer("HuggingFaceTokenizer", folder)
    except (ValueError, OSError, KeyError) as e:
        raise CheckpointError(f"--tokenizer {folder}: {e}; give a Hugging Face tokenizer folder") from None
    rows = getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None)
    if rows and tokenizer.vocab_size > rows:
        raise CheckpointError(f"--tokenizer {folder}: {tokenizer.vocab_size} tokens, but the model (trained on mock "
                              f"data) embeds {rows}: give a tokenizer of at most {rows} tokens")
    return tokenizer


def _inference_args(args: argparse.Namespace, dtype: torch.dtype) -> argparse.Namespace:
    from megatron_jreg.compat import CUDA_KERNELS

    a = copy.deepcopy(args)
    for value, names in (
        (1, ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
             "expert_model_parallel_size", "expert_tensor_parallel_size", "data_parallel_size", "world_size")),
        (None, ("virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
                "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                "pipeline_model_parallel_layout", "recompute_granularity", "recompute_method", "fp8", "fp4", "spec",
                "yaml_cfg")),
        (False, (*CUDA_KERNELS, "sequence_parallel", "persist_layer_norm", "tp_comm_overlap", "fp8_param_gather",
                 "cross_entropy_loss_fusion", "account_for_embedding_in_pipeline_split",
                 "account_for_loss_in_pipeline_split")),
    ):
        for name in names:
            if hasattr(a, name):
                setattr(a, name, value)
    a.transformer_impl = "local"
    a.no_persist_layer_norm = a.use_cpu_initialization = True
    a.params_dtype = dtype
    a.bf16, a.fp16 = dtype == torch.bfloat16, dtype == torch.float16
    a.attention_dropout = a.hidden_dropout = 0.0
    return a


def build_model(args: argparse.Namespace, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A TP=1/PP=1 GPTModel for the (saved) Megatron-LM args, its weights not loaded."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.training.argument_utils import core_transformer_config_from_args, gpt_config_from_args
    from megatron.training.models.gpt import GPTModelBuilder

    from megatron_jreg.layer_spec import model_layer_spec

    with quiet_megatron():
        init_process_group()
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel()
        seed = int(getattr(args, "seed", 1234) or 1234)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        a = _inference_args(args, dtype)
        try:
            model_cfg = gpt_config_from_args(a, core_transformer_config_from_args(a))
        except (AssertionError, ValueError, TypeError, AttributeError) as e:
            raise CheckpointError(f"the checkpoint's args do not describe a GPT model megatron-core can build here "
                                  f"({' '.join(str(e).split())[:200]})") from None
        model_cfg.transformer_layer_spec = model_layer_spec(bool(getattr(args, "layernorm_scaling", False)))
        model = GPTModelBuilder(model_cfg).build_model(ProcessGroupCollection.use_mpu_process_groups(),
                                                        pre_process=True, post_process=True)
        return model.to(dtype)


def _request(model: torch.nn.Module, ckpt: Path) -> dict:
    """The model's sharded state dict with local-spec keys renamed where the checkpoint has TE's."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    saved = set(dist_checkpointing.load_tensors_metadata(str(ckpt)).keys())
    sharded = model.sharded_state_dict()
    for value in sharded.values():
        if not isinstance(value, ShardedTensor) or value.key in saved:
            continue
        for te, local in _TE_TO_LOCAL.items():
            if value.key.endswith(local):
                candidate = value.key[: -len(local)] + te
                if candidate in saved:
                    value.key = candidate
    missing = sorted(v.key for v in sharded.values() if isinstance(v, ShardedTensor) and v.key not in saved)
    if missing:
        raise CheckpointError(f"{ckpt}: weights missing from the checkpoint: {', '.join(missing[:5])}"
                              f"{' …' if len(missing) > 5 else ''} (the saved args do not match the saved weights)")
    return sharded


@dataclass(frozen=True)
class Checkpoint:
    """One Megatron-LM checkpoint, resolved and verified once; its model on request."""

    directory: Path  # the iter_*/release folder
    iteration: int
    args: argparse.Namespace  # Megatron-LM's args as saved (parallel sizes as trained)

    @classmethod
    def open(cls, path: str | Path, iteration: int | None = None, verify: bool = True) -> Checkpoint:
        ckpt, iteration = resolve(path, iteration)
        if verify:
            verify_integrity(ckpt)
        return cls(ckpt, iteration, read_args(ckpt))

    def load_model(self, dtype: torch.dtype = torch.float32, tokenizer_model: str | None = None,
                   load_tokenizer: bool = True) -> MegatronModel:
        """The weights in a one-process TP=1/PP=1 model (load_tokenizer=False: weights whose tokenizer moved)."""
        ckpt, args = self.directory, self.args
        with quiet_megatron():
            tokenizer = tokenizer_from_args(args, tokenizer_model) if load_tokenizer else None
            model = build_model(args, dtype)
            if torch.cuda.is_available():
                model = model.cuda()
            self._load_weights(model)
        check_finite_weights(model.named_parameters(), f"{ckpt}")
        model.eval()
        return MegatronModel(model, args, self.iteration, ckpt, tokenizer)

    def _load_weights(self, model: torch.nn.Module) -> None:
        from megatron.core import dist_checkpointing

        ckpt = self.directory
        request = _request(model, ckpt)
        with _reading(ckpt, "the weights"):
            loaded = dist_checkpointing.load({"model": request}, str(ckpt))
        result = model.load_state_dict(loaded["model"], strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise CheckpointError(f"{ckpt}: weights do not match the model (missing {missing[:5]}, unexpected "
                                  f"{result.unexpected_keys[:5]})")


def load_megatron_model(path: str | Path, iteration: int | None = None, dtype: torch.dtype = torch.float32,
                        tokenizer_model: str | None = None, load_tokenizer: bool = True,
                        verify: bool = True) -> MegatronModel:
    return Checkpoint.open(path, iteration, verify).load_model(dtype, tokenizer_model, load_tokenizer)


# -- one-process megatron-core -------------------------------------------------------------------------
def init_process_group() -> None:
    from megatron_jreg.compat import apply_cpu_compat, dist_backend

    apply_cpu_compat()
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(dist_backend(), store=one_process_store(), rank=int(os.environ.get("RANK", 0)),
                            world_size=int(os.environ.get("WORLD_SIZE", 1)), timeout=datetime.timedelta(minutes=30))


def one_process_store() -> dist.Store | None:
    """An in-process store for a world of one: processes started side by side cannot race for a TCP port."""
    return dist.HashStore() if os.environ.get("WORLD_SIZE", "1") == "1" and not dist.is_initialized() else None

