"""`megatron-jreg train` runs inside gloo ranks (the CLI's own `main`), several per spawn."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

TINY = (
    "--mock-data --vocab-size 256 --num-layers 4 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 "
    "--seq-length 32 --micro-batch-size 1 --global-batch-size 4 --train-iters 4 --log-interval 1 "
    "--eval-interval 4 --eval-iters 2 --lr 1e-3 --lr-warmup-iters 1 --jreg-lambda 1 --jreg-alpha 1 --no-progress"
).split()


def train(argv: list[str]) -> tuple[int, str]:
    """Run the CLI in this process; (exit code, stderr)."""
    from megatron_jreg.train import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse errors
            rc = int(e.code or 0)
    return rc, err.getvalue()


def records(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def two_rank_runs(rank: int, world: int, tmp: str) -> dict:
    out: dict = {}
    layouts = {
        "tp2": ["--tensor-model-parallel-size", "2", "--save", f"{tmp}/tp2-ckpt"],
        "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        "pp2": ["--pipeline-model-parallel-size", "2"],
        "dp2": [],
        "dp2-distopt": ["--use-distributed-optimizer"],
        "dp2-overlap": ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
    }
    for name, extra in layouts.items():
        out[name] = train(TINY + extra + ["--metrics-file", f"{tmp}/{name}.jsonl"])[0]
    # The distributed optimizer resumes exactly (same layout) ...
    resume = ["--use-distributed-optimizer", "--save", f"{tmp}/distopt-ckpt",
              "--metrics-file", f"{tmp}/dp2-resumed.jsonl"]
    out["distopt-exit"] = train(TINY + resume + ["--exit-interval", "2"])[0]
    out["distopt-resume"] = train(TINY + resume + ["--load", f"{tmp}/distopt-ckpt"])[0]
    # ... and refuses another TP/PP with a message (its format reshards over DP only).
    out["distopt-other-layout"] = train(
        TINY + ["--use-distributed-optimizer", "--pipeline-model-parallel-size", "2", "--load", f"{tmp}/distopt-ckpt"]
    )
    # A TP=2 checkpoint evaluated at PP=2.
    out["pp2-from-tp2"] = train(
        TINY + ["--pipeline-model-parallel-size", "2", "--load", f"{tmp}/tp2-ckpt", "--skip-train",
                "--metrics-file", f"{tmp}/pp2-from-tp2.jsonl"]
    )[0]
    out["bad-pp-split"] = train(TINY[:] + ["--num-layers", "3", "--pipeline-model-parallel-size", "2"])
    return out


def single_rank_runs(rank: int, world: int, tmp: str, tokenizer: str, bad_data: str) -> dict:
    out: dict = {}
    out["single"] = train(TINY + ["--metrics-file", f"{tmp}/single.jsonl", "--tensorboard-dir", f"{tmp}/tb"])[0]
    run = ["--save", f"{tmp}/ckpt", "--metrics-file", f"{tmp}/resumed.jsonl"]
    out["exit"] = train(TINY + run + ["--exit-interval", "2"])[0]
    out["resume"] = train(TINY + run + ["--load", f"{tmp}/ckpt"])[0]
    out["one-from-tp2"] = train(
        TINY + ["--load", f"{tmp}/tp2-ckpt", "--skip-train", "--metrics-file", f"{tmp}/one-from-tp2.jsonl"]
    )[0]
    out["crash"] = crash_during_save(tmp)
    nan = ["--lr", "1e6", "--clip-grad", "0", "--adam-eps", "1e-30", "--train-iters", "20", "--save", f"{tmp}/nan",
           "--save-interval", "1"]
    out["nan"] = train(TINY + nan)
    out["errors"] = {
        "global-batch": train(TINY + ["--global-batch-size", "3", "--micro-batch-size", "2"]),
        "negative-lambda": train(TINY + ["--jreg-lambda", "-1"]),
        "unknown-preset": train(TINY + ["--model-preset", "llama-7b"]),
        "missing-data": train([a for a in TINY if a != "--mock-data"] + ["--data-path", f"{tmp}/nope_text_document"]),
        "vocab": train([a for a in TINY if a not in ("--mock-data", "--vocab-size", "256")]
                       + ["--data-path", bad_data, "--tokenizer-type", "HuggingFaceTokenizer",
                          "--tokenizer-model", tokenizer]),
        "fp8": train(TINY + ["--fp8-format", "hybrid", "--bf16"]),
        "wandb": train(TINY + ["--wandb-project", "x"]),
    }
    return out


def crash_during_save(tmp: str) -> dict:
    """A save that dies half-way leaves the tracker on the previous checkpoint and no final directory."""
    from megatron.core import dist_checkpointing

    from megatron_jreg.training import checkpoint as ckpt

    original = dist_checkpointing.save
    calls = {"n": 0}

    def dying_save(state, path, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the second save (iteration 2) crashes after writing some shards
            original(state, path, **kwargs)
            raise RuntimeError("simulated crash during save")
        return original(state, path, **kwargs)

    dist_checkpointing.save = dying_save
    try:
        _, err = train(TINY + ["--save", f"{tmp}/crash", "--save-interval", "1"])
    except RuntimeError as e:
        err = str(e)
    finally:
        dist_checkpointing.save = original
    root = Path(tmp) / "crash"
    return {
        "error": err,
        "tracker": ckpt.latest_iteration(root),
        "dirs": sorted(p.name for p in root.iterdir()),
        "resume": train(TINY + ["--load", str(root), "--save", str(root), "--metrics-file", f"{tmp}/crash.jsonl"])[0],
    }
