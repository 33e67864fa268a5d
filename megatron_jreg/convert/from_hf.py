"""Hugging Face Llama folder → megatron-jreg checkpoint (weights only) for `megatron-jreg train --load
OUT --finetune` (continued pretraining with JREG), `megatron-jreg analyze` and `load_megatron_model`.

A dist_checkpointing checkpoint is layout-free: every tensor is stored by global key and shape and is
resharded on load. So the checkpoint is written once, by this one process, from a TP=1/PP=1 GPTModel,
and loads at any TP/PP; the requested TP/PP are validated against the model and recorded in
megatron_jreg.json. That file describes the model (ModelConfig from config.json) and its tokenizer (the
folder's own), which is how every tool rebuilds it.
"""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

import torch

from megatron_jreg.config import ModelConfig, ParallelConfig, PrecisionConfig, TrainConfig
from megatron_jreg.convert import hf_io, llama
from megatron_jreg.convert.verify import (
    Verification,
    compare_logits,
    hf_logits_fn,
    probe_tokens,
    should_verify,
    single_process,
    staged_output,
)

ITERATION = 0  # an import is a starting point, not a training iteration


@dataclasses.dataclass
class ImportResult:
    output: Path
    config: TrainConfig
    verification: Verification | None
    notes: list[str]


def run_config_for(folder: Path, model: ModelConfig, parallel: ParallelConfig,
                   dtype: torch.dtype) -> tuple[TrainConfig, list[str]]:
    """The TrainConfig stored with the checkpoint: model, requested layout, precision, the folder's tokenizer."""
    cfg = TrainConfig(model=model, parallel=parallel,
                      precision=PrecisionConfig(bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16))
    notes = []
    tokenizer = hf_io.hf_tokenizer_flags(folder)
    if tokenizer is None:
        cfg.data.vocab_size = model.vocab_size
        notes.append(f"{folder} has no tokenizer: train with --tokenizer-type/--tokenizer-model of your own")
        return cfg, notes
    cfg.data.tokenizer_type, cfg.data.tokenizer_model = tokenizer
    from megatron_jreg.data.tokenizers import build_tokenizer

    size = build_tokenizer(*tokenizer).vocab_size
    if size != model.vocab_size:
        notes.append(
            f"the tokenizer has {size} tokens and the embedding {model.vocab_size} rows: `megatron-jreg train` "
            f"sizes the vocabulary from the tokenizer, so it loads the first {size} rows only"
        )
    return cfg, notes


def train_flags(cfg: TrainConfig, output: Path) -> list[str]:
    """`megatron-jreg train` flags that rebuild this model from the checkpoint (architecture flags are not
    read from checkpoints, as in Megatron-LM without --use-checkpoint-args)."""
    m, p = cfg.model, cfg.parallel
    flags = [
        "--load", str(output), "--finetune",
        "--num-layers", m.num_layers, "--hidden-size", m.hidden_size, "--ffn-hidden-size", m.ffn_hidden_size,
        "--num-attention-heads", m.num_attention_heads, "--num-query-groups", m.num_query_groups,
        "--seq-length", m.seq_length, "--max-position-embeddings", m.max_position_embeddings,
        "--rotary-base", m.rotary_base, "--norm-epsilon", m.norm_epsilon,
        "--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by,
        "--tensor-model-parallel-size", p.tensor_model_parallel_size,
        "--pipeline-model-parallel-size", p.pipeline_model_parallel_size,
    ]
    if m.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    if cfg.data.tokenizer_type:
        flags += ["--tokenizer-type", cfg.data.tokenizer_type, "--tokenizer-model", cfg.data.tokenizer_model]
    if cfg.precision.bf16 or cfg.precision.fp16:
        flags.append("--bf16" if cfg.precision.bf16 else "--fp16")
    return [str(f) for f in flags]


@torch.no_grad()
def _load_parameters(gpt: torch.nn.Module, mapped: dict[str, torch.Tensor]) -> None:
    """Copy the mapped tensors into the GPTModel's parameters, one for one and shape for shape (a
    disagreement between the mapping and the model builder is a bug here, not a user error)."""
    params = dict(gpt.named_parameters())
    if sorted(params) != sorted(mapped):
        raise RuntimeError(f"mapping/model mismatch: {sorted(set(params) ^ set(mapped))[:5]}")
    for name, param in params.items():
        if param.shape != mapped[name].shape:
            raise RuntimeError(f"{name}: GPTModel has {tuple(param.shape)}, mapping gives {tuple(mapped[name].shape)}")
        param.copy_(mapped[name])
    mapped.clear()


def hf_to_mcore(
    hf: str | Path,
    output: str | Path,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    seq_length: int | None = None,
    make_vocab_size_divisible_by: int = 128,
    verify: bool | None = None,
    threshold: float | None = None,
) -> ImportResult:
    """Import a Hugging Face Llama folder as a weights-only megatron-jreg checkpoint (module docstring).

    Everything that can refuse (architecture, layout, unknown tensors) runs before anything is written;
    the checkpoint appears at `output` only after its logits matched the Hugging Face model's.
    """
    from megatron_jreg.training.checkpoint import save_checkpoint
    from megatron_jreg.training.distributed import init_model_parallel, init_process_group
    from megatron_jreg.training.inference import load_megatron_model
    from megatron_jreg.training.model import build_model_chunks, transformer_config

    single_process()
    folder = Path(hf)
    hf_cfg = hf_io.read_config(folder)
    model = llama.model_config_from_hf(hf_cfg, seq_length)
    model.make_vocab_size_divisible_by = make_vocab_size_divisible_by
    parallel = ParallelConfig(tensor_model_parallel_size=tensor_model_parallel_size,
                              pipeline_model_parallel_size=pipeline_model_parallel_size)
    model.validate()
    parallel.validate(model, tensor_model_parallel_size * pipeline_model_parallel_size)
    state = hf_io.load_weights(folder)
    dtype = hf_io.checkpoint_dtype(hf_cfg, state)
    padded = model.padded_vocab_size(1)
    mapped = llama.hf_to_megatron(state, model, padded)
    del state
    cfg, notes = run_config_for(folder, model, parallel, dtype)
    if not model.untie_embeddings_and_output_weights:
        notes.append("tied embeddings: `megatron-jreg train` has no flag that builds a tied model yet, so its "
                     "--load would build an untied one (load_megatron_model and analyze read the checkpoint's "
                     "own config and are fine)")

    with staged_output(Path(output)) as tmp:
        init_process_group()
        one = ParallelConfig()
        init_model_parallel(model, one, cfg.seed)
        precision = PrecisionConfig(bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
        tconfig = transformer_config(model, one, precision, perform_initialization=False)
        (gpt,) = build_model_chunks(tconfig, model, padded, "local")
        _load_parameters(gpt, mapped)
        save_checkpoint(tmp, ITERATION, [gpt], None, None, 0, dataclasses.asdict(cfg))
        del gpt
        gc.collect()
        verification = None
        run, why = should_verify(verify, llama.num_parameters(model))
        if run:
            loaded = load_megatron_model(tmp, ITERATION, torch.float32)
            device = next(loaded.model.parameters()).device
            tokens = probe_tokens(int(model.vocab_size), model.seq_length)
            verification = compare_logits(hf_logits_fn(folder, device), loaded.logits, tokens, threshold)
        else:
            notes.append(why)
    return ImportResult(Path(output), cfg, verification, notes)
