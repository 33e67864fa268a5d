"""`megatron-jreg analyze` end to end: flags, data specs, model lists, checkpoint series, outputs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from megatron_jreg.cli import main as jreg_main
from megatron_jreg.data.text import lambada_passages
from tests._terminal import sigint_default
from tests.test_analysis import VOCAB, family_config, one_thread  # noqa: F401 (one_thread: autouse fixture)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A Llama and a GPT-2 folder, and a 'run' of three Llama checkpoints named out of step order."""
    from tests._toy import save_random_model, train_tokenizer

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
    from megatron_jreg.data.text import read_samples

    (tmp_path / "d.jsonl").write_text('{"body": "first"}\n{"body": ""}\n{"body": "second"}\n')
    (tmp_path / "w.txt").write_text(" = A = \n alpha \n = B = \n beta \n")
    (tmp_path / "p.txt").write_text("one\n\ntwo\n\nthree\n")
    assert read_samples(f"jsonl:{tmp_path / 'd.jsonl'}:body", None) == ["first", "second"]
    assert len(read_samples(f"wikitext:{tmp_path / 'w.txt'}", None)) == 2
    assert read_samples(f"text:{tmp_path / 'p.txt'}", 2) == ["one", "two"]
    assert read_samples("lambada", 3) == lambada_passages()[:3]  # full passages, target word included


def test_megatron_checkpoints_are_routed_to_the_megatron_source(tmp_path, monkeypatch):
    """Run directories and iter_* folders go to megatron_source.load_megatron_source (the lead's TODO)."""
    import torch

    from megatron_jreg.analysis import loading, megatron_source
    from megatron_jreg.analysis.loading import checkpoint_step, resolve_models

    run = tmp_path / "run"
    (run / "iter_0000200").mkdir(parents=True)
    (run / "iter_0000010").mkdir()
    (run / "latest_checkpointed_iteration.txt").write_text("200")
    bare = tmp_path / "bare"
    (bare / "iter_0000005").mkdir(parents=True)
    assert loading.identify(run) == loading.identify(bare) == ("megatron", None, None)
    assert loading.identify(run / "iter_0000010") == ("megatron", None, None)

    specs = resolve_models([], str(run / "iter_*"))
    assert [s.step for s in specs] == [10, 200] and {s.kind for s in specs} == {"megatron"}
    assert checkpoint_step(Path("iter_0001000")) == 1000

    calls = []
    monkeypatch.setattr(megatron_source, "load_megatron_source", lambda path, **kw: calls.append((path, kw)))
    loading.load_source(specs[0], dtype=torch.float32, device=torch.device("cpu"))
    assert calls[0][0] == run / "iter_0000010" and calls[0][1]["label"] == specs[0].label


def test_config_validation():
    from megatron_jreg.analysis import source
    from megatron_jreg.analysis.run import AnalyzeConfig

    with pytest.raises(source.AnalysisError, match="--distance"):
        AnalyzeConfig(models=["x"], distance="euclid")
    with pytest.raises(source.AnalysisError, match="--dtype"):
        AnalyzeConfig(models=["x"], dtype="float64")
    assert AnalyzeConfig(models=["x"], num_samples=None).num_samples is None


def test_layer_redundancy_outputs_and_labels(models, tmp_path, capsys):
    """--remove-layers, --positions last and --distance cosine: the table, results.json (with the definitions
    named), the CSV files and the plots carry the new measures and say which distance and tokens they use."""
    from matplotlib.image import imread

    from megatron_jreg.analysis.cli import main

    out = tmp_path / "out"
    argv = ["--model", str(models / "llama"), "--checkpoints", str(models / "run" / "checkpoint-*"), "--num-samples",
            "4", "--max-length", "40", "--remove-layers", "--top-k", "1,3", "--distance", "cosine", "--positions",
            "last", "--output", str(out), "--no-progress"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    table = captured.out
    for fragment in ("cosine distance 1 − cos", "the last token of each sample", "Ψ_L/mid", "‖h_L‖/‖h_0‖",
                     "ΔCE top1", "ΔCE top3", "Reading", "largest rise of Ψ is at layer",
                     "Reference: Shibata et al. 2026", "Table 2"):
        assert fragment in table, fragment
    assert "truncated to --max-length 40" in captured.err and "model's context" not in captured.err

    payload = json.loads((out / "results.json").read_text())
    assert payload["settings"]["remove_layers"] and payload["settings"]["top_k"] == [1, 3]
    assert {"psi", "zeta", "layer_distances", "residual_norms", "layer_removal"} <= set(payload["definitions"])
    record = payload["models"][0]
    assert record["distance"] == "cosine" and record["positions"] == "last" and record["tokens"] == 4
    assert record["step"] is None and [r["step"] for r in payload["models"][1:]] == [20, 300, 1000]
    removal = record["layer_removal"]
    assert removal["top_k"] == [1, 3] and len(removal["delta_ce"]) == record["L"] == 4
    assert removal["predicted_tokens"] == 4 and "nats per predicted token" in removal["definition"]
    assert record["layer_distances"][0] == pytest.approx(record["psi"], abs=1e-7)
    assert len(record["layer_distances"]) == 4 and len(record["residual_norms"]) == 5
    growth = record["residual_norms"][-1] / record["residual_norms"][0]
    assert record["residual_growth"] == pytest.approx(growth) and "residual_growth" in payload["definitions"]
    header, row = table.splitlines()[1:4:2]  # the header and the first model's row (cells right-aligned)
    assert row[: header.index("‖h_L‖/‖h_0‖") + len("‖h_L‖/‖h_0‖")].split()[-1] == f"{growth:.2f}"
    assert record["largest_rise"]["layer"] in range(2, 5) and record["reading"].startswith("llama: Ψ_L = ")

    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {row["distance"] for row in rows} == {"cosine"} and {row["positions"] for row in rows} == {"last"}
    assert float(rows[0]["delta_ce_top3"]) == pytest.approx(removal["delta_ce_top"][1])
    assert float(rows[0]["residual_growth"]) == pytest.approx(growth)
    with open(out / "layers.csv", newline="") as f:
        layers = list(csv.DictReader(f))
    assert {row["distance"] for row in layers} == {"cosine"}
    assert float(layers[0]["delta_ce"]) == pytest.approx(removal["delta_ce"][0])
    with open(out / "layer_distances.csv", newline="") as f:
        assert sum(1 for _ in csv.DictReader(f)) == 4 * (4 * 5 // 2)  # L(L+1)/2 pairs per model
    for name in ("removal.png", "layer_distances.png", "residual_norms.png", "zeta_series.png"):
        image = imread(out / name)
        assert image.shape[0] > 300 and image[..., :3].std() > 0.05, name


def test_help_shows_the_defaults(capsys):
    from megatron_jreg.analysis.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for fragment in ("or all (default: 100)", "(default: 8)", "(default: jump_analysis)",
                     "(default: 1,2,3, those up to the model's number of layers)",
                     "(default: all)", "(default: angular)"):
        assert fragment in text, fragment


def test_revisions_of_a_cached_hub_model_are_a_series(models, tmp_path, monkeypatch, capsys):
    """--revision A,B: each revision read from the local cache (refs/<name>), the step from its name."""
    from huggingface_hub import constants

    from megatron_jreg.analysis.cli import main
    from tests.test_hub import cache_repo

    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    for i, (ref, folder) in enumerate((("step20", "checkpoint-20"), ("step1000", "checkpoint-1000"))):
        cache_repo(cache, "org/tiny", models / "run" / folder, f"{i + 1}" * 40, ref=ref)
    out = tmp_path / "out"
    argv = ["--model", "org/tiny", "--revision", "step1000,step20", "--num-samples", "2", "--max-length", "16",
            "--output", str(out), "--no-progress"]
    assert main(argv) == 0
    records = json.loads((out / "results.json").read_text())["models"]
    assert [(r["model"], r["step"], r["revision"]) for r in records] == [
        ("tiny@step1000", 1000, "step1000"), ("tiny@step20", 20, "step20")]
    assert records[0]["psi"] != records[1]["psi"]  # two different snapshots were measured
    assert main([*argv[:2], "--revision", "step5", *argv[4:]]) == 2
    assert "org/tiny@step5" in capsys.readouterr().err


def test_ctrl_c_ends_in_one_line_and_keeps_the_measured_models(models, tmp_path, monkeypatch, capsys):
    """Ctrl-C while the second model is measured: exit 130, one line, the first model's results written."""
    from megatron_jreg.analysis import run
    from megatron_jreg.analysis.cli import main

    real = run.measure
    calls = []

    def interrupted_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(run, "measure", interrupted_second)
    out = tmp_path / "out"
    argv = ["--model", str(models / "llama"), "--model", str(models / "gpt2"), "--num-samples", "2", "--max-length",
            "16", "--output", str(out), "--no-progress"]
    assert main(argv) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"megatron-jreg analyze: interrupted while measuring model 2 of 2; the 1 model(s) measured " \
                      f"before it are in {out}"
    assert [r["model"] for r in json.loads((out / "results.json").read_text())["models"]] == ["llama"]
    calls.clear()
    calls.append(1)  # the first model is now the interrupted one: nothing to write
    assert main(argv[:2] + argv[4:] + ["--output", str(tmp_path / "none")]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("; nothing written")
    assert not (tmp_path / "none").exists()


def convert_to_megatron(rank: int, world: int, hf: str, out: str) -> None:
    from megatron_jreg.convert.from_hf import hf_to_mcore

    hf_to_mcore(hf, Path(out), verify=False)


@pytest.mark.multirank
def test_megatron_run_folder_steps_and_an_incomplete_iteration(models, tmp_path):
    """A run folder with iterations 10 and 20 and an incomplete 30 (its data file never written): --checkpoints
    measures 10 and 20 and names 30 in one line, with no reader traceback; --model of an iteration folder and of
    the run folder shows each real step."""
    import shutil
    import subprocess
    import sys

    from tests.distributed import run_ranks

    run_ranks(convert_to_megatron, 1, str(models / "llama"), str(tmp_path / "mc"))
    run_dir = tmp_path / "run"
    for step in (10, 20, 30):
        shutil.copytree(tmp_path / "mc" / "release", run_dir / f"iter_{step:07d}")
    for data in (run_dir / "iter_0000030").glob("*.distcp"):
        data.unlink()
    (run_dir / "latest_checkpointed_iteration.txt").write_text("20")
    common = ["--num-samples", "3", "--max-length", "24", "--no-progress"]

    def analyze(*argv: str) -> tuple[subprocess.CompletedProcess, list]:
        out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
        done = subprocess.run([sys.executable, "-m", "megatron_jreg.cli", "analyze", *argv, *common, "--output",
                               str(out)], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
        return done, json.loads((out / "results.json").read_text())["models"]

    done, records = analyze("--checkpoints", str(run_dir / "iter_*"), "--remove-layers", "--top-k", "1,2")
    skipped = [line for line in done.stderr.splitlines() if "skipped" in line]
    assert len(skipped) == 1 and "iter_0000030" in skipped[0], skipped
    assert "incomplete" in skipped[0] or "truncated or corrupt" in skipped[0], skipped  # with or without a manifest
    assert [(r["model"], r["step"]) for r in records] == [("iter_0000010", 10), ("iter_0000020", 20)]
    assert records[0]["layer_removal"]["delta_ce"] == records[1]["layer_removal"]["delta_ce"]  # the same weights
    _, records = analyze("--model", str(run_dir / "iter_0000010"), "--model", str(run_dir))
    assert [r["step"] for r in records] == [10, 20]


def test_progress_bars_only_on_a_terminal_by_default(models, tmp_path, capsys):
    """No --progress flag: no bar when stderr is not a terminal (a Slurm log, a pipe), as evaluate, generate and
    train; --progress draws one (layer removal's too)."""
    from megatron_jreg.analysis.cli import main

    argv = ["--model", str(models / "llama"), "--num-samples", "3", "--max-length", "24", "--remove-layers",
            "--top-k", "1"]
    assert main(argv + ["--output", str(tmp_path / "quiet")]) == 0
    quiet = capsys.readouterr().err
    assert "tok/s" not in quiet and "layer/s" not in quiet and "\r" not in quiet, quiet
    assert main(argv + ["--output", str(tmp_path / "bars"), "--progress"]) == 0
    bars = capsys.readouterr().err
    assert "tok/s" in bars and "layer/s" in bars, bars


@pytest.mark.slow
def test_sigint_during_a_measurement_is_one_line(models, tmp_path):
    """A real Ctrl-C (SIGINT) while the first model is measured: exit 130, the last line says so, no traceback."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "megatron_jreg.cli", "analyze", "--model", str(models / "llama"),
                             "--num-samples", "all", "--no-progress", "--output", str(tmp_path / "out")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    lines = []
    while not any("loading" in line for line in lines):
        line = proc.stderr.readline()
        assert line, "analyze ended before loading the model"
        lines.append(line)
    time.sleep(3)  # inside the measurement of 5,153 passages
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    err = "".join(lines) + err
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err + out, err[-3000:]
    assert err.strip().splitlines()[-1] == ("megatron-jreg analyze: interrupted while measuring model 1 of 1; "
                                            "nothing written")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_closed_stdout_and_a_compiled_op_leave_only_analyze_s_own_lines(models, tmp_path):
    """issue 46.6/46.8: stdout whose reader has gone (`analyze ... | head -1`) ended in a BrokenPipeError traceback
    after writing every file (exit 1; 0 before); now it finishes quietly, exit 0, every file written. The JREG op
    compiled on the CPU (as from 4M elements of a real model; forced here) printed torch's "No CUDA runtime is
    found" line on every analyze."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # the reader is gone before analyze prints anything
    try:
        proc = subprocess.run([sys.executable, "-m", "megatron_jreg.cli", "analyze", "--model", str(models / "llama"),
                               "--num-samples", "4", "--no-progress", "--output", str(tmp_path / "out")],
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=600,
                              env={**os.environ, "MEGATRON_JREG_KERNEL": "compiled"})
    finally:
        os.close(write)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Broken pipe" not in proc.stderr, proc.stderr[-3000:]
    assert "No CUDA runtime" not in proc.stderr, proc.stderr[-3000:]
    written = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"results.json", "results.csv", "layers.csv", "psi_profiles.png", "residual_norms.png"} <= written
