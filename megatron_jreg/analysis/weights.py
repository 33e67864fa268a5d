"""The tensors of a Hugging Face folder, read on demand from its safetensors files (for layer streaming).

Headers and index files are parsed and bounds-checked by `megatron_jreg.model_files` (shared with the
in-memory loaders and convert); this module reads the tensors they describe, with plain `readinto` into
fresh tensors rather than through a memory map: a mapped shard stays in the resident set as long as it
is open, which would hide what layer streaming saves, and a read that comes up short is an error naming
the file (a truncated download) instead of a bus error.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import BinaryIO

import torch

from megatron_jreg.dtypes import SAFETENSORS
from megatron_jreg.model_files import TensorEntry, WeightsError, read_safetensors_folder, safetensors_sources

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, t) for name, (t, _) in SAFETENSORS.items() if t}


def _streamable(entry: TensorEntry) -> TensorEntry:
    if entry.dtype not in DTYPES:
        raise WeightsError(f"{entry.file}: dtype {entry.dtype} cannot be streamed (supported: {', '.join(DTYPES)}); "
                           "analyze the model without --stream")
    return entry


class SafetensorsFolder:
    """Every tensor of a model folder: `model.safetensors.index.json` with its shards, or the
    `*.safetensors` files themselves when there is no index (headers and index names checked by
    `model_files.read_safetensors_folder`)."""

    def __init__(self, folder: Path, tensors: dict[str, TensorEntry] | None = None):
        self.folder = Path(folder)
        if not tensors and not safetensors_sources(self.folder)[2]:
            raise WeightsError(
                f"{self.folder}: no *.safetensors weights (layer streaming reads safetensors only); convert the "
                "model with `save_pretrained(..., safe_serialization=True)` or analyze it without --stream"
            )
        tensors = tensors or read_safetensors_folder(self.folder)  # headers read by `inspect_model_folder`
        self.tensors = {name: _streamable(entry) for name, entry in tensors.items()}

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of all tensors, as stored or converted to `dtype`."""
        return sum(t.numel * (dtype or DTYPES[t.dtype]).itemsize for t in self.tensors.values())

    @staticmethod
    def _read(f: BinaryIO, info: TensorEntry, start: int, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        f.seek(start)
        if f.readinto(buf.numpy()) != nbytes:
            raise WeightsError(f"{info.file}: ended early while reading at byte {start}; download it again")
        return buf

    def load(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors, in their stored dtype; each file is opened once and read in offset order."""
        wanted = sorted((self.tensors[n].file, self.tensors[n].start, n) for n in names)
        out: dict[str, torch.Tensor] = {}
        current, f = None, None
        try:
            for path, _, name in wanted:
                if path != current:
                    if f is not None:
                        f.close()
                    current, f = path, open(path, "rb")
                info = self.tensors[name]
                buf = self._read(f, info, info.start, info.end - info.start)
                out[name] = buf.view(DTYPES[info.dtype]).reshape(info.shape)
        finally:
            if f is not None:
                f.close()
        return out

    def rows(self, name: str, ids: Sequence[int]) -> torch.Tensor:
        """Rows `ids` (sorted, distinct) of a 2-D tensor, e.g. the embeddings of the tokens in use,
        read in contiguous runs: [len(ids), width] in the stored dtype."""
        info = self.tensors[name]
        dtype, width = DTYPES[info.dtype], info.shape[1]
        row_bytes = width * dtype.itemsize
        out = torch.empty((len(ids), width), dtype=dtype)
        with open(info.file, "rb") as f:
            i = 0
            while i < len(ids):
                j = i
                while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
                    j += 1
                start = info.start + ids[i] * row_bytes
                buf = self._read(f, info, start, (j - i + 1) * row_bytes)
                out[i : j + 1] = buf.view(dtype).reshape(j - i + 1, width)
                i = j + 1
        return out
