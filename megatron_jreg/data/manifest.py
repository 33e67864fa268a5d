"""Manifests beside each dataset (`PREFIX.manifest.json`): what a `.bin/.idx` pair holds and how it was made.
Written last, so one with a matching fingerprint and file sizes is what marks a shard finished on a rerun.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from megatron_jreg import __version__
from megatron_jreg.data.indexed import bin_path, idx_path, manifest_path
from megatron_jreg.fileio import write_json

MANIFEST_FORMAT = "megatron-jreg dataset manifest v1"


def fingerprint(obj: Any) -> str:
    """Stable hash of a JSON-serialisable description of how an output is made."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def write_manifest(prefix: str | Path, **fields: Any) -> dict:
    """Write (and return) the manifest of the finished dataset at `prefix`, with the on-disk sizes of its files."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "tool": f"megatron-jreg {__version__}",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "prefix": str(prefix),
        "files": {"bin_bytes": bin_path(prefix).stat().st_size, "idx_bytes": idx_path(prefix).stat().st_size},
        **fields,
    }
    write_json(manifest_path(prefix), manifest)
    return manifest


def read_manifest(prefix: str | Path, strict: bool = False) -> dict | None:
    """The manifest of `prefix`, None when there is none; a corrupt one is None too (resume redoes the
    shard), or with `strict` an error naming it (merging must not drop its checks silently)."""
    path = manifest_path(prefix)
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(manifest, dict):
            raise ValueError(f"a JSON {type(manifest).__name__}, not an object")
        return manifest
    except (OSError, ValueError) as e:
        if strict:
            raise ValueError(f"{path}: unreadable manifest ({e}); re-create the dataset, or delete the manifest to "
                             "use the dataset without its checks") from None
        return None


def is_complete(prefix: str | Path, expected_fingerprint: str) -> dict | None:
    """The manifest if the dataset at `prefix` was finished by a run with the same fingerprint, else None."""
    manifest = read_manifest(prefix)
    if manifest is None or manifest.get("fingerprint") != expected_fingerprint:
        return None
    files = manifest.get("files", {})
    sizes = ((bin_path(prefix), "bin_bytes"), (idx_path(prefix), "idx_bytes"))
    return manifest if all(p.is_file() and p.stat().st_size == files.get(key) for p, key in sizes) else None
