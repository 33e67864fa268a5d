"""Reading indexed datasets back in the tests, through megatron-core's reader (what training reads)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def read_documents(prefix: str | Path) -> list[np.ndarray]:
    """All documents of a dataset as token arrays (a document's sequences joined)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix), mmap=False)
    bounds = ds.document_indices
    return [np.concatenate([ds[s] for s in range(a, b)]) if b > a else np.zeros(0, ds.index.dtype)
            for a, b in zip(bounds[:-1], bounds[1:])]
