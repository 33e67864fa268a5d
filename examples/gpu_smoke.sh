#!/usr/bin/env bash
# Smoke test on one GPU: a short training of the 170M preset in BF16, then in FP8 when Transformer Engine
# and an FP8-capable GPU (compute capability >= 8.9) are present; prints tokens/s and the first losses.
#
#     examples/gpu_smoke.sh
#     docker run --rm --gpus 1 megatron-jreg examples/gpu_smoke.sh       # the image of docker/Dockerfile
#     ITERS=50 MBS=4 FP8_RECIPE=tensorwise examples/gpu_smoke.sh
#
# Mock tokens (no dataset needed) and JREG on (λ = α = 1), so its hooks are part of what is timed. Each
# run's console log and --metrics-file are kept in $OUT. Without Transformer Engine the BF16 run uses
# megatron-core's local layers with the fused kernels that need TE or apex switched off (the flags of
# benchmarks/train_throughput.py's GPU_FLAGS; docs/gpu.md). benchmarks/gpu_check.sh is the fuller check.
set -euo pipefail
: "${PRESET:=llama-170m}" "${ITERS:=30}" "${MBS:=8}" "${SEQ:=2048}" "${FP8_RECIPE:=delayed}" "${PYTHON:=python}"
: "${OUT:=$(mktemp -d "${TMPDIR:-/tmp}/jreg-gpu-smoke.XXXXXX")}"

if ! gpu=$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader -i 0 2>/dev/null); then
    echo "gpu_smoke.sh: no NVIDIA GPU visible (nvidia-smi failed): run it on a GPU node, or in the container" \
         "with --gpus 1" >&2
    exit 2
fi
name=${gpu%,*}
cc=${gpu##*, }
echo "GPU 0: $name, compute capability $cc; logs and metrics in $OUT"

train() {  # train RUN [FLAGS...]: one short training; its metrics go to $OUT/RUN.jsonl
    local run=$1
    shift
    echo "== $run: $PRESET, $ITERS iterations of $MBS × $SEQ tokens $*"
    "$PYTHON" -m megatron_jreg.train --model-preset "$PRESET" --seq-length "$SEQ" --mock-data --vocab-size 32000 \
        --tokenizer-type NullTokenizer --micro-batch-size "$MBS" --global-batch-size "$MBS" --train-iters "$ITERS" \
        --log-interval 1 --lr 3e-4 --lr-warmup-iters $(( ITERS / 3 )) --eval-interval "$ITERS" --eval-iters 0 --jreg-lambda 1 --jreg-alpha 1 --no-progress \
        --bf16 --metrics-file "$OUT/$run.jsonl" "$@" 2>&1 | tee "$OUT/$run.log"
}

if "$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("transformer_engine") is None)'; then
    have_te=1
    train bf16
else
    have_te=0
    echo "== Transformer Engine is not installed: local layers, fused kernels of TE/apex off"
    train bf16 --transformer-impl local --no-gradient-accumulation-fusion --no-rope-fusion --no-masked-softmax-fusion
fi
if [[ $have_te == 0 ]]; then
    echo "== fp8: skipped, Transformer Engine is not installed (the image of docker/Dockerfile has it)"
elif ! awk -v cc="$cc" 'BEGIN { exit !(cc >= 8.9) }'; then
    echo "== fp8: skipped, FP8 needs compute capability >= 8.9 (Ada, Hopper, Blackwell); this GPU is $cc"
else
    train fp8 --transformer-impl transformer_engine --fp8-format hybrid --fp8-recipe "$FP8_RECIPE"
fi

"$PYTHON" - "$OUT"/*.jsonl <<'PY'
import json
import statistics
import sys
from pathlib import Path

for path in map(Path, sys.argv[1:]):
    records = [r for r in map(json.loads, path.read_text().splitlines()) if "lm_loss" in r]
    if not records:
        print(f"{path.stem}: no training records in {path}")
        continue
    timed = records[3:] or records  # the first iterations include compilation and allocator warm-up
    tokens = statistics.median(r["tokens_per_sec"] for r in timed)
    tflops = statistics.median(r["tflops_per_rank"] for r in timed)
    losses = ", ".join(f"{r['lm_loss']:.3f}" for r in records[:5])
    print(f"{path.stem}: {tokens:,.0f} tokens/s, {tflops:.1f} TFLOP/s (median of iterations "
          f"{timed[0]['iteration']}-{timed[-1]['iteration']}); first losses {losses}; last {records[-1]['lm_loss']:.3f}")
PY
