"""Hugging Face folders on disk: read weights without running pickled code (.bin only through
`torch.load(weights_only=True)`), write safetensors sharded by huggingface_hub as `save_pretrained` does."""

from __future__ import annotations

import json
import logging
import os
import warnings
import zipfile
from pathlib import Path

import torch

from megatron_jreg.checkpoints.files import refusal_text
from megatron_jreg.dtypes import WEIGHT_DTYPES, torch_dtype
from megatron_jreg.errors import JregError
from megatron_jreg.model_files import SAFETENSORS_INDEX

BIN_INDEX = "pytorch_model.bin.index.json"


class ConversionError(JregError, RuntimeError):
    """Bad input for a conversion (missing files, unsupported tokenizer, ...); the message says what to do."""


def checkpoint_dtype(hf: dict, state: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype the weights are stored in (a round trip keeps them bit-exact), else config.json's, else float32."""
    stored = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(stored) == 1:
        return stored.pop()
    name = hf.get("dtype") or hf.get("torch_dtype")
    return torch_dtype(name) if name in WEIGHT_DTYPES else torch.float32


def weight_files(folder: Path) -> list[Path]:
    for index_name, single in ((SAFETENSORS_INDEX, "model.safetensors"), (BIN_INDEX, "pytorch_model.bin")):
        index = folder / index_name
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [folder / n for n in names]
        if (folder / single).is_file():
            return [folder / single]
    raise ConversionError(f"--hf {folder}: no model.safetensors, {SAFETENSORS_INDEX}, pytorch_model.bin or {BIN_INDEX}")


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        if path.suffix == ".safetensors":
            part = load_file(str(path))
        else:
            try:  # torch.save's zip format maps; a pre-1.6 (legacy) file cannot, and loads unmapped
                with warnings.catch_warnings():  # "please file an issue" about a raw pickle's protocol
                    warnings.simplefilter("ignore", UserWarning)
                    part = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
            except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError and others for non-tensor pickles
                raise ConversionError(f"{path}: refused to load (torch.load with weights_only=True reads tensors only "
                                      f"and never runs pickled code): {refusal_text(e)}; convert the file to "
                                      "safetensors where you trust it") from None
        what = f"a {type(part).__name__}" if not isinstance(part, dict) else next(
            (f"{k!r} is a {type(v).__name__}" for k, v in part.items() if not isinstance(v, torch.Tensor)), None)
        if what is not None:
            raise ConversionError(f"{path}: not a state dict of tensors ({what}); give the folder that "
                                  "save_pretrained wrote")
        state.update(part)
    return state


def write_safetensors(tensors: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int) -> list[str]:
    """The weights as transformers' `save_pretrained` writes them (huggingface_hub's sharding); the names written."""
    from huggingface_hub import save_torch_state_dict

    root = logging.getLogger()  # Megatron-LM's training module sets it to INFO, on stdout; huggingface_hub's
    level = root.level  # saver would print "Model weights successfully saved to <the staging folder>!" there
    root.setLevel(max(level, logging.WARNING))
    try:
        save_torch_state_dict(tensors, folder, max_shard_size=max_shard_bytes)
    finally:
        root.setLevel(level)
    umask = os.umask(0)
    os.umask(umask)
    names = sorted(p.name for p in folder.glob("model*.safetensors"))
    for name in names:
        os.chmod(folder / name, 0o666 & ~umask)  # safetensors creates 0600 files; readable like the rest
    return names + ([SAFETENSORS_INDEX] if (folder / SAFETENSORS_INDEX).is_file() else [])

