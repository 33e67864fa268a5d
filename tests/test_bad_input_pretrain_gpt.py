"""pretrain_gpt.py flags that megatron-jreg train does not run as Megatron-LM would, and mistyped tokenizer
paths: one line naming the flag and the fix, exit 2, before any work (the CLI's own `main` in one spawned rank,
started in the repository root); layout-dependent refusals through the check itself on parsed args."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests._train_runs import TINY, train
from tests.distributed import run_ranks

CASES = {
    "logits-load-dir": (["--logits-load-dir", "teacher-logprobs"], "--logits-load-dir teacher-logprobs: offline "
                                                                    "distillation"),
    "inprocess-restart": (["--inprocess-restart"], "--inprocess-restart: megatron-jreg train does not wrap"),
    "cuda-graphs-on-cpu": (["--cuda-graph-impl", "local"], "--cuda-graph-impl local: CUDA graphs need a GPU"),
    "enable-cuda-graph-on-cpu": (["--enable-cuda-graph"], "--enable-cuda-graph: CUDA graphs need a GPU"),
    "moe-grouped-gemm-on-cpu": (["--num-experts", "2", "--moe-grouped-gemm"],
                                "--moe-grouped-gemm runs grouped-GEMM CUDA kernels, which need a GPU"),
    "record-memory-history-on-cpu": (["--record-memory-history"], "--record-memory-history records the CUDA"),
    # a mistyped local folder (examples/sft/data exists) is not taken for a hub id with a minute of network retries
    "mistyped-local-tokenizer": (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "examples/sft/dta"],
                                 "--tokenizer-model examples/sft/dta: no such folder; did you mean examples/sft/data?"),
    "missing-tokenizer-file": (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "tok/bpe.model"],
                               "--tokenizer-model tok/bpe.model: no such file (nor is there a folder tok)"),
}


def suite(rank: int, world: int) -> dict:
    os.chdir(Path(__file__).resolve().parent.parent)  # the relative tokenizer paths are the repository's
    return {name: train(TINY + extra) for name, (extra, _) in CASES.items()}


@pytest.fixture(scope="module")
def results():
    return run_ranks(suite, 1)[0]


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(CASES))
def test_refused_in_one_line(results, name):
    rc, out, err = results[name]
    lines = [line for line in err.splitlines() if line.startswith("megatron-jreg train: error:")]
    assert rc == 2, (out + err)[-2000:]
    assert len(lines) == 1 and CASES[name][1] in lines[0], err[-2000:]
    assert err.splitlines() == lines  # nothing else: no Apex/Transformer Engine warnings of megatron-core's import


def _check(*flags: str, **fields) -> None:
    """check_pretrain_gpt_flags and JregConfig.check_args on TINY plus `flags`, with `fields` set on the parsed args."""
    from megatron_jreg.plugin import JregConfig
    from megatron_jreg.training.checks import check_pretrain_gpt_flags
    from megatron_jreg.training.flags import parse_args

    args = parse_args(TINY + list(flags))
    for key, value in fields.items():
        setattr(args, key, value)
    check_pretrain_gpt_flags(args)
    JregConfig.from_args(args).check_args(args)


@pytest.mark.parametrize("flags,fields,needle", [
    ([], {"overlap_moe_expert_parallel_comm": True}, "JREG's layer hooks would never see a layer"),
    (["--eod-mask-loss", "--calculate-per-token-loss"], {"pipeline_model_parallel_size": 3},
     "--eod-mask-loss with --calculate-per-token-loss and --jreg-lambda > 0"),
    (["--eod-mask-loss", "--calculate-per-token-loss"],
     {"pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 1}, "(more than 2 stages, or "),
    (["--mtp-num-layers", "1"], {"pipeline_model_parallel_size": 2},  # TINY: layout-independent init
     "add --untie-embeddings-and-output-weights"),
    (["--mtp-num-layers", "1", "--init-mode", "megatron", "--save", "ckpt"], {"pipeline_model_parallel_size": 2},
     "megatron-core 0.19.2 cannot build the MTP stage's sharded state dict"),
    ([], {"sft": True, "context_parallel_size": 2},  # a GPU feature (TE attention): the check on parsed args
     "--sft with --context-parallel-size 2: JREG's mask of the packs' real tokens is not split"),
    ([], {"sft": True, "hybrid_context_parallel": True}, "--context-parallel-size 1 --hybrid-context-parallel: "),
])
def test_layout_dependent_refusals(flags, fields, needle):
    from megatron_jreg.errors import UsageError

    with pytest.raises(UsageError, match=re.escape(needle)):
        _check(*flags, **fields)


@pytest.mark.parametrize("flags,fields", [
    (["--eod-mask-loss", "--calculate-per-token-loss"], {"pipeline_model_parallel_size": 2}),  # both stages read
    (["--eod-mask-loss", "--calculate-per-token-loss", "--jreg-lambda", "0"], {"pipeline_model_parallel_size": 3}),
    (["--eod-mask-loss"], {"pipeline_model_parallel_size": 3}),
    (["--mtp-num-layers", "1", "--untie-embeddings-and-output-weights"], {"pipeline_model_parallel_size": 2}),
    (["--mtp-num-layers", "1", "--init-mode", "megatron"], {"pipeline_model_parallel_size": 2}),  # trains, no save
    (["--mtp-num-layers", "1"], {}),
])
def test_accepted_where_exact(flags, fields):
    _check(*flags, **fields)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty folder to run in and an empty Hugging Face cache, the hub offline (huggingface_hub's switch)."""
    from huggingface_hub import constants

    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def _tokenizer_check(model: str) -> None:
    import argparse

    from megatron_jreg.training.checks import check_tokenizer_path

    check_tokenizer_path(argparse.Namespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=model))


def test_mistyped_folder_read_as_hub_id_is_one_line_when_offline(offline_hub):
    """issue 33.3: `data/bpe4` run where there is no data/ reads as a hub id `org/name`; offline, and not in the
    cache, it is neither: one line (transformers retried the network five times, then "couldn't connect")."""
    from megatron_jreg.errors import UsageError

    with pytest.raises(UsageError, match=re.escape(
            "--tokenizer-type HuggingFaceTokenizer --tokenizer-model data/bpe4: neither a folder here nor a model in "
            f"the local Hugging Face cache {offline_hub} (offline: HF_HUB_OFFLINE); give the tokenizer's folder, or "
            "run `hf download data/bpe4` on a machine with internet")):
        _tokenizer_check("data/bpe4")
    (offline_hub / "models--org--tok").mkdir(parents=True)  # there, but no snapshot: the cache's own reason
    with pytest.raises(UsageError, match=re.escape("--tokenizer-model org/tok: ") + ".*holds no snapshot"):
        _tokenizer_check("org/tok")


def _hub_at(monkeypatch, listening: bool):  # -> socket.socket | None
    """huggingface_hub's ENDPOINT on a local port that accepts connections (a reachable hub, without a network: the
    listening socket, which the caller closes) or refuses them (no hub: None); no proxy."""
    import socket

    from huggingface_hub import constants

    for name in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    server = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
    if listening:
        return server
    server.close()
    return None


def test_hub_id_in_the_cache_or_online_is_left_to_transformers(offline_hub, monkeypatch):
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = offline_hub / "models--org--tok"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "tokenizer.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    _tokenizer_check("org/tok")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    server = _hub_at(monkeypatch, listening=True)
    try:
        _tokenizer_check("data/bpe4")  # online, the hub reachable: a hub id transformers may download
    finally:
        server.close()


def test_a_name_that_is_no_folder_and_no_reachable_hub_id_is_one_line_at_once(offline_hub, monkeypatch):
    """issue 46.13: `--tokenizer-model data/no-such-folder` (no data/ here), online but the hub unreachable: one try
    and one line naming both readings (was 54 s of huggingface_hub's retries, then transformers' line). A cached
    id is still read from the cache (offline from then on: no retries before transformers reads it)."""
    from huggingface_hub import constants

    from megatron_jreg.errors import UsageError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    _hub_at(monkeypatch, listening=False)
    with pytest.raises(UsageError) as refused:
        _tokenizer_check("data/no-such-folder")
    assert str(refused.value) == (
        "--tokenizer-type HuggingFaceTokenizer --tokenizer-model data/no-such-folder: no such local folder (nor is "
        f"there a folder data), and not a reachable hub id (not in the local Hugging Face cache {offline_hub}; the "
        "hub: 127.0.0.1: Connection refused); give the tokenizer's folder, or run `hf download "
        "data/no-such-folder` on a machine with internet and copy the cache here")
    commit = "0123456789abcdef0123456789abcdef01234567"
    (offline_hub / "models--org--tok" / "snapshots" / commit).mkdir(parents=True)
    (offline_hub / "models--org--tok" / "refs").mkdir()
    (offline_hub / "models--org--tok" / "refs" / "main").write_text(commit)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):  # force_offline sets them:
        monkeypatch.setenv(name, "0")  # restored after the test
    if "datasets.config" in sys.modules:
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
            monkeypatch.setattr(sys.modules["datasets.config"], name, getattr(sys.modules["datasets.config"], name))
    _tokenizer_check("org/tok")
    assert constants.HF_HUB_OFFLINE is True


@pytest.mark.slow
@pytest.mark.parametrize("flags,line", [
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "data/bpe4"],
     "--tokenizer-model data/bpe4: neither a folder here nor a model in the local Hugging Face cache"),
    (["--logits-load-dir", "teacher-logprobs"], "--logits-load-dir teacher-logprobs: offline distillation"),
])
def test_refused_launch_writes_its_one_line_and_nothing_else(tmp_path, flags, line):
    """issue 33: a refused `megatron-jreg train` wrote ~10 Apex/Transformer Engine UserWarnings and torch's
    "No CUDA runtime is found" line before its one line (megatron-core's import, now quiet). A fresh process, as a
    user's launch is, from a folder without data/, the hub offline and its cache empty."""
    import subprocess

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    env.pop("PYTHONWARNINGS", None)
    proc = subprocess.run([sys.executable, "-m", "megatron_jreg.train", *TINY, *flags], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-2000:]
    assert len(proc.stderr.splitlines()) == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith("megatron-jreg train: error: ") and line in proc.stderr, proc.stderr
