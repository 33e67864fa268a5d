"""Megatron-LM / megatron-jreg checkpoint (any TP/PP layout) → Hugging Face Llama folder, written beside the target
and renamed only after its tokenizer and logits matched the run's, so what other tools load is what was trained."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from megatron_jreg.convert import hf_io, llama, tokenizer, verify
from megatron_jreg.dtypes import run_dtype, torch_dtype


@dataclasses.dataclass
class ExportResult:
    output: Path
    iteration: int
    dtype: torch.dtype
    files: list[str]
    verification: verify.Verification | None
    note: str = ""  # why verification was skipped, or what about the tokenizer


def mcore_to_hf(cfg) -> ExportResult:  # noqa: ANN001 - convert.cli.ConvertConfig (mcore-to-hf)
    """Export a checkpoint to a LlamaForCausalLM folder; every refusal comes before `output` appears."""
    from megatron_jreg.checkpoints import Checkpoint
    from megatron_jreg.checkpoints.model import quiet_megatron

    verify.single_process()
    checkpoint = Checkpoint.open(cfg.load, cfg.iteration)
    iteration, args = checkpoint.iteration, checkpoint.args
    llama.check_megatron_args(args)  # refuse before loading anything
    with quiet_megatron():  # the run's tokenizer and its padding rule come from Megatron-LM
        source, note = tokenizer.resolve_source(args, cfg.tokenizer_model, cfg.tokenizer_type, cfg.no_tokenizer)
        tok = source.build() if source is not None else None
        if tok is not None:
            tokenizer.check_fits_checkpoint(tok, source, args)
    out_dtype = torch_dtype(cfg.dtype or run_dtype(args))  # default: the run's precision
    with verify.staged_output(cfg.output) as tmp:
        vocab_size, vocab_note = _true_vocab_size(tok, args)
        note = "; ".join(n for n in (note, vocab_note) if n)
        model_cfg = llama.LlamaArch.from_args(args, vocab_size)
        files = []
        ids: dict[str, int | None] = dict.fromkeys(("bos", "eos", "pad"))
        if tok is not None:  # written and checked id for id before the weights are loaded
            files += tokenizer.write_tokenizer(tok, source, tmp, model_cfg.max_position_embeddings)
            written = tokenizer.check_written(tok, source, tmp, vocab_size)
            ids = {"bos": written.bos_token_id, "eos": written.eos_token_id, "pad": written.pad_token_id}
        loaded = checkpoint.load_model(torch.float32, load_tokenizer=False)
        tensors = {k: v.to(out_dtype) for k, v in llama.megatron_to_hf(loaded.model.state_dict(), model_cfg).items()}
        files += _write_config(tmp, model_cfg, ids, out_dtype)
        files += hf_io.write_safetensors(tensors, tmp, cfg.shard_bytes)
        del tensors
        verification = None
        run, why = verify.should_verify(cfg.verify, model_cfg.num_parameters())
        if run:
            device = next(loaded.model.parameters()).device
            tokens = verify.probe_tokens(vocab_size, model_cfg.seq_length)

            def reference(t: torch.Tensor) -> torch.Tensor:
                return loaded.logits(t)[..., :vocab_size]  # the run's args may know only the padded size

            original = reference(tokens)
            rounded = verify.round_weights(loaded.model, out_dtype)  # the megatron side holds what was written
            verification = verify.compare_logits(reference, verify.hf_logits_fn(tmp, device), tokens,
                                                 cfg.verify_threshold, depth=model_cfg.num_layers)
            if rounded:
                verification.rounding_effect = float((reference(tokens) - original).abs().max())
        else:
            note += f"; {why}"
    return ExportResult(cfg.output, iteration, out_dtype, files, verification, note)


def _true_vocab_size(tok, args) -> tuple[int, str]:  # noqa: ANN001
    if tok is not None:
        return int(tok.vocab_size), ""
    recorded = tokenizer.recorded_vocabulary(args)
    if recorded is not None:
        return int(recorded[1]), ""
    return int(args.padded_vocab_size), (f"the run's true vocabulary is not recorded: config.json declares the "
                                         f"{args.padded_vocab_size} padded embedding rows")


def _write_config(folder: Path, model_cfg, ids: dict, dtype: torch.dtype) -> list[str]:
    from transformers import GenerationConfig, LlamaConfig

    kwargs = model_cfg.hf_config_kwargs(ids["bos"], ids["eos"], ids["pad"])
    scaling = dict(kwargs["rope_scaling"] or {})  # LlamaConfig (5.x) adds rope_theta to the dict it is given
    config = LlamaConfig(**kwargs)
    setattr(config, "dtype" if "dtype" in LlamaConfig().to_dict() else "torch_dtype", dtype)  # torch_dtype < 4.56
    config.save_pretrained(str(folder))
    # transformers 5 writes RoPE only as `rope_parameters`; 4.x and most other readers look for
    # `rope_theta` (+ `rope_scaling`) and would silently fall back to a base of 10,000 without it.
    path = folder / "config.json"
    written = json.loads(path.read_text())
    written["rope_theta"] = kwargs["rope_theta"]
    if scaling:
        written["rope_scaling"] = scaling
    path.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    GenerationConfig(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"]).save_pretrained(
        str(folder)
    )
    return ["config.json", "generation_config.json"]
