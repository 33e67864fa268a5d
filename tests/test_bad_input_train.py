"""Bad input to `megatron-jreg train` (and the checkpoint readers): one line naming the flag or file and the
fix, exit 2, before any work; no pickled code run; the good checkpoint still loads afterwards.

One spawned rank runs every case through the CLI's own `main` (in-process); the checkpoint cases damage
copies of one small checkpoint trained at the start.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests._train_runs import TINY, train
from tests.distributed import run_ranks

SAVE = ["--save-interval", "2", "--train-iters", "2", "--eval-interval", "100"]


class RunsCode:
    """Unpickling this creates a marker directory: code execution, if a loader allowed it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _checkpoint_copy(good: Path, tmp: Path, name: str) -> Path:
    copy = tmp / name
    shutil.copytree(good, copy)
    return copy


def _damage(good: Path, tmp: Path) -> dict[str, Path]:
    """Damaged copies of the good checkpoint (root dirs for --load)."""
    cases = {}
    for name, text in (("tracker-garbage", "garbage!"), ("tracker-empty", ""), ("tracker-release", "release"),
                       ("tracker-missing-iter", "99")):
        root = _checkpoint_copy(good, tmp, name)
        (root / "latest_checkpointed_iteration.txt").write_text(text)
        cases[name] = root
    root = _checkpoint_copy(good, tmp, "hostile-metadata")
    with open(root / "iter_0000002" / ".metadata", "wb") as f:
        pickle.dump(RunsCode(str(tmp / "pickle-ran")), f)
    cases["hostile-metadata"] = root
    root = _checkpoint_copy(good, tmp, "truncated-metadata")
    meta = root / "iter_0000002" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:100])
    cases["truncated-metadata"] = root
    root = _checkpoint_copy(good, tmp, "overwritten-shard")
    shard = next((root / "iter_0000002").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[4096:8192] = bytes(4096)
    shard.write_bytes(bytes(data))
    cases["overwritten-shard"] = root
    root = _checkpoint_copy(good, tmp, "truncated-shard-unverified")
    (root / "iter_0000002" / "integrity.json").unlink()  # as Megatron-LM saves by default
    shard = next((root / "iter_0000002").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:20000])
    cases["truncated-shard-unverified"] = root
    root = _checkpoint_copy(good, tmp, "partial-iteration")
    (root / "iter_0000002" / "metadata.json").unlink()
    (root / "iter_0000002" / ".metadata").unlink()
    cases["partial-iteration"] = root
    return cases


def _bad_data(tmp: Path) -> dict[str, str]:
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    big = tmp / "big_text_document"  # token ids up to 1000 > vocabulary 512
    builder = IndexedDatasetBuilder(str(big) + ".bin", dtype=np.uint16)
    builder.add_document(torch.arange(0, 1001, dtype=torch.int64), [1001])
    builder.finalize(str(big) + ".idx")
    truncated = tmp / "cut_text_document"
    shutil.copy(str(big) + ".bin", str(truncated) + ".bin")
    (Path(str(truncated) + ".idx")).write_bytes(Path(str(big) + ".idx").read_bytes()[:20])
    return {"big": str(big), "truncated": str(truncated)}


def _without(argv: list[str], flag: str) -> list[str]:
    """argv without `flag` and its value."""
    i = argv.index(flag)
    return argv[:i] + argv[i + 2:]


def _cases(tmp: Path, good: Path, data: dict[str, str], damaged: dict[str, Path]) -> dict[str, tuple[list, str]]:
    """name → (argv, text the one-line error must contain)."""
    nomock = [a for a in TINY if a not in ("--mock-data",)]
    a_file = tmp / "a-file"
    a_file.write_text("x")
    cases = {
        "lambda-nan": (TINY + ["--jreg-lambda", "nan"], "--jreg-lambda nan"),
        "alpha-nan": (TINY + ["--jreg-alpha", "nan"], "--jreg-alpha nan"),
        "clip-grad-nan": (TINY + ["--clip-grad", "nan"], "--clip-grad nan"),
        "lr-nan": (TINY + ["--lr", "nan"], "--lr nan"),
        "weight-decay-inf": (TINY + ["--weight-decay", "inf"], "--weight-decay inf"),
        "lambda-negative": (TINY + ["--jreg-lambda", "-1"], "--jreg-lambda must be >= 0"),
        "jreg-layers-out-of-range": (TINY + ["--jreg-layers", "5"], "--jreg-layers [5]"),
        "unknown-preset": (TINY + ["--model-preset", "llama-7b"], "--model-preset 'llama-7b' is unknown"),
        "unknown-flag": (TINY + ["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        "bad-int": (TINY + ["--train-iters", "many"], "--train-iters"),
        "load-is-a-file": (TINY + ["--load", str(a_file)], f"--load {a_file} is a file"),
        "save-is-a-file": (TINY + ["--save", str(a_file), "--save-interval", "1"], f"--save {a_file} is a file"),
        "save-without-interval": (TINY + ["--save", str(tmp / "x")], "needs --save-interval"),
        "split-all-zero": (TINY + ["--split", "0,0,0"], "--split '0,0,0'"),
        "split-not-numbers": (TINY + ["--split", "a,b"], "--split 'a,b'"),
        "missing-data": (nomock + ["--data-path", str(tmp / "nope_text_document")], "nope_text_document.idx not found"),
        "vocabulary-too-small": (nomock + ["--data-path", data["big"]], "largest token id 1000"),
        "truncated-idx": (nomock + ["--data-path", data["truncated"]], "cut_text_document.idx: truncated index"),
        "missing-tokenizer": ([a for a in nomock if a != "NullTokenizer" and a != "--tokenizer-type"]
                              + ["--mock-data", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                 str(tmp / "no-tokenizer")], "--tokenizer-type HuggingFaceTokenizer"),
        "global-batch": (TINY + ["--global-batch-size", "3", "--micro-batch-size", "2"],
                         "--global-batch-size 3 is not divisible"),
        "pp-bigger-than-world": (TINY + ["--pipeline-model-parallel-size", "2"], "world size (1)"),
        "fp8-on-cpu": (TINY + ["--fp8-format", "hybrid", "--bf16", "--transformer-impl", "transformer_engine"],
                       "Transformer Engine is not importable"),
        "te-default-without-te": ([a for a in TINY if a not in ("--transformer-impl", "local")],
                                  "add --transformer-impl local"),
        "wandb-missing": (TINY + ["--wandb-project", "x", "--wandb-exp-name", "y"], "--wandb-project needs"),
        "sft-without-chat-tokenizer": (TINY + ["--sft"], "give --tokenizer-type SFTTokenizer"),
        "sft-with-attention-mask": (TINY + ["--sft", "--tokenizer-type", "SFTTokenizer"],
                                    "--no-create-attention-mask-in-dataloader"),
        "sft-missing-file": ([a for a in nomock if a not in ("--tokenizer-type", "NullTokenizer")]
                             + ["--sft", "--tokenizer-type", "SFTTokenizer", "--no-create-attention-mask-in-dataloader",
                                "--data-path", str(tmp / "chat.jsonl")], "no such chat JSONL file"),
        "eval-interval-missing": (_without(TINY, "--eval-interval"), "give --eval-interval N"),
        "fsdp-on-cpu": (TINY + ["--use-megatron-fsdp"], "--use-megatron-fsdp runs on GPUs only"),
        "nsys-profile-on-cpu": (TINY + ["--profile"], "--use-pytorch-profiler"),
        "pretrained-missing": (TINY + ["--pretrained-checkpoint", str(tmp / "no-ckpt")],
                               f"--pretrained-checkpoint {tmp / 'no-ckpt'}: no checkpoint there"),
        "pretrained-hostile": (TINY + ["--pretrained-checkpoint", str(damaged["hostile-metadata"])],
                               f"--pretrained-checkpoint: {damaged['hostile-metadata'] / 'iter_0000002'}"
                               "/.metadata: refused to load (class posix.mkdir"),
    }
    needles = {
        "tracker-garbage": "expected an iteration number, found 'garbage!'",
        "tracker-empty": "expected an iteration number, found ''",
        "tracker-release": "names iteration release",
        "tracker-missing-iter": "names iteration 99",
        "hostile-metadata": "refused to load (class posix.mkdir is not allowed",
        "truncated-metadata": "unreadable checkpoint metadata",
        "overwritten-shard": "contents differ from the digest recorded at save",
        "truncated-shard-unverified": "Megatron-LM could not load the checkpoint",
        "partial-iteration": "incomplete checkpoint",
    }
    for name, root in damaged.items():
        cases[name] = (TINY + SAVE + ["--load", str(root)], needles[name])
    # A resume with a longer run changes the schedule (Megatron-LM's check wants its override flag).
    cases["larger-train-iters"] = (TINY + SAVE + ["--load", str(good), "--train-iters", "4"],
                                   "total number of iterations: 8 in the checkpoint, 16 from these flags (samples)")
    return cases


def bad_input_suite(rank: int, world: int, tmp_dir: str) -> dict:
    tmp = Path(tmp_dir)
    good = tmp / "good"
    out: dict = {"good": train(TINY + SAVE + ["--save", str(good)])[0]}
    data = _bad_data(tmp)
    damaged = _damage(good, tmp)
    out["cases"] = {name: train(argv) for name, (argv, _) in _cases(tmp, good, data, damaged).items()}
    out["needles"] = {name: needle for name, (_, needle) in _cases(tmp, good, data, damaged).items()}
    # The other readers refuse the hostile checkpoint without running it.
    from megatron_jreg.analysis.cli import main as analyze_main
    from megatron_jreg.convert.cli import main as convert_main
    from megatron_jreg.evaluate.cli import main as evaluate_main

    hostile = str(damaged["hostile-metadata"])
    out["readers"] = {
        "analyze": analyze_main(["--model", hostile, "--num-samples", "2", "--output", str(tmp / "a")]),
        "evaluate": evaluate_main(["--load", hostile, "--tasks", "lambada", "--limit", "2"]),
        "convert": convert_main(["mcore-to-hf", "--load", hostile, "--output", str(tmp / "hf")]),
    }
    out["pickle_ran"] = (tmp / "pickle-ran").exists()
    # Nothing lost: the good checkpoint still resumes after all of the above.
    rc, _, err = train(TINY + SAVE + ["--load", str(good)])
    out["good-resume"] = (rc, err[-1500:])
    return out


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return run_ranks(bad_input_suite, 1, str(tmp_path_factory.mktemp("bad")))[0]


def test_good_checkpoint_trains_and_still_resumes_afterwards(suite):
    assert suite["good"] == 0 and suite["good-resume"][0] == 0, suite["good-resume"][1]


@pytest.mark.parametrize("name", [
    "lambda-nan", "alpha-nan", "clip-grad-nan", "lr-nan", "weight-decay-inf", "lambda-negative",
    "jreg-layers-out-of-range", "unknown-preset", "unknown-flag", "bad-int", "load-is-a-file", "save-is-a-file",
    "save-without-interval", "split-all-zero", "split-not-numbers", "missing-data", "vocabulary-too-small",
    "truncated-idx", "missing-tokenizer", "global-batch", "pp-bigger-than-world", "fp8-on-cpu",
    "te-default-without-te", "wandb-missing", "sft-without-chat-tokenizer", "sft-with-attention-mask",
    "sft-missing-file", "eval-interval-missing", "fsdp-on-cpu", "nsys-profile-on-cpu",
    "pretrained-missing", "pretrained-hostile", "tracker-garbage", "tracker-empty", "tracker-release",
    "tracker-missing-iter", "hostile-metadata", "truncated-metadata", "overwritten-shard",
    "truncated-shard-unverified", "partial-iteration", "larger-train-iters",
])
def test_bad_input_is_one_clear_line(suite, name):
    rc, out, err = suite["cases"][name]
    lines = [line for line in err.splitlines() if line.startswith("megatron-jreg train: error:")]
    assert rc == 2, (out + err)[-2000:]
    assert len(lines) == 1 and suite["needles"][name] in lines[0], err[-2000:]
    assert "Traceback" not in err
    if name == "larger-train-iters":
        assert "--override-opt_param-scheduler" in lines[0] and "truncated" not in lines[0]


def test_hostile_pickle_never_runs_in_any_reader(suite):
    assert suite["readers"] == {"analyze": 2, "evaluate": 2, "convert": 2}
    assert suite["pickle_ran"] is False
