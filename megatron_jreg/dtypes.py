"""Weight dtypes by the names every command's `--dtype` takes: one table for analyze, evaluate, generate and
convert (each command accepts the subset it supports). No torch import: `--help` stays instant."""

from __future__ import annotations

from typing import Any

WEIGHT_DTYPES = ("float32", "bfloat16", "float16")


def torch_dtype(name: str) -> Any:
    """torch's dtype for a name of WEIGHT_DTYPES; ValueError for any other name."""
    import torch

    if name not in WEIGHT_DTYPES:
        raise ValueError(f"dtype {name!r}: choose one of {', '.join(WEIGHT_DTYPES)}")
    return getattr(torch, name)
