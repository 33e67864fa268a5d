"""Reading .gz / .zst so that damage costs only what follows it: `gzip` drops what it had decompressed in the
failing read (a small truncated .jsonl.gz lost every line), and `zstandard` ends a cut frame without a word.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any, BinaryIO

READ_BYTES = 1 << 16
GZIP_MAGIC = b"\x1f\x8b"
COMPRESSED_SUFFIXES = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}


class StreamDamaged(Exception):
    """The compressed stream ends early or is corrupt here; every byte before this was yielded."""


def compression_of(path: str) -> str | None:
    """'gzip', 'zstd' or None (plain), from the file name."""
    return next((kind for suffix, kind in COMPRESSED_SUFFIXES.items() if path.lower().endswith(suffix)), None)


def _replay(saved: Any, data: bytes) -> Iterator[bytes]:
    """Decompress `data` byte by byte from a saved decompressor state, up to the first error."""
    for i in range(len(data)):
        try:
            out = saved.decompress(data[i : i + 1])
        except zlib.error:
            return
        if out:
            yield out


def _gzip_pieces(raw: BinaryIO) -> Iterator[bytes]:
    """Members of a gzip file one after another, as `gzip` reads them (zero padding after a member is fine)."""
    data, members = raw.read(READ_BYTES), 0
    while True:
        if members:
            while data and not data.strip(b"\x00"):
                data = raw.read(READ_BYTES)
            data = data.lstrip(b"\x00")
        if not data:
            return
        while len(data) < len(GZIP_MAGIC) and (more := raw.read(READ_BYTES)):
            data += more
        if not data.startswith(GZIP_MAGIC):
            raise StreamDamaged("not a gzip stream here (bad magic bytes)")
        inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)  # header, deflate body, CRC32 and size checked
        while True:
            saved = inflate.copy()  # to replay this chunk byte by byte if it holds the damage
            try:
                out = inflate.decompress(data)
            except zlib.error as e:
                yield from _replay(saved, data)
                where = "at its end, so text before it may be altered too" if "data check" in str(e) else "here"
                raise StreamDamaged(f"corrupt gzip data ({e}) {where}") from None
            if out:
                yield out
            if inflate.eof:
                break
            data = raw.read(READ_BYTES)
            if not data:
                raise StreamDamaged("the gzip stream ends before its end-of-stream marker (truncated)")
        data, members = inflate.unused_data, members + 1


def _zstd_pieces(raw: BinaryIO) -> Iterator[bytes]:
    """Frames of a zstd file one after another; a frame without its end is damage, not a clean end."""
    import zstandard

    pending = b""
    while True:
        data = pending or raw.read(READ_BYTES)
        if not data:
            return
        frame = zstandard.ZstdDecompressor().decompressobj()
        while True:
            try:
                out = frame.decompress(data)
            except zstandard.ZstdError as e:
                raise StreamDamaged(f"corrupt zstd data ({e})") from None
            if out:
                yield out
            if frame.eof:
                pending = frame.unused_data
                break
            data = raw.read(READ_BYTES)
            if not data:
                raise StreamDamaged("the zstd frame ends before its last block (truncated)")


def iter_decompressed(raw: BinaryIO, compression: str | None) -> Iterator[bytes]:
    """Decompressed pieces of `raw`, `StreamDamaged` after the last good one (an empty file: an empty stream)."""
    if compression is None:
        yield from iter(lambda: raw.read(READ_BYTES), b"")
    elif compression == "gzip":
        yield from _gzip_pieces(raw)
    else:
        yield from _zstd_pieces(raw)
