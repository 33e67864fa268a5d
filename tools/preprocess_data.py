"""Tokenize FineWeb-Edu / JSONL / parquet into megatron-core indexed datasets (Megatron-LM's flags).

Thin wrapper over `megatron_jreg.data.preprocess.main` (also available as `megatron-jreg preprocess`).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jreg.data.preprocess import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
