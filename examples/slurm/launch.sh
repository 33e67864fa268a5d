#!/usr/bin/env bash
# Shared Slurm launcher for megatron-jreg pretraining, sourced by the preset scripts next to it
# (llama-170m.sbatch, llama-1b.sbatch, llama-3.4b.sbatch), which set the allocation (#SBATCH lines) and the
# parallel layout (PRESET TP PP MBS GBS SEQUENCE_PARALLEL DISTRIBUTED_OPTIMIZER). Submit from the repository
# root; every setting below can also be given in the environment of `sbatch`:
#
#     sbatch examples/slurm/llama-1b.sbatch
#     DATA_PATH=/data/fwe100b/fwe_text_document CONTAINER_IMAGE=/images/megatron-jreg.sqsh \
#         sbatch --nodes=4 examples/slurm/llama-1b.sbatch
#     DRY_RUN=1 sbatch ...      # print the command every rank would run, run nothing
#
# One Slurm task per GPU, each task one training rank: RANK/LOCAL_RANK/WORLD_SIZE come from Slurm's
# SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS (the env-based init torchrun would otherwise provide), the master
# address is the allocation's first node. No torchrun in between, because its agent SIGKILLs the ranks 30 s
# after forwarding a SIGTERM, which is less than a large checkpoint save may take. Here `--signal=TERM@300`
# reaches every rank directly, 300 s before the time limit; the training CLI then finishes its iteration,
# saves to the run's checkpoint folder and exits 0, and this script requeues the job, which resumes from
# that checkpoint (`--load` = `--save`; a missing checkpoint starts from scratch). Slurm preemption sends
# the same SIGTERM to the ranks and to this script, which then waits for the save before it exits.

# ---- site settings: edit here, or set them in the environment of sbatch ---------------------------------
: "${DATA_PATH:=/data/fwe100b/fwe_text_document}"  # indexed-dataset prefix, a blend "W1 P1 W2 P2", or "mock"
: "${TOKENIZER_TYPE:=SentencePieceTokenizer}"      # see docs/data.md for training the tokenizer
: "${TOKENIZER_MODEL:=/data/tok/fwe32k.model}"
: "${CONTAINER_IMAGE:=}"   # empty: the Python on PATH (the venv active at sbatch); else a pyxis/enroot image,
                           # e.g. /images/megatron-jreg.sqsh or docker://registry#megatron-jreg:latest
: "${CONTAINER_MOUNTS:=/data:/data}"                 # host:container paths of data and tokenizer
: "${CONTAINER_CODE:=checkout}"  # checkout: the submitted checkout ($REPO) mounted over the image's copy, so the job
                                 # runs the code it was submitted with; image: the code built into the image
: "${RUN_ROOT:=$REPO/runs}"                          # run folders: RUN_ROOT/RUN_NAME/{checkpoints,logs,...}
: "${RUN_NAME:=${SLURM_JOB_NAME:-jreg}-${SLURM_JOB_ID:-0}}"  # a requeued job keeps its id, so its folder;
                                                     # set RUN_NAME to continue a run in a new submission
: "${TRAIN_ITERS:=200000}"    # 200K steps × 256 × 2048 tokens ≈ 105B tokens (the paper's 100B FineWeb-Edu)
: "${LR:=3e-4}"               # LR, MIN_LR, warm-up and schedule: our assumptions (the paper states none)
: "${MIN_LR:=3e-5}"
: "${LR_WARMUP_ITERS:=2000}"
: "${LR_DECAY_STYLE:=cosine}"
: "${SAVE_INTERVAL:=1000}"
: "${JREG_LAMBDA:=1.0}"       # 0 trains the plain baseline
: "${JREG_ALPHA:=1.0}"
: "${FP8:=}"                  # hybrid or e4m3: FP8 GEMMs through Transformer Engine; empty: BF16
: "${FP8_RECIPE:=delayed}"    # delayed | tensorwise | blockwise (Hopper+) | mxfp8 (Blackwell)
: "${EXTRA_ARGS:=}"           # more training flags, e.g. "--recompute-granularity selective"
: "${PYTHON:=python}"
: "${DRY_RUN:=0}"
# ---------------------------------------------------------------------------------------------------------

set -euo pipefail

die() { echo "launch.sh: error: $*" >&2; exit 2; }
for name in PRESET TP PP MBS GBS SLURM_JOB_ID SLURM_JOB_NODELIST SLURM_NNODES SLURM_NTASKS_PER_NODE; do
    [[ -n ${!name:-} ]] || die "$name is not set (run a preset script with sbatch, e.g. sbatch examples/slurm/llama-1b.sbatch)"
done
: "${SEQUENCE_PARALLEL:=0}"
: "${DISTRIBUTED_OPTIMIZER:=1}"
[[ $CONTAINER_CODE == checkout || $CONTAINER_CODE == image ]] || die "CONTAINER_CODE=$CONTAINER_CODE: give checkout or image"

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
(( ${#NODES[@]} == SLURM_NNODES )) || die "scontrol lists ${#NODES[@]} nodes for $SLURM_JOB_NODELIST, SLURM_NNODES is $SLURM_NNODES"
export MASTER_ADDR=${NODES[0]}
export MASTER_PORT=${MASTER_PORT:-$(( 10000 + SLURM_JOB_ID % 20000 ))}  # below the ephemeral range, per job
GPUS_PER_NODE=$SLURM_NTASKS_PER_NODE
WORLD_SIZE=$(( SLURM_NNODES * GPUS_PER_NODE ))

RUN_DIR=$RUN_ROOT/$RUN_NAME
CKPT=$RUN_DIR/checkpoints
LOGS=$RUN_DIR/logs
export CUDA_DEVICE_MAX_CONNECTIONS=1  # keep megatron's TP/SP communication kernels ordered ahead of compute
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # as torchrun: 8 ranks a node must not each take every core
export PYTHONUNBUFFERED=1

# Our recipe in Megatron-LM's flags. LR, warm-up, schedule, weight decay 0.1, β = (0.9, 0.95) and clipping are
# OUR assumptions: the paper does not state its LR, warm-up, schedule, weight decay or β2 (Megatron-LM's
# defaults differ: weight decay 0.01, Adam β2 0.999, linear decay).
args=(
    --model-preset "$PRESET"
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --micro-batch-size "$MBS" --global-batch-size "$GBS"
    --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr "$MIN_LR" --lr-warmup-iters "$LR_WARMUP_ITERS"
    --lr-decay-style "$LR_DECAY_STYLE" --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
    --bf16 --use-mcore-models --distributed-timeout-minutes 60
    # Megatron-LM's recommended settings, as its examples/llama/train_llama3_8b_h100_fp8.sh (core_v0.19.0)
    # sets them (docs/gpu.md, "The recipes' Megatron-LM settings"): the fused cross-entropy of its
    # TRAINING_ARGS, in megatron-core's own implementation (`native`, that script's default: megatron-core
    # 0.19.2 refuses `te`, "disabled due to stability issues"), and garbage collection at fixed points on
    # every rank (--manual-gc) instead of whenever one rank's threshold trips, which stalls the others
    --cross-entropy-loss-fusion --cross-entropy-fusion-impl native --manual-gc
    --save "$CKPT" --load "$CKPT" --save-interval "$SAVE_INTERVAL"
    --tensorboard-dir "$RUN_DIR/tensorboard" --metrics-file "$RUN_DIR/metrics.jsonl"
    --log-interval 10 --eval-interval 1000 --eval-iters 10 --no-progress
    --jreg-lambda "$JREG_LAMBDA" --jreg-alpha "$JREG_ALPHA"
)
if [[ $DATA_PATH == mock ]]; then
    args+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 32000)
else
    read -r -a data_path <<< "$DATA_PATH"
    args+=(--data-path "${data_path[@]}" --tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "$TOKENIZER_MODEL"
           --data-cache-path "$RUN_ROOT/data-cache")
fi
[[ $SEQUENCE_PARALLEL == 1 ]] && args+=(--sequence-parallel)
# Data parallelism as that script's DDP_ARGS: gradients reduce-scattered while the backward pass still runs
# (--overlap-grad-reduce) and, with the distributed optimizer (DP-sharded Adam states), the updated
# parameters all-gathered while the next forward pass runs (--overlap-param-gather): neither is on by default,
# and at 1B both are ~7.5 GB a step that would otherwise wait in the open
args+=(--overlap-grad-reduce)
[[ $DISTRIBUTED_OPTIMIZER == 1 ]] && args+=(--use-distributed-optimizer --overlap-param-gather)
[[ -n $FP8 ]] && args+=(--fp8-format "$FP8" --fp8-recipe "$FP8_RECIPE")
read -r -a extra <<< "$EXTRA_ARGS"
args+=("${extra[@]}")

# --gpu-bind=none: every rank sees its node's GPUs and picks LOCAL_RANK's; newer srun does not inherit
# sbatch's --cpus-per-task, so it is passed on.
srun_args=(--nodes="$SLURM_NNODES" --ntasks-per-node="$GPUS_PER_NODE" --gpu-bind=none --kill-on-bad-exit=1
           --label --output="$LOGS/train.log" --open-mode=append)
[[ -n ${SLURM_CPUS_PER_TASK:-} ]] && srun_args+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
if [[ -n $CONTAINER_IMAGE ]]; then
    mounts=$RUN_ROOT:$RUN_ROOT${CONTAINER_MOUNTS:+,$CONTAINER_MOUNTS}
    # the working directory comes first on sys.path for `python -m`: the mounted checkout wins over the
    # package installed in the image (docker/README.md)
    [[ $CONTAINER_CODE == checkout ]] && mounts+=,$REPO:/workspace/megatron-jreg
    srun_args+=(--container-image="$CONTAINER_IMAGE" --container-workdir=/workspace/megatron-jreg
                --container-mounts="$mounts")
fi
# Each task's own shell turns its SLURM_* variables into the torch.distributed ones, then becomes the rank.
# shellcheck disable=SC2016  # expanded by the task's shell, not here
rank_env='export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS; exec "$@"'
command=(srun "${srun_args[@]}" bash -c "$rank_env" jreg-rank "$PYTHON" -m megatron_jreg.train "${args[@]}")

log() { printf '[%s] launch.sh: %s\n' "$(date '+%F %T')" "$*"; }
log "job $SLURM_JOB_ID attempt $(( ${SLURM_RESTART_COUNT:-0} + 1 )): $PRESET on $SLURM_NNODES node(s) × $GPUS_PER_NODE GPU(s)," \
    "world size $WORLD_SIZE, TP=$TP PP=$PP, master $MASTER_ADDR:$MASTER_PORT, run folder $RUN_DIR"
if [[ $DRY_RUN == 1 ]]; then
    printf '%q ' "${command[@]}"
    printf '\n'
    exit 0
fi

mkdir -p "$CKPT" "$LOGS"
iteration() {  # the iteration of the latest complete checkpoint (0 when none)
    local tracker=$CKPT/latest_checkpointed_iteration.txt
    if [[ -f $tracker ]]; then tr -dc '0-9' < "$tracker"; else echo 0; fi
}
before=$(iteration)
log "training log: $LOGS/train.log; resuming from iteration $before"

interrupted=0
on_term() {
    interrupted=1
    log "SIGTERM (preemption, scancel or time limit): the ranks save a checkpoint and exit; waiting for them"
}
trap on_term TERM
"${command[@]}" &
srun_pid=$!
while :; do  # a trapped signal interrupts `wait` while srun still runs; wait again for its real status
    interrupted=0
    if wait "$srun_pid"; then status=0; else status=$?; fi
    (( interrupted )) || break
done

after=$(iteration)
if (( status != 0 )); then
    log "training exited with status $status at checkpoint iteration $after: not requeueing (see $LOGS/train.log)"
    exit "$status"
fi
if (( after >= TRAIN_ITERS )); then
    log "finished: checkpoint at iteration $after in $CKPT"
    exit 0
fi
if (( after <= before )); then
    log "stopped at iteration $after with no new checkpoint since iteration $before: not requeueing"
    exit 1
fi
log "stopped at iteration $after of $TRAIN_ITERS: requeueing job $SLURM_JOB_ID to resume from $CKPT"
scontrol requeue "$SLURM_JOB_ID" || log "scontrol requeue failed (a preempted job is requeued by Slurm itself)"
