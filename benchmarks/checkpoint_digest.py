"""Cost of the checkpoint digests: Megatron-LM's SHA-256 integrity manifest (written at save with
--verify-integrity, on by default in megatron-jreg) and its verification at load, in seconds per GB, side by
side with reading the same files and with faster checksums (CRC32, and xxh3 where `xxhash` is installed),
plus what that means for a checkpoint of the llama-170m preset (bf16 weights, fp32 main parameters and Adam
moments: 2 + 12 bytes per parameter).

    python benchmarks/checkpoint_digest.py [--gb 1.0] [--dir /tmp]

Ends with one line: `sha256_s_per_gb=… read_s_per_gb=… crc32_s_per_gb=… sha256_vs_read=… ckpt_170m_gb=…
ckpt_170m_verify_s=…`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import zlib
from pathlib import Path

CHUNK = 16 << 20
PARAMS_170M = 174_000_000  # README: llama-170m with the 128k Llama-3 vocabulary, tied
BYTES_PER_PARAM = 2 + 12  # bf16 weights + fp32 main params, exp_avg, exp_avg_sq (distributed optimizer)


def timed_pass(files: list[Path], update) -> float:  # noqa: ANN001 - a callable taking bytes
    start = time.perf_counter()
    for path in files:
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                update(chunk)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint-like data to hash (GB)")
    parser.add_argument("--dir", default=None, help="where to write it (default: a temporary folder)")
    args = parser.parse_args()
    from megatron.core.dist_checkpointing.validation import save_integrity_manifest

    from megatron_jreg.checkpoints import verify_integrity

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        total = int(args.gb * 1e9)
        files = []
        for i in range((total + (256 << 20) - 1) // (256 << 20)):  # 256 MB shards, like __*_*.distcp files
            path = folder / f"__{i}_0.distcp"
            path.write_bytes(os.urandom(min(256 << 20, total - i * (256 << 20))))
            files.append(path)
        gb = sum(p.stat().st_size for p in files) / 1e9
        timed_pass(files, lambda b: None)  # warm the page cache: every pass below reads from memory
        read = timed_pass(files, lambda b: None)
        crc = timed_pass(files, lambda b, state=[0]: state.__setitem__(0, zlib.crc32(b, state[0])))
        try:
            import xxhash

            h = xxhash.xxh3_64()
            xxh = timed_pass(files, h.update)
        except ImportError:
            xxh = None
        start = time.perf_counter()
        save_integrity_manifest(str(folder))
        save = time.perf_counter() - start
        start = time.perf_counter()
        verify_integrity(folder)
        verify = time.perf_counter() - start
    per_gb = {"read": read / gb, "crc32": crc / gb, "sha256 save": save / gb, "sha256 verify": verify / gb}
    if xxh is not None:
        per_gb["xxh3"] = xxh / gb
    print(f"{gb:.2f} GB in 256 MB files, page cache warm, one core:")
    for name, value in per_gb.items():
        print(f"  {name:14s} {value:6.3f} s/GB")
    ckpt_gb = PARAMS_170M * BYTES_PER_PARAM / 1e9
    sha = (save + verify) / 2 / gb
    print(f"llama-170m checkpoint ≈ {ckpt_gb:.2f} GB: SHA-256 ≈ {sha * ckpt_gb:.1f} s at save and again at load")
    print(f"sha256_s_per_gb={sha:.3f} read_s_per_gb={read / gb:.3f} crc32_s_per_gb={crc / gb:.3f} "
          f"sha256_vs_read={sha / max(read / gb, 1e-9):.1f} ckpt_170m_gb={ckpt_gb:.2f} "
          f"ckpt_170m_verify_s={sha * ckpt_gb:.1f}")


if __name__ == "__main__":
    main()
