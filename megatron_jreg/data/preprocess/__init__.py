"""`megatron-jreg preprocess`: inputs -> `PREFIX_{key}_{document|sentence}.bin/.idx` with Megatron-LM's names and
bytes (through megatron-core) plus a manifest each, taking every flag of Megatron-LM's tools/preprocess_data.py.
"""

from typing import Any

from megatron_jreg.data.preprocess.cli import build_parser, main
from megatron_jreg.data.preprocess.config import PreprocessConfig

__all__ = ["PreprocessConfig", "PreprocessError", "build_parser", "main", "preprocess"]


def __getattr__(name: str) -> Any:
    """`preprocess` and `PreprocessError` from the driver, imported when first used: `--help` and the flag
    checks run without it (numpy, the input readers, megatron-core)."""
    if name in ("preprocess", "PreprocessError"):
        from megatron_jreg.data.preprocess import driver

        return getattr(driver, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
