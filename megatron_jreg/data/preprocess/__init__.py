"""`megatron-jreg preprocess`: FineWeb-Edu / HF dataset folders / JSONL -> megatron indexed datasets.

Writes `PREFIX_{key}_{document|sentence}.bin/.idx` (Megatron-LM's naming and bytes, through megatron-core's
tokenizers and IndexedDatasetBuilder) plus a manifest per output, accepting every flag of Megatron-LM's
tools/preprocess_data.py. One module per concern (docs/data.md, "Code layout", lists them).
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
