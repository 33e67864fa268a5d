#!/usr/bin/env bash
# One-command GPU check (issue 16; docs/gpu.md): install megatron-core from the carried wheels, compare a
# tiny fp32 run on the GPU with the CPU, time JREG's kernel and llama-170m training in bf16 at λ = 0 and
# λ = 1, measure the matmul rate, and print one key=value line:
#   loss_rel_diff tokens_per_sec mfu jreg_time_ratio jreg_memory_ratio kernel_time_ratio (then more keys)
#
#     make gpu-wheels                        # here, once: wheels into .whl/gpu (PyPI needed)
#     bash benchmarks/gpu_check.sh           # on the GPU machine (the working tree plus .whl), ≤ 8 minutes
#     bash benchmarks/gpu_check.sh --dry-run # here: every step on CPU at tiny sizes
#
# Environment: OUT (console, JSON and logs go there too), PYTHON (default: .venv/bin/python when present,
# else python3.12, else python3), GPU_WHEELS (default .whl/gpu), GPU_SITE (where missing wheels are
# unpacked; default $TMPDIR/megatron-jreg-gpu-site). Other flags go to benchmarks/gpu_check.py (--help).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then
        PYTHON=.venv/bin/python
    elif command -v python3.12 >/dev/null; then
        PYTHON=python3.12
    else
        PYTHON=python3
    fi
fi
: "${GPU_WHEELS:=$repo/.whl/gpu}"
: "${GPU_SITE:=${TMPDIR:-/tmp}/megatron-jreg-gpu-site}"
mkdir -p "$GPU_SITE"
# The site folder comes before the interpreter's own packages, so a carried megatron-core wins over
# another version; the repository itself is importable without installing it.
export PYTHONPATH="$GPU_SITE:$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$PYTHON" benchmarks/gpu_check.py --wheels "$GPU_WHEELS" --site "$GPU_SITE" "$@"
