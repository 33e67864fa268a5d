"""Hub ids resolved from a local Hugging Face cache (offline), for `analyze --model` and `evaluate --hf`.

The cache is built here in huggingface_hub's layout: blobs/ named by content hash, snapshots/<commit>/
holding relative symlinks into blobs/, refs/<branch> holding the commit.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_jreg import hub
from megatron_jreg.data.text import lambada_passages
from tests.test_analysis import VOCAB, family_config, one_thread  # noqa: F401 (one_thread: autouse fixture)

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


def cache_repo(cache: Path, repo_id: str, files: Path, commit: str, ref: str | None = "main") -> Path:
    """Put the files of folder `files` into `cache` as snapshot `commit` of `repo_id`; returns the snapshot."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for path in sorted(files.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    from tests._toy import save_random_model, train_tokenizer

    tokenizer = train_tokenizer(lambada_passages()[:200], vocab_size=VOCAB)
    return save_random_model(family_config("llama"), tmp_path_factory.mktemp("m") / "tiny", tokenizer)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh hub cache, as huggingface_hub reads HF_HUB_CACHE when it is imported."""
    from huggingface_hub import constants

    root = tmp_path / "hf-cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    return root


def test_cache_location_is_huggingface_hubs(tmp_path):
    """The folder huggingface_hub itself uses, by its environment variables (read in a fresh process)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "XDG_"))}
    script = "from megatron_jreg import hub; print(hub.hub_cache())"
    for extra, expected in (({"HOME": str(tmp_path)}, tmp_path / ".cache" / "huggingface" / "hub"),
                            ({"HF_HOME": str(tmp_path / "h")}, tmp_path / "h" / "hub"),
                            ({"HF_HUB_CACHE": str(tmp_path / "x")}, tmp_path / "x")):
        out = subprocess.run([sys.executable, "-c", script], env={**env, **extra}, capture_output=True, text=True,
                             check=True, cwd=Path(__file__).resolve().parents[1]).stdout.strip()
        assert Path(out) == expected


def test_resolve_snapshots_revisions_and_files(model_folder, cache, tmp_path, monkeypatch):
    main = cache_repo(cache, "org/tiny", model_folder, COMMIT_A)
    other = cache_repo(cache, "org/tiny", model_folder, COMMIT_B, ref="dev")
    assert hub.resolve("org/tiny") == main
    assert hub.resolve("org/tiny@dev") == other
    assert hub.resolve("org/tiny@bbbbbbb") == other  # a commit prefix
    assert hub.resolve(f"org/tiny@{COMMIT_A}/config.json") == main / "config.json"
    assert json.loads(hub.resolve("org/tiny/config.json").read_text())["model_type"] == "llama"
    assert hub.describe(hub.resolve("org/tiny")) == f"org/tiny@{COMMIT_A}"
    assert hub.describe(model_folder) is None
    legacy = cache_repo(cache, "tiny2", model_folder, COMMIT_A)  # one-part ids (gpt2-style)
    assert hub.resolve("tiny2") == legacy

    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)  # a local folder wins over the cache
    assert hub.resolve("org/tiny") == Path("org/tiny")
    assert hub.resolve("/no/such/absolute/path") == Path("/no/such/absolute/path")  # not an id: left to the caller


def test_resolve_errors_name_the_cache(model_folder, cache):
    cache_repo(cache, "org/tiny", model_folder, COMMIT_A)
    cases = {
        "org/absent": f"no models--org--absent in the Hugging Face cache {cache}",
        "org/tiny@v9": "org/tiny@v9: no such branch, tag or commit",
        "org/tiny/model.gguf": "has no model.gguf",
    }
    for spec, message in cases.items():
        with pytest.raises(hub.HubError) as info:
            hub.resolve(spec, "--model")
        text = str(info.value)
        assert message in text and text.startswith(f"--model {spec}") and "\n" not in text
    assert "hf download org/absent" in str(pytest.raises(hub.HubError, hub.resolve, "org/absent").value)

    cache_repo(cache, "org/two", model_folder, COMMIT_A, ref=None)
    cache_repo(cache, "org/two", model_folder, COMMIT_B, ref=None)
    with pytest.raises(hub.HubError, match="no refs/main and 2 snapshots; choose one with org/two@COMMIT"):
        hub.resolve("org/two")
    assert hub.resolve("org/two@aaaa").name == COMMIT_A

    stale = cache / "models--org--stale"
    (stale / "snapshots" / COMMIT_A).mkdir(parents=True)
    (stale / "refs").mkdir()
    (stale / "refs" / "main").write_text(COMMIT_B)
    with pytest.raises(hub.HubError, match="points to commit bbbbbbbbbbbb, which is not in"):
        hub.resolve("org/stale")

    broken = cache_repo(cache, "org/broken", model_folder, COMMIT_A)
    blob = (broken / "model.safetensors").resolve()
    blob.unlink()  # the download of this file never finished
    with pytest.raises(hub.HubError, match="model.safetensors in .* points to a blob that is not there"):
        hub.resolve("org/broken")


def test_analyze_and_evaluate_take_hub_ids(model_folder, cache, tmp_path, capsys):
    from megatron_jreg.analysis.cli import main as analyze
    from megatron_jreg.evaluate import cli as evaluate_cli

    cache_repo(cache, "org/tiny", model_folder, COMMIT_A)
    common = ["--num-samples", "3", "--max-length", "40", "--no-progress"]
    assert analyze(["--model", "org/tiny", "--output", str(tmp_path / "hub"), *common]) == 0
    assert analyze(["--model", str(model_folder), "--output", str(tmp_path / "local"), *common]) == 0
    by_id = json.loads((tmp_path / "hub" / "results.json").read_text())["models"][0]
    local = json.loads((tmp_path / "local" / "results.json").read_text())["models"][0]
    assert by_id["model"] == "tiny" and by_id["psi"] == local["psi"]
    assert by_id["path"].endswith(f"snapshots/{COMMIT_A}")

    out = tmp_path / "eval.json"
    argv = ["--hf", "org/tiny", "--tasks", "lambada", "--limit", "3", "--output", str(out)]
    assert evaluate_cli.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["model"]["hub_id"] == f"org/tiny@{COMMIT_A}" and record["samples"] == {"lambada": 3}

    capsys.readouterr()
    assert analyze(["--model", "org/missing", "--output", str(tmp_path / "x"), *common]) == 2
    assert evaluate_cli.main(["--hf", "org/missing", "--tasks", "lambada"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and all(f"no models--org--missing in the Hugging Face cache {cache}" in e for e in errors)


def test_a_folder_is_checked_once_per_load(model_folder, tmp_path, monkeypatch):
    """analyze and evaluate check a Hugging Face folder (model_files.inspect_model_folder) and read each
    safetensors header once per load: the spec carries the headers to the stream decision and the loader,
    load_causal_lm(checked=True) skips the check its caller made (were up to three reads in analyze)."""
    import megatron_jreg.model_files as model_files
    from megatron_jreg.analysis.cli import main as analyze
    from megatron_jreg.evaluate import cli as evaluate_cli

    calls: list[Path] = []
    for name in ("inspect_model_folder", "read_safetensors_header"):
        real = getattr(model_files, name)

        def counted(path, *args, real=real, **kwargs):
            calls.append(Path(path))
            return real(path, *args, **kwargs)

        for module in [m for key, m in sys.modules.items() if key.startswith("megatron_jreg")]:
            if getattr(module, name, None) is real:  # every module that imported it by name
                monkeypatch.setattr(module, name, counted)
    common = ["--num-samples", "3", "--max-length", "40", "--no-progress"]
    assert analyze(["--model", str(model_folder), "--output", str(tmp_path / "a"), *common]) == 0
    assert calls == [model_folder, model_folder / "model.safetensors"]
    calls.clear()
    argv = ["--hf", str(model_folder), "--tasks", "lambada", "--limit", "2", "--output", str(tmp_path / "e.json")]
    assert evaluate_cli.main(argv) == 0
    assert calls == [model_folder, model_folder / "model.safetensors"]


def test_load_shows_no_weight_bar_in_a_log(model_folder, capfd):
    """transformers 5's "Loading weights" bar is shown on a terminal only (a log file got every redraw), and
    its bar setting is left as it was."""
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()
    hub.load_causal_lm(model_folder, where=f"--model {model_folder}")
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()
