"""Merge indexed dataset shards into one .bin/.idx pair with a manifest.

Thin wrapper over `megatron_jreg.data.merge.main` (also available as `megatron-jreg merge-datasets`).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jreg.data.merge import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
