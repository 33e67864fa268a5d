"""OpenMP threads that sleep while they wait, for the processes of `evaluate`, `generate` and the lm-eval wrapper.

torch runs each CPU op on its intra-op threads (GNU OpenMP in the PyPI wheels: one per core). Between
parallel regions libgomp's idle threads spin for a while before they sleep; decoding and scoring run hundreds
of small regions per token, so on a CPU shared with other work a spinning thread holds a core its partner is
waiting for. Measured with `generate --hf` on a SmolLM2-135M-shaped model, 2 cores shared with other jobs:
0.4 tokens/s and 82 CPU-s with libgomp's default against 6.2 tokens/s and 10.5 CPU-s with passive waiting
(benchmarks/generate_hf_vs_load.py, docs/results/generate_hf_vs_load.txt). The policy is OpenMP's standard
`OMP_WAIT_POLICY`; it is read once, when torch loads libgomp, so this runs before torch is imported. A wait
the user chose is kept: OMP_WAIT_POLICY, or libgomp's GOMP_SPINCOUNT (GOMP_SPINCOUNT=300000 is libgomp's default).
"""

from __future__ import annotations

import os
import sys


def sleep_while_waiting() -> None:
    """OMP_WAIT_POLICY=PASSIVE unless the environment chooses a wait; a no-op once torch is loaded (the policy
    is read then: a process that imported torch first, e.g. a test session, keeps its own and its children's)."""
    if "torch" not in sys.modules and "GOMP_SPINCOUNT" not in os.environ:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
