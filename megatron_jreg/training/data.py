"""Training data: megatron-core's GPTDataset (or MockGPTDataset) through BlendedMegatronDatasetBuilder,
and a batch loader whose only state is the number of consumed samples, so a resume is exact.

Sample order follows Megatron-LM's pretraining sampler: iteration i covers global samples
[i·G, (i+1)·G); microbatch m of data-parallel rank r takes samples m·b·D + r·b + [0, b).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_jreg.config import ConfigError, TrainConfig, parse_blend

_NO_PAD = -1  # megatron's "no pad token" id: never present in the data
_BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


@dataclass
class DatasetTokenizer:
    """The three facts megatron's GPTDataset needs from a tokenizer."""

    vocab_size: int
    eod: int
    pad: int = _NO_PAD
    identity: str = ""  # which tokenizer: part of megatron's dataset cache key

    @property
    def unique_identifiers(self) -> dict:
        return {"class": "DatasetTokenizer", "vocab_size": self.vocab_size, "eod": self.eod, "pad": self.pad,
                "identity": self.identity}


def tokenizer_for(cfg: TrainConfig):
    """The run's tokenizer (or None for --mock-data with --vocab-size only) and its dataset facts."""
    d = cfg.data
    if d.tokenizer_type is None:
        return None, DatasetTokenizer(vocab_size=d.vocab_size, eod=0)
    from megatron_jreg.data.tokenizers import build_tokenizer

    try:
        tok = build_tokenizer(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file)
    except (ValueError, FileNotFoundError, OSError) as e:
        raise ConfigError(f"--tokenizer-type/--tokenizer-model: {e}") from None
    pad = tok.pad if tok.pad is not None and tok.pad != tok.eod else _NO_PAD
    identity = json.dumps(getattr(tok, "identity", {}), sort_keys=True, default=str)
    return tok, DatasetTokenizer(vocab_size=tok.vocab_size, eod=tok.eod, pad=pad, identity=identity)


def data_prefixes(cfg: TrainConfig) -> list[str]:
    d = cfg.data
    prefixes: list[str] = []
    for paths in (d.data_path, d.train_data_path, d.valid_data_path, d.test_data_path):
        if paths:
            prefixes += parse_blend(paths)[0]
    return prefixes


def max_token_id(prefix: str, scan_limit_bytes: int = 2 << 30) -> tuple[int, bool]:
    """Largest token id of an indexed dataset → (id, exact). Uses the preprocess manifest when it has
    one; otherwise scans the .bin (only its first and last `scan_limit_bytes/2` when larger)."""
    for manifest in (Path(prefix + ".manifest.json"), Path(prefix + ".json")):
        if manifest.is_file():
            try:
                value = json.loads(manifest.read_text()).get("max_token_id")
            except (OSError, json.JSONDecodeError):
                value = None
            if isinstance(value, int):
                return value, True
    dtype = IndexedDataset(prefix, mmap=True).index.dtype
    tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
    if tokens.nbytes <= scan_limit_bytes:
        chunks, exact = [tokens], True
    else:
        half = scan_limit_bytes // 2 // tokens.itemsize
        chunks, exact = [tokens[:half], tokens[-half:]], False
    best = -1
    step = 1 << 26
    for chunk in chunks:
        for i in range(0, len(chunk), step):
            part = chunk[i : i + step]
            if len(part):
                best = max(best, int(part.max()))
    return best, exact


def check_vocabulary(cfg: TrainConfig, vocab_size: int) -> None:
    """Stop before training when the data holds token ids the model's vocabulary cannot embed."""
    for prefix in data_prefixes(cfg):
        largest, exact = max_token_id(prefix)
        if largest >= vocab_size:
            raise ConfigError(
                f"--tokenizer-model: vocabulary size {vocab_size} is smaller than the largest token id "
                f"{largest} in {prefix} ({'exact' if exact else 'sampled'}): the data was tokenized with "
                "another tokenizer; pass the one used by preprocess_data.py"
            )


def build_datasets(cfg: TrainConfig, tokenizer: DatasetTokenizer, sizes: list[int]):
    """(train, valid, test) megatron datasets with at least `sizes` samples each (None where absent)."""
    d = cfg.data
    kwargs: dict = {}
    if d.train_data_path:
        kwargs["blend_per_split"] = [
            parse_blend(p) if p else None for p in (d.train_data_path, d.valid_data_path, d.test_data_path)
        ]
    elif d.data_path:
        kwargs["blend"] = parse_blend(d.data_path)
        kwargs["split"] = d.split
    else:
        kwargs["split"] = d.split
    config = GPTDatasetConfig(
        random_seed=cfg.seed,
        sequence_length=cfg.model.seq_length,
        tokenizer=tokenizer,
        reset_position_ids=d.reset_position_ids,
        reset_attention_mask=d.reset_attention_mask,
        eod_mask_loss=d.eod_mask_loss,
        create_attention_mask=False,
        path_to_cache=d.data_cache_path,
        mmap_bin_files=True,
        **kwargs,
    )
    cls = MockGPTDataset if d.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()


class BatchLoader:
    """Microbatches of this data-parallel rank, addressed by consumed samples (the resumable state)."""

    def __init__(self, dataset, micro_batch_size: int, dp_rank: int, dp_size: int, consumed: int = 0) -> None:
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.consumed = consumed

    def microbatches(self, num_microbatches: int) -> list[dict[str, torch.Tensor]]:
        """The next global batch's microbatches for this rank: dicts of [b, s] tensors."""
        b, dp = self.micro_batch_size, self.dp_size
        out = []
        for m in range(num_microbatches):
            start = self.consumed + m * b * dp + self.dp_rank * b
            samples = [self.dataset[(start + i) % len(self.dataset)] for i in range(b)]
            out.append({k: torch.stack([s[k] for s in samples]) for k in _BATCH_KEYS})
        self.consumed += num_microbatches * b * dp
        return out
