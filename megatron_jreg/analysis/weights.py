"""The tensors of a Hugging Face folder, read on demand from its safetensors files (for layer streaming).

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
({name: {"dtype", "shape", "data_offsets": [begin, end]}}, offsets relative to the end of the header),
then the raw little-endian data. Tensors are read with plain `readinto` into fresh tensors rather than
through a memory map: a mapped shard stays in the resident set as long as it is open, which would hide
what layer streaming saves, and a read that comes up short is an error naming the file (a truncated
download) instead of a bus error.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_jreg.hub import ModelFileError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 * 2**20  # the format's own limit on the JSON header


class WeightsError(ModelFileError):
    """A safetensors file or index that cannot be read as described; the message names the file."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, dtype, shape and absolute byte range [start, end)."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, every byte range checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightsError(f"{path}: {size} bytes, too short for a safetensors file; download it again")
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_HEADER, size - 8):
            raise WeightsError(f"{path}: header length {length} exceeds the file ({size} bytes); download it again")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise WeightsError(f"{path}: the safetensors header is not JSON ({e}); download the file again") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: the safetensors header is not a JSON object; download the file again")
    base = 8 + length
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise WeightsError(f"{path}: tensor {name!r} has an unreadable header entry ({e!r})") from None
        info = TensorInfo(path, dtype, shape, base + begin, base + end)
        if not 0 <= begin <= end or base + end > size or end - begin != info.numel * dtype.itemsize:
            raise WeightsError(
                f"{path}: tensor {name!r} needs bytes {base + begin}..{base + end} of a {size}-byte file "
                "(truncated or corrupt); download the file again"
            )
        out[name] = info
    return out


class SafetensorsFolder:
    """Every tensor of a model folder: `model.safetensors.index.json` with its shards, or the
    `*.safetensors` files themselves when there is no index."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        index = self.folder / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                files = sorted(set(weight_map.values()))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise WeightsError(f"{index}: not a safetensors index ({e!r}); restore the file") from None
        else:
            weight_map = None
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
        if not files:
            raise WeightsError(
                f"{self.folder}: no *.safetensors weights (layer streaming reads safetensors only); convert the "
                "model with `save_pretrained(..., safe_serialization=True)` or analyze it without --stream"
            )
        self.tensors: dict[str, TensorInfo] = {}
        for name in files:
            path = self.folder / name
            if not path.is_file():
                raise WeightsError(f"{index}: lists {name}, which is not in {self.folder}; download it again")
            self.tensors.update(read_header(path))
        if weight_map is not None:
            for name, file in weight_map.items():
                info = self.tensors.get(name)
                if info is None or info.file.name != file:
                    raise WeightsError(f"{index}: {name} is not in {file}; download the model again")

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of all tensors, as stored or converted to `dtype`."""
        return sum(t.numel * (dtype.itemsize if dtype else t.dtype.itemsize) for t in self.tensors.values())

    def _read(self, f, info: TensorInfo, start: int, nbytes: int) -> torch.Tensor:
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
                out[name] = buf.view(info.dtype).reshape(info.shape)
        finally:
            if f is not None:
                f.close()
        return out

    def rows(self, name: str, ids: Sequence[int]) -> torch.Tensor:
        """Rows `ids` (sorted, distinct) of a 2-D tensor, e.g. the embeddings of the tokens in use,
        read in contiguous runs: [len(ids), width] in the stored dtype."""
        info = self.tensors[name]
        width = info.shape[1]
        row_bytes = width * info.dtype.itemsize
        out = torch.empty((len(ids), width), dtype=info.dtype)
        with open(info.file, "rb") as f:
            i = 0
            while i < len(ids):
                j = i
                while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
                    j += 1
                start = info.start + ids[i] * row_bytes
                buf = self._read(f, info, start, (j - i + 1) * row_bytes)
                out[i : j + 1] = buf.view(info.dtype).reshape(j - i + 1, width)
                i = j + 1
        return out
