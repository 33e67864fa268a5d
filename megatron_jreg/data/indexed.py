"""megatron-core's indexed datasets (`PREFIX.bin` + `.idx`) written atomically and checked before use: an
interrupted run must never leave a pair that looks finished (resume relies on it), and where the wheel's reader
asserts or reads garbage, `verify_dataset` names the damaged file in one line.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_jreg.data.checks import megatron_package

PARTIAL = ".partial"
_MAGIC = b"MMIDIDX\x00\x00"  # megatron.core.datasets.indexed_dataset._INDEX_HEADER
_HEADER = struct.Struct("<QBQQ")  # version, dtype code, sequences, documents + 1
_FIX = "re-create this dataset (rerun the command that wrote it)"


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def manifest_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.manifest.json")


def dataset_exists(prefix: str | Path) -> bool:
    """True when both files of a finished dataset exist (partial files never count)."""
    return bin_path(prefix).is_file() and idx_path(prefix).is_file()


def remove_dataset(*prefixes: str | Path) -> None:
    """Delete datasets with their manifests and partial files; the manifest, then the .idx go first, so nothing
    half removed looks finished."""
    for path in (p(prefix) for prefix in prefixes for p in (manifest_path, idx_path, bin_path)):
        path.unlink(missing_ok=True)
        Path(f"{path}{PARTIAL}").unlink(missing_ok=True)


def optimal_dtype(vocab_size: int) -> type[np.number]:
    """The token dtype Megatron-LM picks for a vocabulary (uint16 below 65500, else int32)."""
    return megatron_package().core.datasets.indexed_dataset.DType.optimal_dtype(vocab_size)


class Builder:
    """The wheel's IndexedDatasetBuilder writing `PREFIX.bin.partial`; `finalize` writes the index, fsyncs both
    files and renames them into place; `abort` deletes them (a failed run leaves nothing behind)."""

    def __init__(self, prefix: str | Path, dtype: type[np.number]) -> None:
        self.final = [bin_path(prefix), idx_path(prefix)]
        self.partial = [Path(f"{path}{PARTIAL}") for path in self.final]
        self.partial[0].parent.mkdir(parents=True, exist_ok=True)
        indexed_dataset = megatron_package().core.datasets.indexed_dataset
        self.builder = indexed_dataset.IndexedDatasetBuilder(str(self.partial[0]), dtype=dtype)
        self.add_document, self.add_index = self.builder.add_document, self.builder.add_index

    def finalize(self) -> None:
        self.builder.finalize(str(self.partial[1]))
        for path, final in zip(self.partial, self.final):
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            os.replace(path, final)

    def abort(self) -> None:
        self.builder.data_file.close()
        for path in self.partial:
            path.unlink(missing_ok=True)


@dataclass(frozen=True)
class Dataset:
    """What a verified dataset holds (megatron-core's reader unmaps its arrays with the reader, so counts)."""

    dtype: type[np.number]
    documents: int
    sequences: int
    tokens: int


def verify_dataset(prefix: str | Path) -> Dataset:
    """The checks a reader relies on, then what the dataset holds; a ValueError names the damaged file."""
    indexed_dataset = megatron_package().core.datasets.indexed_dataset
    path = idx_path(prefix)
    with open(path, "rb") as f:
        header = f.read(len(_MAGIC) + _HEADER.size)
    size = path.stat().st_size
    if len(header) < len(_MAGIC) + _HEADER.size:
        raise ValueError(f"{path}: truncated index ({size} bytes, less than its {len(header)}-byte header); {_FIX}")
    if header[: len(_MAGIC)] != _MAGIC:
        raise ValueError(f"{path}: not a megatron indexed dataset index (bad header); {_FIX}")
    version, code, n_seq, n_doc = _HEADER.unpack(header[len(_MAGIC):])
    if version != 1 or code not in {d.value for d in indexed_dataset.DType}:
        raise ValueError(f"{path}: unsupported index version {version} or dtype code {code}; {_FIX}")
    expected = len(header) + 12 * n_seq + 8 * n_doc
    if size != expected:
        state = "truncated" if size < expected else "longer than its header says"
        raise ValueError(f"{path}: {state} ({size:,} bytes; {n_seq:,} sequences and {max(n_doc - 1, 0):,} documents "
                         f"need {expected:,}); {_FIX}")
    inconsistent = ValueError(f"{path}: inconsistent index (sequence lengths, pointers or document boundaries); {_FIX}")
    try:
        index = indexed_dataset.IndexedDataset(str(prefix), mmap=False).index
    except AssertionError:  # the reader's own consistency asserts
        raise inconsistent from None
    lengths, docs = index.sequence_lengths.astype(np.int64), index.document_indices
    itemsize = np.dtype(index.dtype).itemsize
    if ((lengths < 0).any() or not np.array_equal(index.sequence_pointers, (np.cumsum(lengths) - lengths) * itemsize)
            or len(docs) == 0 or docs[0] != 0 or docs[-1] != len(lengths) or (np.diff(docs) < 0).any()):
        raise inconsistent
    bin_bytes, needed = bin_path(prefix).stat().st_size, int(lengths.sum()) * itemsize
    if bin_bytes != needed:
        state = "truncated" if bin_bytes < needed else "longer than its index says"
        raise ValueError(f"{bin_path(prefix)}: {state} ({bin_bytes:,} bytes, the index needs {needed:,}); {_FIX}")
    return Dataset(index.dtype, len(docs) - 1, len(lengths), int(lengths.sum()))


def document_end_token(prefix: str | Path, sample: int = 1000, least: int = 20) -> int | None:
    """The token that up to `sample` documents spread over a verified dataset all end with (the eod, with
    --append-eod); None when they end differently, or with fewer than `least` documents."""
    index = megatron_package().core.datasets.indexed_dataset.IndexedDataset(str(prefix), mmap=False).index
    docs = index.document_indices
    if len(docs) - 1 < least:
        return None
    picked = np.unique(np.linspace(1, len(docs) - 1, min(sample, len(docs) - 1)).astype(np.int64))
    last = docs[picked] - 1  # each picked document's last sequence
    lengths = index.sequence_lengths[last].astype(np.int64)
    last, lengths = last[lengths > 0], lengths[lengths > 0]
    if not len(last):
        return None
    itemsize = np.dtype(index.dtype).itemsize
    tokens = np.memmap(bin_path(prefix), dtype=index.dtype, mode="r")
    ends = np.unique(tokens[index.sequence_pointers[last] // itemsize + lengths - 1])
    return int(ends[0]) if len(ends) == 1 else None
