"""Megatron-LM's `--partitions N` document order (without `--keep-sequential-samples`).

Megatron-LM deals the input lines round-robin into N partition files, tokenizes each, and concatenates the
partition outputs. So the document of record r (counted over all input records in order, bad ones
included, as Megatron-LM counts lines) ends up in partition r % N, and the output holds partition 0's
documents, then partition 1's, and so on. With `--keep-sequential-samples` the partitions are contiguous
runs of records, their concatenation is the input order, and nothing here is needed.

`RoundRobinWriter` reproduces that order while streaming: each partition goes to its own dataset in a
`PREFIX.partitions.partial/` folder, and `finalize` appends them in order into the real output, so memory
stays O(sequences) and an interrupted run leaves nothing that looks finished.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from megatron_jreg.data.indexed import IndexedWriter


def select_documents(
    tokens: np.ndarray, lengths: np.ndarray, counts: np.ndarray, keep: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The documents where keep[N] is True, from tokens[T], sequence lengths[S], sequences per document[N]."""
    seq_mask = np.repeat(keep, counts)
    token_mask = np.repeat(seq_mask, lengths)
    return tokens[token_mask], lengths[seq_mask], counts[keep]


class RoundRobinWriter:
    """An `IndexedWriter` look-alike that writes documents in Megatron-LM's --partitions N order."""

    def __init__(self, prefix: str, dtype: type[np.number], partitions: int) -> None:
        self.prefix = prefix
        self.folder = Path(f"{prefix}.partitions.partial")
        shutil.rmtree(self.folder, ignore_errors=True)
        self.parts = [IndexedWriter(self.folder / f"partition{p}", dtype) for p in range(partitions)]
        self.final = IndexedWriter(prefix, dtype)

    def add_documents(
        self, tokens: np.ndarray, sequence_lengths: np.ndarray, doc_sequences: np.ndarray, ordinals: np.ndarray
    ) -> None:
        """Append documents; ordinals[N] is each document's record number over the whole input."""
        partition = ordinals % len(self.parts)
        for p in np.unique(partition):
            self.parts[p].add_documents(*select_documents(tokens, sequence_lengths, doc_sequences, partition == p))

    def finalize(self) -> None:
        """Finish the partitions, append them in order to the output, and remove them."""
        for part in self.parts:
            part.finalize()
            self.final.append_dataset(part.prefix)
        self.final.finalize()
        shutil.rmtree(self.folder, ignore_errors=True)

    def abort(self) -> None:
        for part in self.parts:
            part.abort()
        self.final.abort()
        shutil.rmtree(self.folder, ignore_errors=True)

    @property
    def documents(self) -> int:
        return self.final.documents

    @property
    def sequences(self) -> int:
        return self.final.sequences

    @property
    def tokens(self) -> int:
        return self.final.tokens

    @property
    def max_token_id(self) -> int:
        return self.final.max_token_id
