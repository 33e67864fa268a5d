#!/usr/bin/env bash
# Shared Slurm launcher for megatron-jreg pretraining, sourced by the preset scripts next to it
# (llama-170m.sbatch, llama-1b.sbatch, llama-3.4b.sbatch), which set the allocation (#SBATCH lines) and the
# parallel layout (PRESET TP PP MBS GBS SEQUENCE_PARALLEL DISTRIBUTED_OPTIMIZER). Submit from the repository
# root; every setting below can also be given in the environment of `sbatch` (docs/cluster.md: a site's setup):
#
#     sbatch examples/slurm/llama-1b.sbatch
#     DATA_PATH=/data/fwe100b/fwe_text_document CONTAINER_IMAGE=/images/megatron-jreg.sqsh \
#         sbatch --nodes=4 examples/slurm/llama-1b.sbatch
#     DRY_RUN=1 bash examples/slurm/llama-1b.sbatch            # no allocation: check it on a login node
#     NODES=4 DRY_RUN=1 bash examples/slurm/llama-1b.sbatch    # ... as `sbatch --nodes=4` would run it
#
# DRY_RUN=1 prints the command every rank would run and checks its flags for the job's world size with
# examples/slurm/check_args.py (megatron-jreg train's own checks, on the CPU: batch-size arithmetic, data,
# tokenizer, --save folder; a summary with the checkpoints' size on disk), and runs nothing. Under sbatch it
# checks the allocation it got; run with bash outside an allocation, it takes the job's shape from the preset
# script's #SBATCH lines (NODES=N as `sbatch --nodes=N`).
#
# ---- site settings: edit here, or set them in the environment of sbatch ---------------------------------
# Partition, account, QOS: sbatch's own options, not settings here: `sbatch --partition=P --account=A ...`,
# SBATCH_PARTITION / SBATCH_ACCOUNT / SBATCH_QOS in the environment, or the #SBATCH lines of the preset scripts.
: "${DATA_PATH:=/data/fwe100b/fwe_text_document}"  # indexed-dataset prefix, a blend "W1 P1 W2 P2", or "mock"
: "${TOKENIZER_TYPE:=SentencePieceTokenizer}"      # see docs/data.md for training the tokenizer
: "${TOKENIZER_MODEL:=/data/tok/fwe32k.model}"
: "${SPLIT:=969,30,1}"        # train, validation, test weights of DATA_PATH's documents
: "${CONTAINER_IMAGE:=}"   # empty: the Python on PATH (the venv active at sbatch); else a pyxis/enroot image,
                           # e.g. /images/megatron-jreg.sqsh or docker://registry#megatron-jreg:latest
: "${CONTAINER_MOUNTS:=/data:/data}"                 # host:container paths of data and tokenizer
: "${CONTAINER_CODE:=checkout}"  # checkout: the submitted checkout ($REPO) mounted over the image's copy, so the job
                                 # runs the code it was submitted with; image: the code built into the image
: "${TRANSFORMER_IMPL:=transformer_engine}"  # local: where Transformer Engine is not installed (a plain venv):
                              # megatron-core's local layers, TE/apex fused kernels off, no flash attention
: "${RUN_ROOT:=$REPO/runs}"   # run folders RUN_ROOT/RUN_NAME/{checkpoints,logs,...}: put them on scratch, not in
                              # the checkout (a 1B run's checkpoints take terabytes; the dry run estimates them)
: "${RUN_NAME:=}"             # default <job name>-<job id>: a requeued job keeps its id, so its folder;
                              # set RUN_NAME to continue a run in a new submission
: "${TRAIN_ITERS:=200000}"    # 200K steps × 256 × 2048 tokens ≈ 105B tokens (the paper's 100B FineWeb-Edu)
: "${LR:=3e-4}"               # LR, MIN_LR, warm-up and schedule: our assumptions (the paper states none)
: "${MIN_LR:=3e-5}"
: "${LR_WARMUP_ITERS:=2000}"
: "${LR_DECAY_STYLE:=cosine}"
: "${SAVE_INTERVAL:=1000}"
: "${SAVE_RETAIN_INTERVAL=10000}"   # keep every 10,000th iteration's checkpoint and the latest, delete the other
                              # saves (Megatron-LM's --save-retain-interval); empty: keep every save
: "${JREG_LAMBDA:=1.0}"       # 0 trains the plain baseline
: "${JREG_ALPHA:=1.0}"
: "${FP8:=}"                  # hybrid or e4m3: FP8 GEMMs through Transformer Engine; empty: BF16
: "${FP8_RECIPE:=delayed}"    # delayed | tensorwise | blockwise (Hopper+) | mxfp8 (Blackwell)
: "${EXTRA_ARGS:=}"           # more training flags, e.g. "--recompute-granularity selective"
: "${PYTHON:=python}"
: "${DRY_RUN:=0}"             # 1: print each rank's command and check its flags (check_args.py), run nothing
: "${CHECK_PYTHON:=$PYTHON}"  # the Python that checks them: one with megatron-jreg installed (docs/cluster.md)
# ---------------------------------------------------------------------------------------------------------

set -euo pipefail

die() { echo "launch.sh: error: $*" >&2; exit 2; }
for name in PRESET TP PP MBS GBS; do
    [[ -n ${!name:-} ]] || die "$name is not set (run a preset script with sbatch, e.g. sbatch examples/slurm/llama-1b.sbatch)"
done
: "${SEQUENCE_PARALLEL:=0}"
: "${DISTRIBUTED_OPTIMIZER:=1}"
[[ $CONTAINER_CODE == checkout || $CONTAINER_CODE == image ]] || die "CONTAINER_CODE=$CONTAINER_CODE: give checkout or image"
[[ $TRANSFORMER_IMPL == transformer_engine || $TRANSFORMER_IMPL == local ]] ||
    die "TRANSFORMER_IMPL=$TRANSFORMER_IMPL: give transformer_engine or local"

if [[ -n ${SLURM_JOB_ID:-} ]]; then  # a job: the allocation Slurm granted
    for name in SLURM_JOB_NODELIST SLURM_NNODES SLURM_NTASKS_PER_NODE; do
        [[ -n ${!name:-} ]] || die "$name is not set: run a preset script with sbatch, e.g. sbatch examples/slurm/llama-1b.sbatch"
    done
    JOB_ID=$SLURM_JOB_ID JOB_NAME=${SLURM_JOB_NAME:-jreg} NNODES=$SLURM_NNODES GPUS_PER_NODE=$SLURM_NTASKS_PER_NODE
    CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-}
    mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    (( ${#HOSTS[@]} == NNODES )) || die "scontrol lists ${#HOSTS[@]} nodes for $SLURM_JOB_NODELIST, SLURM_NNODES is $NNODES"
    export MASTER_ADDR=${HOSTS[0]}
    export MASTER_PORT=${MASTER_PORT:-$(( 10000 + JOB_ID % 20000 ))}  # below the ephemeral range, per job
elif [[ $DRY_RUN == 1 ]]; then  # no allocation (a login node): the job's shape from the preset script's #SBATCH lines
    script=${BASH_SOURCE[1]:-}
    [[ -f $script ]] || die "DRY_RUN=1 without an allocation: run a preset script, e.g. DRY_RUN=1 bash examples/slurm/llama-1b.sbatch"
    sbatch_option() { sed -n "s/^#SBATCH --$1=\([^[:space:]]*\).*/\1/p" "$script" | head -n 1; }
    JOB_ID=JOBID JOB_NAME=$(sbatch_option job-name) NNODES=${NODES:-$(sbatch_option nodes)}
    GPUS_PER_NODE=$(sbatch_option ntasks-per-node) CPUS_PER_TASK=$(sbatch_option cpus-per-task)
    [[ $NNODES =~ ^[1-9][0-9]*$ ]] || die "NODES=$NNODES: give the number of nodes, as sbatch --nodes=N"
    [[ $GPUS_PER_NODE =~ ^[1-9][0-9]*$ ]] || die "$script has no #SBATCH --ntasks-per-node=N line"
    MASTER_ADDR="<the first node>" MASTER_PORT="<10000 + job id % 20000>"
else
    die "SLURM_JOB_ID is not set: submit a preset script with sbatch (e.g. sbatch examples/slurm/llama-1b.sbatch), or check one without an allocation: DRY_RUN=1 bash examples/slurm/llama-1b.sbatch"
fi
WORLD_SIZE=$(( NNODES * GPUS_PER_NODE ))
: "${RUN_NAME:=$JOB_NAME-$JOB_ID}"

# The batch arithmetic, before any rank starts: the world splits into TP × PP model-parallel groups and the
# global batch into micro-batches of MBS on each of the DP data-parallel ranks (context parallelism in
# EXTRA_ARGS also divides DP: check_args.py checks that case).
(( WORLD_SIZE % (TP * PP) == 0 )) ||
    die "$NNODES node(s) × $GPUS_PER_NODE GPUs = $WORLD_SIZE ranks do not split into TP=$TP × PP=$PP groups: use a node count whose GPUs are a multiple of $(( TP * PP ))"
DP=$(( WORLD_SIZE / (TP * PP) ))
if (( GBS % (MBS * DP) != 0 )); then
    fix=
    if (( GBS % DP == 0 )); then
        for (( m = MBS - 1; m >= 1; m-- )); do
            if (( GBS / DP % m == 0 )); then fix="MBS=$m ($GBS = $m × $DP × $(( GBS / DP / m )) micro-batch(es) per step), or "; break; fi
        done
    fi
    die "GBS=$GBS is not divisible by MBS × data-parallel size = $MBS × $DP ($NNODES node(s) × $GPUS_PER_NODE GPUs / TP $TP / PP $PP): set ${fix}GBS=$(( (GBS / (MBS * DP) + 1) * MBS * DP )) (another batch: another recipe), or another node count"
fi

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
    --save "$CKPT" --load "$CKPT" --save-interval "$SAVE_INTERVAL" ${SAVE_RETAIN_INTERVAL:+--save-retain-interval "$SAVE_RETAIN_INTERVAL"}
    --tensorboard-dir "$RUN_DIR/tensorboard" --metrics-file "$RUN_DIR/metrics.jsonl"
    --log-interval 10 --eval-interval 1000 --eval-iters 10 --no-progress
    --jreg-lambda "$JREG_LAMBDA" --jreg-alpha "$JREG_ALPHA"
)
if [[ $DATA_PATH == mock ]]; then
    args+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 32000)
else
    read -r -a data_path <<< "$DATA_PATH"
    # --split: Megatron-LM's own default, given so that it does not warn (3 % held out for validation)
    args+=(--data-path "${data_path[@]}" --split "$SPLIT" --tokenizer-type "$TOKENIZER_TYPE"
           --tokenizer-model "$TOKENIZER_MODEL" --data-cache-path "$RUN_ROOT/data-cache")
fi
[[ $SEQUENCE_PARALLEL == 1 ]] && args+=(--sequence-parallel)
# Without Transformer Engine: its layers' stand-in and, on a GPU, Megatron-LM's default-on fused kernels that need
# TE or apex switched off (docs/gpu.md, "What a GPU without Transformer Engine or apex needs"); no flash attention
[[ $TRANSFORMER_IMPL == local ]] &&
    args+=(--transformer-impl local --no-gradient-accumulation-fusion --no-rope-fusion --no-masked-softmax-fusion)
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
srun_args=(--nodes="$NNODES" --ntasks-per-node="$GPUS_PER_NODE" --gpu-bind=none --kill-on-bad-exit=1
           --label --output="$LOGS/train.log" --open-mode=append)
[[ -n $CPUS_PER_TASK ]] && srun_args+=(--cpus-per-task="$CPUS_PER_TASK")
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
log "job $JOB_ID attempt $(( ${SLURM_RESTART_COUNT:-0} + 1 )): $PRESET on $NNODES node(s) × $GPUS_PER_NODE GPU(s)," \
    "world size $WORLD_SIZE, TP=$TP PP=$PP DP=$DP, master $MASTER_ADDR:$MASTER_PORT, run folder $RUN_DIR"
case $(realpath -m "$RUN_ROOT")/ in
    "$(realpath -m "$REPO")"/*) log "note: the run folder is inside the checkout $REPO; set RUN_ROOT to a scratch" \
                                    "folder for checkpoints (docs/cluster.md)" ;;
esac
if [[ $DRY_RUN == 1 ]]; then
    if [[ -z ${SLURM_JOB_ID:-} ]]; then
        partition=${SBATCH_PARTITION:-$(sbatch_option partition)} account=${SBATCH_ACCOUNT:-$(sbatch_option account)}
        log "dry run without an allocation: $NNODES node(s) × $GPUS_PER_NODE GPU(s) from $(basename "$script")'s" \
            "#SBATCH lines${NODES:+ and NODES=$NODES}; partition ${partition:-(the cluster default)}, account" \
            "${account:-(your default)}"
    fi
    printf '%q ' "${command[@]}"
    printf '\n'
    # the rank's flags through megatron-jreg train's own checks, for this world size, on this machine's CPU
    status=0
    "$CHECK_PYTHON" "$REPO/examples/slurm/check_args.py" --world-size "$WORLD_SIZE" -- "${args[@]}" || status=$?
    (( status != 126 && status != 127 )) ||
        die "CHECK_PYTHON=$CHECK_PYTHON cannot run: set it (or PYTHON) to the Python megatron-jreg is installed in"
    (( status == 0 )) || die "the command above would stop before training (the line above says why); nothing ran"
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
