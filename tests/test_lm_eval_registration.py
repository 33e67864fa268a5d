"""`megatron-jreg` registered with lm-eval: `--model megatron-jreg --model_args hf=DIR | load=CKPT`, and
`evaluate --num-fewshot`.

The tiny model and LAMBADA passages are those of test_evaluate (accuracy strictly between 0 and 1); the
lm-eval task is the same LAMBADA over the local JSONL (`LAMBADA_TASK_YAML`), whose scores must equal
the built-in LAMBADA's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import test_evaluate
from tests.test_evaluate import LAMBADA_TASK_YAML

# test_evaluate's fixtures: its tiny model and passage file, one thread, offline flags restored.
model_dir = test_evaluate.model_dir
passages_file = test_evaluate.passages_file
_one_thread = test_evaluate._one_thread
_offline_flags_restored = test_evaluate._offline_flags_restored

REPO = Path(__file__).resolve().parents[1]
LIMIT = 12


@pytest.fixture(scope="module")
def tasks_dir(passages_file, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tasks")
    (folder / "lambada_local.yaml").write_text(LAMBADA_TASK_YAML.format(path=passages_file), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def builtin(model_dir, passages_file) -> dict:
    """The built-in LAMBADA on the first LIMIT passages: what every lm-eval route must reproduce."""
    from megatron_jreg.evaluate.lambada import evaluate_lambada, read_lambada
    from megatron_jreg.evaluate.models import load_hf_lm

    passages, _ = read_lambada(passages_file)
    return evaluate_lambada(load_hf_lm(model_dir, "cpu", "float32"), passages[:LIMIT], batch_size=4)


def test_registered_under_its_name():
    from lm_eval.api.registry import get_model

    from megatron_jreg.evaluate.lm_eval_model import MegatronJregLM

    assert get_model("megatron-jreg") is MegatronJregLM


def test_simple_evaluate_by_name_scores_like_the_builtin(model_dir, tasks_dir, builtin, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("DISABLE_MULTIPROC", "1")
    manager = TaskManager(include_path=[str(tasks_dir)], include_defaults=False)

    def run(shots: int | None) -> dict:
        return lm_eval.simple_evaluate(
            model="megatron-jreg", model_args=f"hf={model_dir},dtype=float32", tasks=["lambada_local"],
            task_manager=manager, limit=LIMIT, num_fewshot=shots, bootstrap_iters=0, batch_size=4,
            log_samples=True,
        )  # fmt: skip

    def contexts(raw: dict) -> list[str]:
        samples = sorted(raw["samples"]["lambada_local"], key=lambda s: s["doc_id"])
        return [sample["arguments"][0][0] for sample in samples]  # each request's (context, continuation)

    zero = run(None)
    scores = zero["results"]["lambada_local"]
    assert 0 < builtin["acc"] < 1
    assert scores["acc,none"] == builtin["acc"]
    assert scores["perplexity,none"] == pytest.approx(builtin["perplexity"], rel=1e-5)
    assert zero["config"]["megatron_jreg_model"] == {"hf": str(model_dir)}
    one = run(1)
    assert one["n-shot"]["lambada_local"] == 1
    for plain, shot in zip(contexts(zero), contexts(one), strict=True):  # a solved passage, then the question
        assert shot.endswith(plain) and len(shot) > len(plain) + 20


def test_evaluate_num_fewshot_reaches_lm_eval(model_dir, tasks_dir, tmp_path, monkeypatch):
    from megatron_jreg.evaluate import cli
    from megatron_jreg.evaluate.results import EvalResults

    monkeypatch.setenv("DISABLE_MULTIPROC", "1")
    common = ["--hf", str(model_dir), "--tasks", "lambada_local", "--include-path", str(tasks_dir),
              "--limit", str(LIMIT), "--bootstrap-iters", "0"]  # fmt: skip
    assert cli.main([*common, "--output", str(tmp_path / "zero.json")]) == 0
    assert cli.main([*common, "--num-fewshot", "2", "--output", str(tmp_path / "two.json")]) == 0
    zero, two = EvalResults.read(tmp_path / "zero.json"), EvalResults.read(tmp_path / "two.json")
    assert (zero.config["num_fewshot"], two.config["num_fewshot"]) == (None, 2)
    ppl0, ppl2 = zero.results["lambada_local"]["perplexity"], two.results["lambada_local"]["perplexity"]
    assert ppl2 != pytest.approx(ppl0, rel=1e-9)  # two solved examples before each passage change the score


@pytest.mark.slow
def test_lm_eval_command_line_runs_our_model(model_dir, tasks_dir, builtin, tmp_path):
    """lm-eval's own CLI (every flag of it), with the model registered, in a fresh process; `pretrained=`
    names lm-eval's output folder after the model, as for its own `hf` model."""
    from lm_eval.utils import sanitize_model_name

    from megatron_jreg.evaluate.results import EvalResults

    out = tmp_path / "lm-eval-out"
    env = {**os.environ, "DISABLE_MULTIPROC": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_jreg.evaluate.lm_eval_model", "--model", "megatron-jreg",
         "--model_args", f"pretrained={model_dir},dtype=float32", "--tasks", "lambada_local", "--include_path",
         str(tasks_dir), "--limit", str(LIMIT), "--batch_size", "4", "--output_path", str(out)],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result_file,) = out.rglob("results_*.json")
    assert result_file.parent.name == sanitize_model_name(str(model_dir))
    saved = json.loads(result_file.read_text())
    assert saved["config"]["model"] == "megatron-jreg"
    assert saved["results"]["lambada_local"]["acc,none"] == builtin["acc"]
    read = EvalResults.read(result_file)  # lm-eval's own file as `compare` reads it
    assert read.results["lambada_local"]["acc"] == builtin["acc"] and read.samples == {"lambada_local": LIMIT}
    assert read.higher_is_better == {"lambada_local": {"perplexity": False, "acc": True}}


def test_load_reaches_the_megatron_loader(model_dir, tmp_path, monkeypatch):
    """`load=CKPT[,iteration=N]` goes to `models.load_megatron_lm` (tested with real checkpoints where the
    loader is); a stand-in returns the HF model so that the adapter around it runs for real."""
    from megatron_jreg.evaluate import lm_eval_model
    from megatron_jreg.evaluate.lm_eval_model import MegatronJregLM
    from megatron_jreg.evaluate.models import load_hf_lm

    calls = []

    def fake_loader(path, iteration=None):
        calls.append((path, iteration))
        return load_hf_lm(model_dir, "cpu", "float32")

    monkeypatch.setattr(lm_eval_model, "load_megatron_lm", fake_loader)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    lm = MegatronJregLM.create_from_arg_string(f"load={ckpt},iteration=20", {"batch_size": "2", "device": "cuda:0"})
    assert calls == [(ckpt, 20)] and lm.batch_size == 2
    assert lm.get_model_info() == {"megatron_jreg_model": {"load": str(ckpt), "iteration": 20}}
    MegatronJregLM.create_from_arg_string(f"pretrained={ckpt}", {})  # a folder without config.json: load=
    assert calls[-1] == (ckpt, None)


@pytest.mark.parametrize(
    ("args", "extra", "message"),
    [
        ("model=gpt2", {}, "--model_args model: unknown to megatron-jreg"),
        ("pretrained=gpt2", {}, "pretrained=gpt2: no such checkpoint directory (nor a Hugging Face folder)"),
        ("pretrained={model},hf={model}", {}, "pretrained= names the model as load= or hf= do"),
        ("", {}, "give exactly one of load= and hf="),
        ("load={ckpt},hf={model}", {}, "give exactly one of load= and hf="),
        ("load={ckpt},dtype=float32", {}, "apply to hf="),
        ("hf={model},iteration=3", {}, "iteration= selects a checkpoint"),
        ("hf={model},dtype=int8", {}, "dtype=int8"),
        ("hf={model},max_length=1", {}, "max_length=1"),
        ("hf={model}", {"batch_size": "auto"}, "--batch_size auto"),
        ("hf={model}", {"batch_size": 0}, "--batch_size 0"),
        ("load=/nonexistent/ckpt", {}, "load=/nonexistent/ckpt: no such checkpoint"),
    ],
)
def test_bad_model_args_name_the_argument(args, extra, message, model_dir, tmp_path):
    from megatron_jreg.evaluate.lm_eval_model import MegatronJregLM, ModelArgsError

    arg_string = args.format(model=model_dir, ckpt=tmp_path)
    with pytest.raises(ModelArgsError) as info:
        MegatronJregLM.create_from_arg_string(arg_string, extra)
    assert message in str(info.value) and "\n" not in str(info.value)
