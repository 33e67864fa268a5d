"""Hugging Face Llama folder → Megatron-LM release checkpoint, so continued pretraining with JREG (or
Megatron-LM's own pretrain_gpt.py) starts from a public model; one TP=1/PP=1 write loads at any layout."""

from __future__ import annotations

import argparse
import dataclasses
import gc
from pathlib import Path

import torch

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
from megatron_jreg.fileio import write_json


@dataclasses.dataclass
class ImportResult:
    output: Path
    flags: list[str]  # Megatron-LM flags that rebuild this model (architecture, tokenizer, layout)
    verification: Verification | None
    notes: list[str]


def _tokenizer(folder: Path) -> tuple[list[str], int | None, list[str]]:
    """(--tokenizer-* flags of the folder's own tokenizer, its vocabulary size, notes)."""
    if (folder / "tokenizer.json").is_file():
        found = "HuggingFaceTokenizer", str(folder.resolve())
    elif (folder / "tokenizer.model").is_file():
        found = "SentencePieceTokenizer", str((folder / "tokenizer.model").resolve())
    else:  # Megatron-LM's NullTokenizer then takes --vocab-size (added by the caller)
        return ["--tokenizer-type", "NullTokenizer"], None, [
            f"{folder} has no tokenizer: train with --tokenizer-type/--tokenizer-model of your own"]
    from megatron_jreg.data.tokenizers import build_tokenizer

    return ["--tokenizer-type", found[0], "--tokenizer-model", found[1]], build_tokenizer(*found).vocab_size, []


@torch.no_grad()
def _load_parameters(gpt: torch.nn.Module, mapped: dict[str, torch.Tensor]) -> None:
    """The mapped tensors into the GPTModel's parameters (a mismatch is a bug here, not a user error)."""
    params = dict(gpt.named_parameters())
    if sorted(params) != sorted(mapped):
        raise RuntimeError(f"mapping/model mismatch: {sorted(set(params) ^ set(mapped))[:5]}")
    for name, param in params.items():
        if param.shape != mapped[name].shape:
            raise RuntimeError(f"{name}: GPTModel has {tuple(param.shape)}, mapping gives {tuple(mapped[name].shape)}")
        param.copy_(mapped[name])
    mapped.clear()


def save_release_checkpoint(output: Path, model: torch.nn.Module, args: argparse.Namespace, provenance: dict) -> Path:
    from megatron.core import dist_checkpointing

    from megatron_jreg.checkpoints.files import write_integrity
    from megatron_jreg.checkpoints.model import quiet_megatron

    ckpt = output / "release"
    ckpt.mkdir(parents=True)
    state = {"model": model.sharded_state_dict(), "args": args, "checkpoint_version": 3.0, "iteration": 0}
    with quiet_megatron():
        dist_checkpointing.save(state, str(ckpt))
    write_json(ckpt / "megatron_jreg.json", provenance)
    write_integrity(ckpt)
    (output / "latest_checkpointed_iteration.txt").write_text("release")
    return ckpt


def machine_flags() -> list[str]:
    """The `train` flags this machine needs whatever the model (training.model.check_transformer_impl's rules)."""
    from megatron_jreg.layer_spec import have_transformer_engine

    if have_transformer_engine():
        return []
    flags = ["--transformer-impl", "local"]
    if torch.cuda.is_available():
        flags += ["--no-gradient-accumulation-fusion", "--no-rope-fusion", "--no-masked-softmax-fusion"]
    return flags


def hf_to_mcore(
    hf: str | Path, output: str | Path, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
    seq_length: int | None = None, make_vocab_size_divisible_by: int = 128, verify: bool | None = None,
    threshold: float | None = None,
) -> ImportResult:
    """A Hugging Face Llama folder as a release checkpoint; `output` appears only after its logits matched."""
    from megatron_jreg.checkpoints.model import build_model, load_megatron_model, quiet_megatron
    from megatron_jreg.model_files import check_finite_weights, read_config

    single_process()
    folder = Path(hf)
    hf_cfg = read_config(folder, "--hf")
    arch = llama.LlamaArch.from_hf(hf_cfg, seq_length)
    layout = ["--tensor-model-parallel-size", str(tensor_model_parallel_size), "--pipeline-model-parallel-size",
              str(pipeline_model_parallel_size), "--make-vocab-size-divisible-by", str(make_vocab_size_divisible_by)]
    with quiet_megatron():  # Megatron-LM's arguments and tokenizer defaults import megatron-core
        from megatron_jreg.checkpoints.args import model_args

        tokenizer, tokens_in_tokenizer, notes = _tokenizer(folder)
        flags = arch.megatron_flags() + tokenizer + layout
        args = model_args(flags, arch.vocab_size, tensor_model_parallel_size * pipeline_model_parallel_size)
    state = hf_io.load_weights(folder)
    check_finite_weights(state.items(), f"--hf {folder}")
    dtype = hf_io.checkpoint_dtype(hf_cfg, state)
    args.bf16, args.fp16 = dtype == torch.bfloat16, dtype == torch.float16
    mapped = llama.hf_to_megatron(state, arch, args.padded_vocab_size)
    del state
    if not arch.untie_embeddings_and_output_weights:
        notes.append("tied embeddings (Megatron-LM's default): train without --untie-embeddings-and-output-weights")
    with staged_output(Path(output)) as tmp:
        gpt = build_model(args, dtype)
        _load_parameters(gpt, mapped)
        save_release_checkpoint(tmp, gpt, args, {"source": "hf-to-mcore", "hf": str(folder.resolve())})
        del gpt
        gc.collect()
        verification = None
        run, why = should_verify(verify, arch.num_parameters())
        if run:
            loaded = load_megatron_model(tmp, dtype=torch.float32)
            device = next(loaded.model.parameters()).device
            tokens = probe_tokens(arch.vocab_size, arch.seq_length)
            verification = compare_logits(hf_logits_fn(folder, device), loaded.logits, tokens, threshold,
                                          depth=arch.num_layers)
        else:
            notes.append(why)
    extra = (["--bf16"] if args.bf16 else ["--fp16"] if args.fp16 else []) + machine_flags()
    if tokens_in_tokenizer is None:
        extra += ["--vocab-size", str(arch.vocab_size)]
    if tokens_in_tokenizer is not None and tokens_in_tokenizer != arch.vocab_size:
        # Megatron-LM sizes the embedding from the tokenizer; this model's has another number of rows.
        notes.append(f"the tokenizer has {tokens_in_tokenizer} tokens and the embedding {arch.vocab_size} rows: "
                     "train with the printed --padded-vocab-size")
        extra += ["--padded-vocab-size", str(args.padded_vocab_size)]
    return ImportResult(Path(output), ["--load", str(output), *flags, *extra], verification, notes)
