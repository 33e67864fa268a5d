"""Output shards: which input files go to which shard, what the outputs are called, and when a shard is done.

With `--output-shards N` the ordered input files are cut into N contiguous groups of roughly equal bytes,
each written as `PREFIX_{i:05d}_{key}_{level}`; with one shard the name is Megatron-LM's
`PREFIX_{key}_{level}`. A shard's fingerprint describes everything its bytes depend on; a finished shard
with the same fingerprint in its manifest is skipped when the command runs again.
"""

from __future__ import annotations

import os

from megatron_jreg.data.checks import DataError
from megatron_jreg.data.manifest import fingerprint
from megatron_jreg.data.preprocess.config import PreprocessConfig
from megatron_jreg.data.sources import InputFile


def plan_shards(files: list[InputFile], n: int) -> list[list[InputFile]]:
    """Cut the ordered file list into `n` contiguous groups of roughly equal bytes (each non-empty)."""
    if n > len(files):
        raise DataError(
            f"--output-shards {n} but the input has only {len(files)} file(s); shards are made of whole "
            f"files, so use --output-shards <= {len(files)} or split the input into more files"
        )
    total = sum(f.size for f in files)
    groups: list[list[InputFile]] = [[]]
    done = 0
    for i, f in enumerate(files):
        remaining_files, remaining_groups = len(files) - i, n - len(groups) + 1
        if groups[-1] and (done >= total * len(groups) / n or remaining_files < remaining_groups):
            groups.append([])
        groups[-1].append(f)
        done += f.size
    return groups


def output_prefixes(cfg: PreprocessConfig, shard: int, n_shards: int) -> dict[str, str]:
    """`{json key: dataset prefix}` of one shard."""
    base = cfg.output_prefix if n_shards == 1 else f"{cfg.output_prefix}_{shard:05d}"
    return {k: f"{base}_{k}_{cfg.level}" for k in cfg.json_keys}


def shard_fingerprint(
    cfg: PreprocessConfig, files: list[InputFile], tokenizer_identity: dict, shard: int, n_shards: int
) -> str:
    """Hash of what a shard's bytes depend on: inputs (path, size, mtime), tokenizer, keys, filters, order."""
    described = {
        "format": 1,
        "shard": [shard, n_shards],
        "inputs": [[f.path, f.size, os.stat(f.path).st_mtime_ns] for f in files],
        "tokenizer": tokenizer_identity,
        "json_keys": cfg.json_keys,
        "append_eod": cfg.append_eod,
        "level": cfg.level,
        "sentences": [cfg.keep_newlines, cfg.lang] if cfg.split_sentences else None,
        "filters": [cfg.min_int_score, cfg.min_chars, cfg.max_documents, cfg.on_error, cfg.hf_split],
    }
    return fingerprint(described)
