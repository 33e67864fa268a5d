#!/usr/bin/env bash
# The GPU check (docs/gpu.md; benchmarks/gpu_check.py --help), in the order of what its figures are worth: the
# JREG op as training runs it against its memory floor; bf16 Ψ and its gradient vs fp64; a sync-debug run of JREG
# steps; the JREG time ratio, tokens/s and MFU of the 1B and 170M presets at λ = 0 and λ = 1; Megatron-LM's own
# pretrain_gpt.py beside them; peak memory at PP = 1 and PP = 2. ≤ 5 minutes; its last line is key=value.
#
#     make gpu-wheels                        # here, once, required (PyPI and GitHub, or MEGATRON_LM=/path): .whl/
#     bash benchmarks/gpu_check.sh           # on the GPU machine: the working tree plus .whl (carry: [".whl"])
#     bash benchmarks/gpu_check.sh --dry-run # here: every step on the CPU at tiny sizes (≤ 7 minutes)
#
# Environment: OUT (three files go there: console, JSON, the logs in one archive), PYTHON (default:
# .venv/bin/python when it imports torch, else python3: on the lent GPU machine only python3 is promised torch),
# GPU_WHEELS (default .whl/gpu), GPU_SITE (where missing wheels are unpacked; default
# $TMPDIR/megatron-jreg-gpu-site). Other flags go to benchmarks/gpu_check.py.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]] && .venv/bin/python -c "import torch" 2>/dev/null; then
        PYTHON=.venv/bin/python
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
