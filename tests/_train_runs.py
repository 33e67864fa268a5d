"""`megatron-jreg train` inside gloo ranks (the CLI's own `main`, in-process), several runs per spawn.

Megatron-LM keeps its state in module globals; `megatron_jreg.training.run` tears it down after every
run, so one process trains many times, as these suites do.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

# Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh (core_v0.19.0) with the sizes shrunk and mock
# data; dropped because they need a GPU (Transformer Engine / CUDA kernels): --attention-backend fused,
# --apply-layernorm-1p (Megatron-LM's torch norm refuses it), --bf16 --grad-reduce-in-bf16, --fp8-*,
# --cross-entropy-loss-fusion, --profile; --sequence-parallel goes with TP only.
LLAMA3_8B = (
    "--use-mcore-models --num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
    "--group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 32 --max-position-embeddings 32 "
    "--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 "
    "--hidden-dropout 0.0 --swiglu --normalization RMSNorm --init-method-std 0.0134 "
    "--untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1 --global-batch-size 4 "
    "--train-samples 16 --lr-decay-samples 16 --lr-warmup-samples 4 --lr 0.00015 --min-lr 0.00001 "
    "--decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 "
    "--adam-beta1 0.9 --adam-beta2 0.95 --calculate-per-token-loss --manual-gc --empty-unused-memory-level 1 "
    "--exit-duration-in-mins 235 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 512 --tiktoken-pattern v2 --split 99,1,0 "
    "--no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1 --log-interval 1 --eval-iters 2 "
    "--eval-interval 4 --log-throughput --ckpt-format torch_dist --distributed-timeout-minutes 60 "
    "--transformer-impl local"
).split()

# Megatron-LM core_v0.19.0's own pretrain_gpt.py on LLAMA3_8B (CPU/gloo, torch 2.13.0, megatron-core
# 0.19.2, run here with megatron_jreg.compat plus the five shims of DEVELOPERS.md): the console's
# `lm loss` of iterations 1-4, then the validation losses (at iteration 4, the final validation and test).
MEGATRON_LM_LOSSES = {
    "one": [6.234621, 6.239454, 6.220489, 6.201135, 6.183377, 6.204420, 6.191276],
    "tp2": [6.234033, 6.235979, 6.245325, 6.217990, 6.203798, 6.215143, 6.206710],
    "pp2": [6.231642, 6.233452, 6.217899, 6.209376, 6.186361, 6.205289, 6.203148],
    # LLAMA3_8B + --mtp-num-layers 1 (the MTP loss enters training; validation reports the lm loss only)
    "mtp-one": [6.244342, 6.243757, 6.227800, 6.226189, 6.192491, 6.201985, 6.201464],
    "mtp-pp2": [6.252810, 6.247370, 6.228324, 6.212677, 6.196770, 6.216374, 6.208617],
}
# ... and the console's `mtp_1 loss` of iterations 1-4 in those two runs.
MEGATRON_LM_MTP_LOSSES = {
    "mtp-one": [6.240053, 6.241476, 6.253534, 6.240371],
    "mtp-pp2": [6.236393, 6.236434, 6.235327, 6.237554],
}
MTP = ["--mtp-num-layers", "1"]

# A small Llama trained with JREG on mock data; one seed, one model at every layout.
TINY = (
    "--num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention "
    "--num-query-groups 2 --seq-length 32 --max-position-embeddings 32 --position-embedding-type rope "
    "--normalization RMSNorm --swiglu --disable-bias-linear --attention-dropout 0 --hidden-dropout 0 "
    "--transformer-impl local --mock-data --tokenizer-type NullTokenizer --vocab-size 512 --micro-batch-size 1 "
    "--global-batch-size 4 --train-iters 4 --lr 1e-3 --lr-warmup-iters 1 --log-interval 1 --eval-interval 4 "
    "--eval-iters 2 --jreg-lambda 1 --jreg-alpha 1 --init-mode layout-independent --no-progress"
).split()


_HOLDER = """
import fcntl, json, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.pwrite(fd, json.dumps({"host": "node7", "pid": os.getpid(), "started": "2026-01-01T00:00:00"}).encode(), 0)
print("locked", flush=True)
time.sleep(600)
"""


def hold_lock(lock: Path) -> subprocess.Popen:
    """Another process holding a --save folder's lock file as a training run does (its record names host node7);
    the caller ends it."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def train(argv: list[str]) -> tuple[int, str, str]:
    """Run the CLI in this process; (exit code, stdout, stderr)."""
    from megatron_jreg.train import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = int(e.code or 0)
    return rc, out.getvalue(), err.getvalue()


_CONSOLE = re.compile(r"iteration +\d+/ *\d+ \|.*? lm loss: ([0-9.E+-]+)|validation loss at [^|]*\| lm loss value: "
                      r"([0-9.E+-]+)")


def console_losses(stdout: str) -> list[float]:
    """Megatron-LM's console `lm loss` values: per logged iteration, then each validation."""
    return [float(a or b) for a, b in _CONSOLE.findall(stdout)]


def console_mtp_losses(stdout: str) -> list[float]:
    """Megatron-LM's console `mtp_1 loss` per logged iteration."""
    return [float(x) for x in re.findall(r"iteration +\d+/ *\d+ \|.*? mtp_1 loss: ([0-9.E+-]+)", stdout)]


def records(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def two_rank_runs(rank: int, world: int, tmp: str) -> dict:
    out: dict = {}
    for name, extra in (("tp2", ["--tensor-model-parallel-size", "2"]),
                        ("pp2", ["--pipeline-model-parallel-size", "2"]),
                        ("mtp-pp2", ["--pipeline-model-parallel-size", "2", *MTP])):
        rc, stdout, _ = train(LLAMA3_8B + extra)
        if rank == world - 1:
            out[f"mlm-{name}"] = (rc, console_losses(stdout), console_mtp_losses(stdout))
    rc, stdout, _ = train(LLAMA3_8B + ["--pipeline-model-parallel-size", "2", "--jreg-lambda", "1"])
    out["pp2-jreg-console"] = (rc, stdout if rank == world - 1 else "")
    layouts = {  # more layouts against an independent JREG reference: tests/test_jreg_reference.py
        "tp2": ["--tensor-model-parallel-size", "2", "--save", f"{tmp}/tp2-ckpt", "--save-interval", "4"],
        "dp2-distopt": ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
    }
    for name, extra in layouts.items():
        out[name] = train(TINY + extra + ["--metrics-file", f"{tmp}/{name}.jsonl"])[0]
    resume = ["--use-distributed-optimizer", "--save", f"{tmp}/distopt-ckpt", "--save-interval", "2",
              "--metrics-file", f"{tmp}/dp2-resumed.jsonl"]
    out["distopt-exit"] = train(TINY + resume + ["--exit-interval", "2"])[0]
    out["distopt-resume"] = train(TINY + resume + ["--load", f"{tmp}/distopt-ckpt"])[0]
    out["pp2-from-tp2"] = train(TINY + ["--pipeline-model-parallel-size", "2", "--load", f"{tmp}/tp2-ckpt",
                                        "--skip-train", "--metrics-file", f"{tmp}/pp2-from-tp2.jsonl"])[0]
    return out


def single_rank_runs(rank: int, world: int, tmp: str) -> dict:
    out: dict = {}
    for name, extra in (("one", []), ("mtp-one", MTP)):
        rc, stdout, _ = train(LLAMA3_8B + extra)
        out[f"mlm-{name}"] = (rc, console_losses(stdout), console_mtp_losses(stdout))
    out["single"] = train(TINY + ["--metrics-file", f"{tmp}/single.jsonl", "--tensorboard-dir", f"{tmp}/tb"])[0]
    run = ["--save", f"{tmp}/ckpt", "--save-interval", "2", "--metrics-file", f"{tmp}/resumed.jsonl"]
    out["exit"] = train(TINY + run + ["--exit-interval", "2"])[0]
    out["resume"] = train(TINY + run + ["--load", f"{tmp}/ckpt"])[0]
    # A checkpoint as Megatron-LM itself writes it (no integrity manifest, no megatron_jreg.json) resumes.
    mlm = ["--save", f"{tmp}/mlm-ckpt", "--save-interval", "2", "--no-verify-integrity",
           "--metrics-file", f"{tmp}/mlm-resumed.jsonl"]
    out["mlm-exit"] = train(TINY + mlm + ["--exit-interval", "2"])[0]
    for extra in Path(tmp, "mlm-ckpt").glob("iter_*/megatron_jreg.json"):
        extra.unlink()
    out["mlm-files"] = sorted(p.name for p in Path(tmp, "mlm-ckpt").glob("iter_*/*"))
    out["mlm-resume"] = train(TINY + mlm + ["--load", f"{tmp}/mlm-ckpt"])[0]
    # --use-checkpoint-args: the architecture from the checkpoint, none of it on the command line
    out["checkpoint-args"] = train(
        "--use-checkpoint-args --mock-data --tokenizer-type NullTokenizer --vocab-size 512 --micro-batch-size 1 "
        "--global-batch-size 4 --train-iters 4 --eval-interval 4 --eval-iters 2 --transformer-impl local "
        "--skip-train".split() + ["--load", f"{tmp}/ckpt", "--metrics-file", f"{tmp}/checkpoint-args.jsonl"]
    )[0]
    # a second run with another λ and seed from the first run's iteration 2, into its own --save: recorded
    out["second"] = train(TINY + ["--load", f"{tmp}/ckpt", "--ckpt-step", "2", "--save", f"{tmp}/second",
                                  "--save-interval", "1", "--jreg-lambda", "0.5", "--seed", "7"])
    # ... resumed in its own folder from iteration 3 with every JREG setting changed: recorded after the first
    out["second-changed"] = train(TINY + ["--load", f"{tmp}/second", "--ckpt-step", "3", "--save", f"{tmp}/second",
                                          "--save-interval", "1", "--seed", "7", "--jreg-lambda", "0.25",
                                          "--jreg-alpha", "2", "--jreg-distance", "cosine", "--jreg-layers", "2", "3",
                                          "--jreg-min-weight", "0.01"])
    # --overwrite-save over a finished run's copy (iterations 2 and 4) by a run that saves only iteration 2
    shutil.copytree(Path(tmp, "ckpt"), Path(tmp, "overwrite"))
    out["overwrite"] = train(TINY + ["--save", f"{tmp}/overwrite", "--save-interval", "2", "--train-iters", "2",
                                     "--overwrite-save"])
    out["one-from-tp2"] = train(
        TINY + ["--load", f"{tmp}/tp2-ckpt", "--skip-train", "--metrics-file", f"{tmp}/one-from-tp2.jsonl"]
    )[0]
    out["crash"] = crash_during_save(tmp)
    diverge = ["--lr", "1e6", "--clip-grad", "0", "--adam-eps", "1e-30", "--eval-interval", "100"]
    out["nan"] = train(TINY + diverge + ["--train-iters", "20", "--save", f"{tmp}/nan", "--save-interval", "1"])
    # the resume that exit 16 asks for loads the checkpoint, the rerun machine's record of the NaN result included
    out["nan-resume"] = train(TINY + diverge + ["--train-iters", "20", "--save", f"{tmp}/nan", "--load", f"{tmp}/nan",
                                                "--save-interval", "1"])
    out["nan-nosave"] = train(TINY + diverge + ["--train-iters", "20"])
    # NaN weights, Megatron-LM's NaN check off: training goes on, the saves of NaN weights do not happen
    out["nan-weights"] = train(TINY + diverge + [
        "--train-iters", "6", "--no-check-for-nan-in-loss-and-grad", "--save", f"{tmp}/nan-weights", "--save-interval",
        "1", "--metrics-file", f"{tmp}/nan-weights.jsonl"])
    # --metrics-file across a resume: 6 iterations straight vs 3 + resume + 3, at --log-interval 1 and 2
    six = ["--train-iters", "6", "--eval-interval", "100"]
    out["straight6"] = train(TINY + six + ["--metrics-file", f"{tmp}/straight6.jsonl"])[0]
    for interval in (1, 2):
        split = TINY + six + ["--log-interval", str(interval), "--save", f"{tmp}/split{interval}", "--save-interval",
                              "3", "--metrics-file", f"{tmp}/split{interval}.jsonl"]
        out[f"split{interval}"] = (train(split + ["--exit-interval", "3"])[0],
                                   train(split + ["--load", f"{tmp}/split{interval}"])[0])
    # ... and once more from iteration 3 after running to 6: rows 4-6 of the lost run are moved aside, then replayed
    out["replay"] = train(TINY + six + ["--save", f"{tmp}/split1", "--save-interval", "3", "--metrics-file",
                                        f"{tmp}/split1.jsonl", "--load", f"{tmp}/split1", "--ckpt-step", "3"])
    # the legacy torch format (Megatron-LM's manifest refused it: every run crashed)
    legacy = ["--ckpt-format", "torch", "--save", f"{tmp}/legacy", "--save-interval", "2",
              "--metrics-file", f"{tmp}/legacy.jsonl"]
    out["legacy"] = (train(TINY + legacy + ["--exit-interval", "2"])[0],
                     train(TINY + legacy + ["--load", f"{tmp}/legacy"]))
    # ... as Megatron-LM itself writes it (no megatron_jreg.json, no manifest): its saved args are checked
    shutil.copytree(Path(tmp, "legacy"), Path(tmp, "legacy-mlm"))
    for extra in [*Path(tmp, "legacy-mlm").glob("iter_*/megatron_jreg.json"),
                  *Path(tmp, "legacy-mlm").glob("iter_*/integrity.json")]:
        extra.unlink()
    mlm = ["--ckpt-format", "torch", "--load", f"{tmp}/legacy-mlm", "--ckpt-step", "2"]
    out["legacy-mlm"] = {name: train(TINY + mlm + extra) for name, extra in (
        ("global-batch", ["--global-batch-size", "8"]), ("vocab", ["--vocab-size", "1024"]),
        ("seq-length", ["--seq-length", "16"]), ("same", ["--jreg-lambda", "0.5"]))}
    out.update(fp16_runs(tmp))
    out["optimizer-inf"] = optimizer_state_turns_inf(tmp)
    return out


def fp16_runs(tmp: str) -> dict:
    """Megatron-LM's own skipped iterations (its fp16 loss scaler finds inf/NaN gradients and skips the update):
    with a loss scale too large for an iteration's gradients, and with hidden states that overflow float16 in
    the forward (every iteration skipped; Megatron-LM turns its NaN check off under dynamic loss scaling)."""
    fp16 = TINY + ["--fp16", "--eval-interval", "100"]
    return {
        "fp16-scale": train(fp16 + ["--initial-loss-scale", "1048576", "--train-iters", "3",
                                    "--metrics-file", f"{tmp}/fp16-scale.jsonl"]),
        "fp16-overflow": train(fp16 + ["--init-method-std", "4", "--log-interval", "2",
                                       "--metrics-file", f"{tmp}/fp16-overflow.jsonl"]),
    }


def optimizer_state_turns_inf(tmp: str) -> tuple[tuple[int, str, str], int]:
    """Adam's exp_avg_sq turns inf after the third step (as a squared gradient beyond float32 makes it): the
    weights stay finite (the update divides by it), the saves of iterations 3 and 4 must not happen."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = {"n": 0}

    def poison(optimizer, args, kwargs) -> None:
        steps["n"] += 1
        if steps["n"] == 3:
            next(iter(optimizer.state.values()))["exp_avg_sq"].fill_(float("inf"))

    hook = register_optimizer_step_post_hook(poison)
    try:
        result = train(TINY + ["--save", f"{tmp}/optimizer-inf", "--save-interval", "1", "--eval-interval", "100"])
    finally:
        hook.remove()
    return result, steps["n"]


def crash_during_save(tmp: str) -> dict:
    """A save that dies half-way leaves the tracker on the previous checkpoint; training resumes from it."""
    from megatron.core import dist_checkpointing

    from megatron_jreg.checkpoints import read_tracker

    original = dist_checkpointing.save
    calls = {"n": 0}

    @functools.wraps(original)  # its signature: megatron-jreg wraps it too (megatron_jreg.patches checks)
    def dying_save(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the second save (iteration 2) dies after writing its shards
            original(*args, **kwargs)
            raise RuntimeError("simulated crash during save")
        return original(*args, **kwargs)

    dist_checkpointing.save = dying_save
    try:
        _, _, err = train(TINY + ["--save", f"{tmp}/crash", "--save-interval", "1"])
    except RuntimeError as e:
        err = str(e)
    finally:
        dist_checkpointing.save = original
    root = Path(tmp) / "crash"
    return {
        "error": err,
        "tracker": read_tracker(root),
        "resume": train(TINY + ["--load", str(root), "--save", str(root), "--save-interval", "1",
                                "--metrics-file", f"{tmp}/crash.jsonl"])[0],
        "tracker_after": read_tracker(root),
    }
