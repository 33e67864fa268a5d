"""megatron-core's indexed dataset format (`PREFIX.bin` + `PREFIX.idx`), written and read without torch.

The training side reads these files with `megatron.core.datasets.indexed_dataset.IndexedDataset`; this
module only has to produce the same bytes. Format (all little-endian):

    .bin  tokens of every sequence, back to back, in the index dtype
    .idx  b"MMIDIDX\\x00\\x00" | u64 version=1 | u8 dtype code | u64 sequence count S | u64 D = documents + 1
          | i32 lengths[S] | i64 byte pointers into .bin [S] | i64 document_indices[D]

`document_indices` starts at 0 and holds, after each document, the number of sequences written so far
(one sequence per document, or one per sentence with --split-sentences).

Outputs are written under `*.partial` names and renamed when complete (.bin first, then .idx), so an
interrupted run never leaves a pair that looks complete.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = len(INDEX_MAGIC) + 8 + 1 + 8 + 8  # 34
PARTIAL_SUFFIX = ".partial"

# megatron.core.datasets.indexed_dataset.DType codes
DTYPE_CODES: dict[type[np.number], int] = {
    np.uint8: 1,
    np.int8: 2,
    np.int16: 3,
    np.int32: 4,
    np.int64: 5,
    np.float64: 6,
    np.float32: 7,
    np.uint16: 8,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: int | None) -> type[np.number]:
    """Token dtype megatron picks for a vocabulary (`DType.optimal_dtype`): uint16 below 65500, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def dataset_exists(prefix: str | Path) -> bool:
    """True when both files of a finished dataset exist (partial files never count)."""
    return bin_path(prefix).is_file() and idx_path(prefix).is_file()


def encode_index(dtype: type[np.number], sequence_lengths: np.ndarray, document_indices: np.ndarray) -> bytes:
    """The complete .idx file for `sequence_lengths[S]` (tokens) and `document_indices[D]` (starts with 0)."""
    lengths = np.asarray(sequence_lengths, dtype=np.int64)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1] * itemsize, out=pointers[1:])
    header = INDEX_MAGIC + struct.pack(
        "<QBQQ", INDEX_VERSION, DTYPE_CODES[dtype], len(lengths), len(document_indices)
    )
    return b"".join(
        (
            header,
            lengths.astype("<i4").tobytes(),
            pointers.astype("<i8").tobytes(),
            np.asarray(document_indices, dtype="<i8").tobytes(),
        )
    )


class IndexedWriter:
    """Streams documents into `PREFIX.bin.partial` and renames both files into place on `finalize()`.

    Memory is O(sequences): lengths and document boundaries are kept as numpy chunks, tokens go to disk.
    """

    def __init__(self, prefix: str | Path, dtype: type[np.number]) -> None:
        self.prefix = str(prefix)
        self.dtype = dtype
        self._bin_tmp = Path(f"{bin_path(prefix)}{PARTIAL_SUFFIX}")
        self._idx_tmp = Path(f"{idx_path(prefix)}{PARTIAL_SUFFIX}")
        self._bin_tmp.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self._bin_tmp, "wb")
        self._lengths: list[np.ndarray] = []
        self._doc_ends: list[np.ndarray] = []
        self.sequences = 0
        self.documents = 0
        self.tokens = 0
        self.max_token_id = -1  # for manifests: training checks it against the model's vocabulary

    def add_documents(
        self, tokens: np.ndarray, sequence_lengths: np.ndarray, doc_sequences: np.ndarray
    ) -> None:
        """Append documents.

        tokens[T] (already in `dtype`), sequence_lengths[S] summing to T, doc_sequences[N] summing to S
        (sequences per document, 1 each unless sentences are split).
        """
        if tokens.dtype != self.dtype:
            raise TypeError(f"tokens are {tokens.dtype}, the dataset stores {np.dtype(self.dtype)}")
        self._file.write(memoryview(np.ascontiguousarray(tokens)).cast("B"))
        if len(tokens):
            self.max_token_id = max(self.max_token_id, int(tokens.max()))
        self._lengths.append(np.asarray(sequence_lengths, dtype=np.int32))
        self._doc_ends.append(self.sequences + np.cumsum(doc_sequences, dtype=np.int64))
        self.sequences += int(len(sequence_lengths))
        self.documents += int(len(doc_sequences))
        self.tokens += int(len(tokens))

    def append_dataset(self, prefix: str | Path) -> None:
        """Append a whole finished dataset (merging shards): its .bin is copied, its index offset."""
        index = read_index(prefix)
        if index.dtype != self.dtype:
            raise ValueError(
                f"{prefix}: tokens are {np.dtype(index.dtype).name} but the merged dataset is "
                f"{np.dtype(self.dtype).name}; only datasets made with the same tokenizer can be merged"
            )
        itemsize = np.dtype(self.dtype).itemsize
        with open(bin_path(prefix), "rb") as f:
            for block in iter(lambda: f.read(itemsize << 22), b""):
                self._file.write(block)
                tokens = np.frombuffer(block, dtype=self.dtype)
                if len(tokens):
                    self.max_token_id = max(self.max_token_id, int(tokens.max()))
        self._lengths.append(np.array(index.sequence_lengths, dtype=np.int32))
        self._doc_ends.append(self.sequences + np.asarray(index.document_indices[1:], dtype=np.int64))
        self.sequences += len(index.sequence_lengths)
        self.documents += index.num_documents
        self.tokens += int(index.sequence_lengths.sum(dtype=np.int64))

    def finalize(self) -> None:
        """Write the index, fsync, and move `.bin` then `.idx` to their final names."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        doc_indices = np.concatenate([np.zeros(1, np.int64), *self._doc_ends])
        with open(self._idx_tmp, "wb") as f:
            f.write(encode_index(self.dtype, lengths, doc_indices))
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(self._idx_tmp, idx_path(self.prefix))

    def abort(self) -> None:
        """Close and delete the partial files (a failed run leaves nothing behind)."""
        if not self._file.closed:
            self._file.close()
        for path in (self._bin_tmp, self._idx_tmp):
            path.unlink(missing_ok=True)


def remove_dataset(prefix: str | Path) -> None:
    """Delete a dataset and any partial files of it; the .idx goes first so no half pair looks complete."""
    for path in (idx_path(prefix), bin_path(prefix)):
        path.unlink(missing_ok=True)
        Path(f"{path}{PARTIAL_SUFFIX}").unlink(missing_ok=True)


@dataclass
class Index:
    """The parsed .idx of one dataset (arrays are read-only views of the file)."""

    dtype: type[np.number]
    sequence_lengths: np.ndarray  # [S] int32
    sequence_pointers: np.ndarray  # [S] int64, byte offsets into .bin
    document_indices: np.ndarray  # [D] int64

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1


def read_index(prefix: str | Path) -> Index:
    """Parse `PREFIX.idx`; a wrong magic, version or size raises with the path (and the fix)."""
    path = idx_path(prefix)
    size = path.stat().st_size
    fix = "re-create this dataset (rerun the command that wrote it)"
    if size < HEADER_BYTES:
        raise ValueError(f"{path}: truncated index ({size} bytes, less than its {HEADER_BYTES}-byte header); {fix}")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    if bytes(data[: len(INDEX_MAGIC)]) != INDEX_MAGIC:
        raise ValueError(f"{path}: not a megatron indexed dataset index (bad header); {fix}")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", bytes(data[len(INDEX_MAGIC) : HEADER_BYTES]))
    if version != INDEX_VERSION or code not in CODE_DTYPES:
        raise ValueError(f"{path}: unsupported index version {version} or dtype code {code}; {fix}")
    expected = HEADER_BYTES + 12 * n_seq + 8 * n_doc
    if size != expected:
        state = "truncated" if size < expected else "longer than its header says"
        raise ValueError(
            f"{path}: {state} ({size:,} bytes; {n_seq:,} sequences and {max(n_doc - 1, 0):,} documents need "
            f"{expected:,}); {fix}"
        )
    off = HEADER_BYTES
    lengths = np.frombuffer(data, dtype="<i4", count=n_seq, offset=off)
    off += 4 * n_seq
    pointers = np.frombuffer(data, dtype="<i8", count=n_seq, offset=off)
    off += 8 * n_seq
    docs = np.frombuffer(data, dtype="<i8", count=n_doc, offset=off)
    return Index(CODE_DTYPES[code], lengths, pointers, docs)


def verify_dataset(prefix: str | Path) -> Index:
    """`read_index` plus the checks a reader relies on: consistent pointers and documents, and a .bin of
    exactly the indexed size. Raises ValueError naming the damaged file."""
    index = read_index(prefix)
    path, fix = idx_path(prefix), "re-create this dataset (rerun the command that wrote it)"
    lengths = index.sequence_lengths.astype(np.int64)
    itemsize = np.dtype(index.dtype).itemsize
    expected_pointers = np.concatenate([[0], np.cumsum(lengths[:-1]) * itemsize]) if len(lengths) else lengths
    docs = index.document_indices
    if (
        (lengths < 0).any()
        or not np.array_equal(index.sequence_pointers, expected_pointers)
        or len(docs) == 0
        or docs[0] != 0
        or docs[-1] != len(lengths)
        or (np.diff(docs) < 0).any()
    ):
        raise ValueError(f"{path}: inconsistent index (sequence lengths, pointers or document boundaries); {fix}")
    bin_bytes, needed = bin_path(prefix).stat().st_size, int(lengths.sum()) * itemsize
    if bin_bytes != needed:
        state = "truncated" if bin_bytes < needed else "longer than its index says"
        raise ValueError(f"{bin_path(prefix)}: {state} ({bin_bytes:,} bytes, the index needs {needed:,}); {fix}")
    return index


def read_documents(prefix: str | Path) -> list[np.ndarray]:
    """All documents of a dataset as token arrays (for tests and small checks, not for training)."""
    index = read_index(prefix)
    if bin_path(prefix).stat().st_size == 0:  # numpy cannot map an empty file
        return [np.zeros(0, index.dtype) for _ in range(index.num_documents)]
    tokens = np.memmap(bin_path(prefix), dtype=index.dtype, mode="r")
    starts = np.concatenate([[0], np.cumsum(index.sequence_lengths, dtype=np.int64)])
    return [
        np.array(tokens[starts[a] : starts[b]])
        for a, b in zip(index.document_indices[:-1], index.document_indices[1:])
    ]
