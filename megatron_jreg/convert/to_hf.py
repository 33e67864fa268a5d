"""Megatron-LM / megatron-jreg checkpoint (any TP/PP layout) → Hugging Face Llama folder.

The model is read from the checkpoint's own saved `args` (megatron_jreg/checkpoints), loaded into one
TP=1/PP=1 GPTModel (dist_checkpointing reshards any saved layout), mapped to LlamaForCausalLM tensors,
written with config.json, generation_config.json, sharded safetensors + index and the tokenizer into a
temporary folder, checked by logits, then renamed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from megatron_jreg.convert import hf_io, llama
from megatron_jreg.convert.hf_io import ConversionError
from megatron_jreg.convert.verify import (
    Verification,
    compare_logits,
    hf_logits_fn,
    probe_tokens,
    round_weights,
    should_verify,
    single_process,
    staged_output,
)


@dataclasses.dataclass
class ExportResult:
    output: Path
    iteration: int
    dtype: torch.dtype
    files: list[str]
    verification: Verification | None
    note: str = ""  # why verification was skipped, or what about the tokenizer


def export_dtype(name: str | None, args) -> torch.dtype:  # noqa: ANN001 - Megatron-LM's args namespace
    """--dtype, or by default the precision the checkpoint was trained in (--bf16/--fp16, else float32)."""
    if name is not None:
        return hf_io.DTYPES[name]
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def _tokenizer_source(args, tokenizer_model: str | None, tokenizer_type: str | None):  # noqa: ANN001
    """((kind, path, type) of the tokenizer to write next to the weights, or None; a note). Checked before
    any loading: a given tokenizer must be exportable; the run's own is skipped with a note if it is not."""
    run_type = getattr(args, "tokenizer_type", None)
    model = tokenizer_model or (getattr(args, "tokenizer_model", None) if run_type != "NullTokenizer" else None)
    if model is None:
        return None, "no tokenizer written (the run had none; give --tokenizer-model)"
    path = Path(model)
    if not path.exists():
        raise ConversionError(
            f"the tokenizer {path} ({'--tokenizer-model' if tokenizer_model else 'recorded in the checkpoint'}) "
            "does not exist: pass --tokenizer-model with its current location"
        )
    ttype = tokenizer_type if tokenizer_model else run_type
    try:
        return (hf_io.tokenizer_kind(ttype, path), path, ttype), f"tokenizer from {path}"
    except ConversionError as e:
        if tokenizer_model:
            raise
        return None, f"no tokenizer written: {e}"


def mcore_to_hf(
    load: str | Path,
    output: str | Path,
    iteration: int | None = None,
    dtype: str | None = None,
    tokenizer_model: str | None = None,
    tokenizer_type: str | None = None,
    verify: bool | None = None,
    threshold: float | None = None,
    max_shard_size: str = "5GB",
) -> ExportResult:
    """Export a checkpoint to a Hugging Face LlamaForCausalLM folder (see the module docstring).

    verify None checks logits when both models fit in memory; True always; False never. Raises
    UnsupportedModel (not a Llama architecture), ConversionError (bad input) or VerificationFailed
    before `output` appears.
    """
    from megatron_jreg.checkpoints import read_args, resolve, verify_integrity
    from megatron_jreg.checkpoints.model import load_megatron_model

    single_process()
    ckpt_dir, iteration = resolve(load, iteration)
    verify_integrity(ckpt_dir)
    args = read_args(ckpt_dir)
    llama.check_megatron_args(args)  # refuse before loading anything
    tokenizer, note = _tokenizer_source(args, tokenizer_model, tokenizer_type)
    out_dtype = export_dtype(dtype, args)
    max_bytes = hf_io.parse_size(max_shard_size)

    with staged_output(Path(output)) as tmp:
        # The run's own tokenizer is rebuilt by the loader; a moved one is found through --tokenizer-model.
        run_tokenizer = getattr(args, "tokenizer_model", None)
        moved = tokenizer_model if run_tokenizer and not Path(run_tokenizer).exists() else None
        loaded = load_megatron_model(ckpt_dir, iteration, torch.float32, moved, verify=False)
        model_cfg = llama.LlamaArch.from_args(args, loaded.vocab_size)
        tensors = {k: v.to(out_dtype) for k, v in llama.megatron_to_hf(loaded.model.state_dict(), model_cfg).items()}
        no_tokens = dict.fromkeys(("bos", "eos", "pad"))
        specials = hf_io.special_tokens(tokenizer[0], tokenizer[1]) if tokenizer else no_tokens
        files = _write_config(tmp, model_cfg, specials, out_dtype)
        files += hf_io.write_safetensors(tensors, tmp, max_bytes)
        del tensors
        if tokenizer is not None:
            bos, eos = (specials[k][0] if specials[k] else None for k in ("bos", "eos"))
            files += hf_io.write_tokenizer(tokenizer[0], tokenizer[1], tmp, bos, eos)
            _check_tokenizer(tokenizer, tmp, int(model_cfg.vocab_size))
        verification = None
        run, why = should_verify(verify, model_cfg.num_parameters())
        if run:
            device = next(loaded.model.parameters()).device
            tokens = probe_tokens(int(model_cfg.vocab_size), model_cfg.seq_length)
            original = loaded.logits(tokens)
            rounded = round_weights(loaded.model, out_dtype)  # the megatron side holds what was written
            verification = compare_logits(loaded.logits, hf_logits_fn(tmp, device), tokens, threshold)
            if rounded:
                verification.rounding_effect = float((loaded.logits(tokens) - original).abs().max())
        else:
            note += f"; {why}"
    return ExportResult(Path(output), iteration, out_dtype, files, verification, note)


def _check_tokenizer(tokenizer: tuple, folder: Path, vocab_size: int) -> None:
    """The written tokenizer, loaded by transformers, must give the ids the model was trained on (a probe
    text with accents, CJK, full-width letters and runs of spaces), and fit the embedding."""
    from transformers import AutoTokenizer

    from megatron_jreg.data.tokenizers import PROBE_TEXT, build_tokenizer

    kind, path, ttype = tokenizer
    ours = build_tokenizer(ttype or ("HuggingFaceTokenizer" if kind == "hf" else "SentencePieceTokenizer"), str(path))
    if ours.vocab_size > vocab_size:
        raise ConversionError(
            f"the tokenizer {path} has {ours.vocab_size} tokens but the model's vocabulary is {vocab_size}: ids "
            "past the embedding would be undefined; pass the tokenizer the model was trained with"
        )
    loaded = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    theirs = loaded(PROBE_TEXT)["input_ids"]
    expected = ours.tokenize(PROBE_TEXT)
    if list(theirs) != list(expected):
        first = next((i for i, (a, b) in enumerate(zip(theirs, expected)) if a != b), min(len(theirs), len(expected)))
        raise ConversionError(
            f"the tokenizer {path}, as transformers loads it from the exported folder, gives other ids than "
            f"megatron-jreg's {ours.identity['type']} (first "
            f"difference at token {first} of a probe text; e.g. SentencePiece normalization rules that "
            "transformers' LlamaTokenizer does not reproduce). Export without it (omit --tokenizer-model) and "
            "ship a Hugging Face tokenizer (tokenizer.json) that matches"
        )


def _write_config(folder: Path, model_cfg, specials: dict, dtype: torch.dtype) -> list[str]:
    """config.json (LlamaConfig) and generation_config.json."""
    from transformers import GenerationConfig, LlamaConfig

    ids = {k: (v[1] if v else None) for k, v in specials.items()}
    config = LlamaConfig(**model_cfg.hf_config_kwargs(ids["bos"], ids["eos"], ids["pad"]))
    setattr(config, "dtype" if "dtype" in LlamaConfig().to_dict() else "torch_dtype", dtype)  # torch_dtype < 4.56
    config.save_pretrained(str(folder))
    # transformers 5 writes RoPE only as `rope_parameters`; 4.x and most other readers look for
    # `rope_theta` (+ `rope_scaling`) and would silently fall back to a base of 10,000 without it.
    path = folder / "config.json"
    written = json.loads(path.read_text())
    kwargs = model_cfg.hf_config_kwargs(ids["bos"], ids["eos"], ids["pad"])
    written["rope_theta"] = kwargs["rope_theta"]
    if kwargs["rope_scaling"] is not None:
        written["rope_scaling"] = kwargs["rope_scaling"]
    path.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    GenerationConfig(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"]).save_pretrained(
        str(folder)
    )
    return ["config.json", "generation_config.json"]
