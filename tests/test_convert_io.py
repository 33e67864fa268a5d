"""convert's Hugging Face weight writer (convert/hf_io.py), without a checkpoint: unit tier."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from megatron_jreg.convert.hf_io import write_safetensors


def test_weights_are_written_without_huggingface_hubs_info_line(tmp_path: Path, caplog):
    """Megatron-LM's training module sets the root logger to INFO on stdout (imported by every conversion);
    huggingface_hub's saver then printed "Model weights successfully saved to <.OUTPUT.partial-PID>!" among
    convert's own lines. The root's level is restored after the write."""
    caplog.set_level(logging.INFO)
    tensors = {"model.embed_tokens.weight": torch.ones(4, 2), "lm_head.weight": torch.zeros(4, 2)}
    assert write_safetensors(tensors, tmp_path, max_shard_bytes=1 << 20) == ["model.safetensors"]
    assert not [r for r in caplog.records if "saved" in r.getMessage()], caplog.text
    assert logging.getLogger().level == logging.INFO
    logging.getLogger("megatron_jreg.test").info("still shown")
    assert "still shown" in caplog.text
