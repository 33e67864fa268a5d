"""`megatron-jreg analyze` end to end: flags, data specs, model lists, checkpoint series, outputs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from megatron_jreg.cli import main as jreg_main
from megatron_jreg.data.text import lambada_passages
from tests.test_analysis import VOCAB, family_config, one_thread  # noqa: F401 (one_thread: autouse fixture)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A Llama and a GPT-2 folder, and a 'run' of three Llama checkpoints named out of step order."""
    from megatron_jreg.analysis.toy import save_random_model, train_tokenizer

    root = tmp_path_factory.mktemp("models")
    tokenizer = train_tokenizer(lambada_passages()[:200], vocab_size=VOCAB)
    llama = family_config("llama", layers=4)
    gpt2 = family_config("gpt2", layers=3)
    save_random_model(llama, root / "llama", tokenizer)
    save_random_model(gpt2, root / "gpt2", tokenizer)
    for seed, step in enumerate((1000, 20, 300)):
        save_random_model(llama, root / "run" / f"checkpoint-{step}", tokenizer, seed=seed)
    return root


def test_multi_model_outputs_and_checkpoint_series(models, tmp_path, capsys):
    import torch

    from megatron_jreg import jreg
    from megatron_jreg.analysis.cli import main

    out = tmp_path / "out"
    rc = main(
        ["--model", str(models / "llama"), "--model", str(models / "gpt2"),
         "--checkpoints", str(models / "run" / "checkpoint-*"),
         "--num-samples", "5", "--batch-size", "3", "--max-length", "48", "--output", str(out), "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    table = capsys.readouterr().out
    for label in ("llama", "gpt2", "checkpoint-20", "ζ_L", "median Ψ mid"):
        assert label in table

    payload = json.loads((out / "results.json").read_text())
    assert payload["settings"]["num_samples"] == 5 and payload["settings"]["max_length"] == 48
    records = payload["models"]
    assert [r["model"] for r in records] == ["llama", "gpt2", "checkpoint-20", "checkpoint-300", "checkpoint-1000"]
    assert [r["step"] for r in records] == [None, None, 20, 300, 1000]
    for r in records:
        assert len(r["psi"]) == r["L"] and r["zeta_layers"] == list(range(2, r["L"] + 1))
        psi = torch.tensor(r["psi"], dtype=torch.float64)
        assert r["zeta"] == pytest.approx(jreg.jump_rates(psi).tolist())
        assert r["zeta_L"] == pytest.approx(jreg.final_jumps(psi)["zeta_L"])
        assert r["psi"] == pytest.approx([s / n for s, n in zip(r["displacement_sums"], r["tokens_per_layer"])])
        assert r["tokens"] > 5 and r["truncated_samples"] >= 1  # LAMBADA passages exceed 48 tokens
    assert records[1]["zeta_L-2"] is None  # GPT-2 here has 3 layers: no ζ_{L-2}

    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["model"] for row in rows] == [r["model"] for r in records]
    assert float(rows[0]["zeta_L"]) == pytest.approx(records[0]["zeta_L"])
    with open(out / "layers.csv", newline="") as f:
        assert sum(1 for _ in csv.DictReader(f)) == sum(r["L"] for r in records)

    from matplotlib.image import imread

    for name in ("psi_profiles.png", "zeta_series.png"):
        image = imread(out / name)
        assert image.shape[0] > 300 and image.shape[1] > 300
        assert image[..., :3].std() > 0.05  # curves, axes and text, not a blank canvas


def test_dispatcher_and_errors_name_the_flag(models, tmp_path, capsys):
    from megatron_jreg.analysis.cli import main

    with pytest.raises(SystemExit) as exit_info:
        jreg_main(["analyze", "--help"])
    assert exit_info.value.code == 0 and "--include-final-norm" in capsys.readouterr().out

    cases = [
        (["--model", str(tmp_path / "missing")], "--model"),
        (["--model", str(models / "llama"), "--data", "jsonl:x.jsonl"], "--data"),
        (["--model", str(models / "llama"), "--data", "parquet:x"], "--data"),
        (["--model", str(models / "llama"), "--batch-size", "0"], "--batch-size"),
        (["--checkpoints", str(tmp_path / "nothing-*")], "--checkpoints"),
        ([], "--model"),
    ]
    for argv, flag in cases:
        assert main(argv + ["--output", str(tmp_path / "o"), "--no-progress"]) == 2
        assert flag in capsys.readouterr().err, argv


def test_data_specs(tmp_path):
    from megatron_jreg.analysis.config import load_texts

    (tmp_path / "d.jsonl").write_text('{"body": "first"}\n{"body": ""}\n{"body": "second"}\n')
    (tmp_path / "w.txt").write_text(" = A = \n alpha \n = B = \n beta \n")
    (tmp_path / "p.txt").write_text("one\n\ntwo\n\nthree\n")
    assert load_texts(f"jsonl:{tmp_path / 'd.jsonl'}:body", None) == ["first", "second"]
    assert len(load_texts(f"wikitext:{tmp_path / 'w.txt'}", None)) == 2
    assert load_texts(f"text:{tmp_path / 'p.txt'}", 2) == ["one", "two"]
    assert load_texts("lambada", 3) == lambada_passages()[:3]  # full passages, target word included


def test_megatron_checkpoints_are_routed_to_the_megatron_source(tmp_path, monkeypatch):
    """Run directories and iter_* folders go to megatron_source.load_megatron_source (the lead's TODO)."""
    import torch

    from megatron_jreg.analysis import megatron_source, source
    from megatron_jreg.analysis.config import checkpoint_step, resolve_models

    run = tmp_path / "run"
    (run / "iter_0000200").mkdir(parents=True)
    (run / "iter_0000010").mkdir()
    (run / "latest_checkpointed_iteration.txt").write_text("200")
    bare = tmp_path / "bare"
    (bare / "iter_0000005").mkdir(parents=True)
    assert source.model_kind(run) == source.model_kind(bare) == "megatron"
    assert source.model_kind(run / "iter_0000010") == "megatron"

    specs = resolve_models([], str(run / "iter_*"))
    assert [s.step for s in specs] == [10, 200] and {s.kind for s in specs} == {"megatron"}
    assert checkpoint_step(Path("iter_0001000")) == 1000

    calls = []
    monkeypatch.setattr(megatron_source, "load_megatron_source", lambda path, **kw: calls.append((path, kw)))
    source.load_source(specs[0], dtype=torch.float32, device=torch.device("cpu"))
    assert calls[0][0] == run / "iter_0000010" and calls[0][1]["label"] == specs[0].label


def test_config_validation():
    from megatron_jreg.analysis import source
    from megatron_jreg.analysis.config import AnalyzeConfig

    with pytest.raises(source.AnalysisError, match="--distance"):
        AnalyzeConfig(models=["x"], distance="euclid")
    with pytest.raises(source.AnalysisError, match="--dtype"):
        AnalyzeConfig(models=["x"], dtype="float64")
    assert AnalyzeConfig(models=["x"], num_samples=None).num_samples is None
