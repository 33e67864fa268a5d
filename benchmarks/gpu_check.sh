#!/usr/bin/env bash
# The GPU check (docs/gpu.md; benchmarks/gpu_check.py --help): bf16 Ψ and its gradient vs fp64, the JREG op
# against its memory floor, tokens/s and MFU of the 170M and 1B presets at λ = 0 and λ = 1 beside Megatron-LM's
# own pretrain_gpt.py, peak memory at PP = 1 and PP = 2, a sync-debug run of JREG steps; ≤ 5 minutes; its last
# line is key=value.
#
#     make gpu-wheels                        # here, once (PyPI and GitHub, or MEGATRON_LM=/path/to/clone): .whl/
#     bash benchmarks/gpu_check.sh           # on the GPU machine: the working tree plus .whl (carry: [".whl"])
#     bash benchmarks/gpu_check.sh --dry-run # here: every step on the CPU at tiny sizes (~1-2 minutes)
#
# Environment: OUT (console, JSON and logs go there too), PYTHON (default: .venv/bin/python when present,
# else python3.12, else python3), GPU_WHEELS (default .whl/gpu), GPU_SITE (where missing wheels are
# unpacked; default $TMPDIR/megatron-jreg-gpu-site). Other flags go to benchmarks/gpu_check.py.
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
