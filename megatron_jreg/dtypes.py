"""The project's dtype tables, said once: weight dtypes by the names every command's `--dtype` takes, safetensors'
dtype names, and Megatron-LM's precision flags. No torch import: `--help` stays instant."""

from __future__ import annotations

from typing import Any

WEIGHT_DTYPES = ("float32", "bfloat16", "float16")

# safetensors' dtype names -> (torch's name where the streaming reader takes it, bits per element).
SAFETENSORS: dict[str, tuple[str | None, int]] = {
    "F64": ("float64", 64), "F32": ("float32", 32), "F16": ("float16", 16), "BF16": ("bfloat16", 16),
    "I64": ("int64", 64), "I32": ("int32", 32), "I16": ("int16", 16), "I8": ("int8", 8), "U8": ("uint8", 8),
    "BOOL": ("bool", 8), "U16": (None, 16), "U32": (None, 32), "U64": (None, 64), "C64": (None, 64),
    "F8_E5M2": (None, 8), "F8_E4M3": (None, 8), "F8_E4M3FNUZ": (None, 8), "F8_E5M2FNUZ": (None, 8),
    "F8_E8M0": (None, 8), "F4": (None, 4), "F6_E2M3": (None, 6), "F6_E3M2": (None, 6),
}  # fmt: skip


def torch_dtype(name: str) -> Any:
    import torch

    if name not in WEIGHT_DTYPES:
        raise ValueError(f"dtype {name!r}: choose one of {', '.join(WEIGHT_DTYPES)}")
    return getattr(torch, name)


def run_dtype(args: Any) -> str:
    return "bfloat16" if getattr(args, "bf16", False) else "float16" if getattr(args, "fp16", False) else "float32"
