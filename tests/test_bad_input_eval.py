"""Bad input and silent wrongs for evaluate, generate, compare, convert and the lm-eval wrapper (issue 32):
each ends in one line that names the file or flag and the fix, exit 2, before any work where it can, and
nothing is written.

- A model whose weights hold NaN, or a value beyond float16 loaded with `--dtype float16`: refused at load
  (was: accuracy 0.0 and perplexity "-", or an empty answer, exit 0). Weights that are finite in float16 but
  whose activations overflow it: refused at the first non-finite logit, naming --dtype.
- `compare` with a "seed" that is not a number, `convert` into a folder it cannot write or from a file
  given as `--hf`, the lm-eval wrapper on a task whose dataset is missing (named before the model loads).

The Megatron-LM checkpoint cases (the loader's own refusal, shared by evaluate, generate and convert) import
megatron-core and are `slow`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO / "examples" / "data" / "wikitext-2" / "valid.txt"
QUESTION = {"question_id": 1, "category": "writing", "turns": ["Write about lobsters."]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A random 2-layer Llama (untied) with a 300-token BPE, float32 safetensors."""
    import torch

    from tests._toy import save_random_llama

    torch.set_num_threads(1)  # a tiny model: more threads only wait on each other on a shared machine
    texts = WIKITEXT.read_text(encoding="utf-8")[:20000].splitlines()
    return save_random_llama(tmp_path_factory.mktemp("bad") / "tiny", texts, layers=2, hidden=64, ffn=128, heads=4,
                             kv_heads=2, vocab=300, tied=False)


def edited(tiny: Path, folder: Path, edits: list[tuple[str, float, bool]]) -> Path:
    """A copy of `tiny` with each (tensor name, value, first element only) edit: the tensor filled with the value,
    or only its first element set to it."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny, folder)
    tensors = load_file(folder / "model.safetensors")
    for name, value, element in edits:
        if element:
            tensors[name].view(-1)[0] = value
        else:
            tensors[name].fill_(value)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


NAN = [("model.layers.1.mlp.down_proj.weight", float("nan"), False)]
BEYOND_FP16 = [("model.layers.0.self_attn.q_proj.weight", 1e6, True)]  # one value: inf in float16, finite in float32
# Weights finite in float16, activations not: equal embeddings normalise to ~1 per feature, so the first MLP's
# gate and up projections (all 100) give ~6,400 each and their product ~4e7 per feature (float16 ends at 65,504).
OVERFLOWS_FP16 = [("model.embed_tokens.weight", 1.0, False), ("model.layers.0.mlp.gate_proj.weight", 100.0, False),
                  ("model.layers.0.mlp.up_proj.weight", 100.0, False)]


def run(command: str, argv: list, capsys) -> tuple[int, str, str]:
    import importlib

    module = {"evaluate": "megatron_jreg.evaluate.cli", "generate": "megatron_jreg.generate.cli",
              "compare": "megatron_jreg.evaluate.compare", "convert": "megatron_jreg.convert.cli",
              "lm-eval": "megatron_jreg.evaluate.lm_eval_model"}[command]
    rc = importlib.import_module(module).main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def quiet(err: str) -> bool:
    """Nothing on stderr but transformers' "Loading weights" bar."""
    return all(line.startswith("Loading weights") for line in err.strip().splitlines())


def one_line(err: str, prog: str) -> str:
    """The error line, checked to be the only line of stderr besides transformers' "Loading weights" bar."""
    lines = [line for line in err.strip().splitlines() if not line.startswith("Loading weights")]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"megatron-jreg {prog}: error:"), err
    return lines[0]


@pytest.fixture
def offline(monkeypatch):
    """evaluate and generate switch the Hugging Face libraries offline for the process: undone after each test."""
    import datasets
    import huggingface_hub.constants

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)


# ------------------------------------------------------------------------------------------ non-finite models
@pytest.mark.parametrize(("case", "dtype", "needles"), [
    (NAN, "float32", ("model.layers.1.mlp.down_proj.weight", "NaN", "earlier checkpoint")),
    (BEYOND_FP16, "float16", ("q_proj.weight", "1 inf in float16", "beyond float16's range", "--dtype")),
    (OVERFLOWS_FP16, "float16", ("logits are NaN/inf", "overflow float16", "--dtype float32")),
], ids=["nan-weights", "beyond-float16", "activations-overflow-float16"])
def test_evaluate_and_generate_refuse_a_model_that_computes_no_numbers(tiny, tmp_path, capsys, offline, case,
                                                                       dtype, needles):
    """Was: evaluate printed acc 0.0000, perplexity "-" and exited 0; generate wrote an empty answer."""
    folder = edited(tiny, tmp_path / "model", case)
    rc, out, err = run("evaluate", ["--hf", folder, "--dtype", dtype, "--limit", 4, "--output", tmp_path / "r.json"],
                       capsys)
    line = one_line(err, "evaluate")
    assert rc == 2 and all(n in line for n in needles), line
    assert "lambada" not in out and not (tmp_path / "r.json").exists()

    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps(QUESTION) + "\n")
    answers = tmp_path / "answers.jsonl"
    rc, out, err = run("generate", ["--hf", folder, "--dtype", dtype, "--prompts", questions, "--output", answers,
                                    "--max-new-tokens", 4], capsys)
    line = one_line(err, "generate")
    assert rc == 2 and all(n in line for n in needles), line
    assert not answers.exists()


def test_the_same_model_in_float32_is_scored(tiny, tmp_path, capsys, offline):
    """The float16 overflow case is a float16 problem: in float32 the same weights evaluate (the refusal above is
    not a refusal of large weights)."""
    folder = edited(tiny, tmp_path / "model", OVERFLOWS_FP16)
    rc, out, err = run("evaluate", ["--hf", folder, "--dtype", "float32", "--limit", 4], capsys)
    assert rc == 0, err
    assert "lambada  acc" in out


# ------------------------------------------------------------------------------------------------ compare
def test_compare_refuses_a_seed_that_is_not_a_number(tmp_path, capsys):
    """Was: a TypeError traceback (sorting "2" with 1)."""
    files = {}
    for name, seed in (("b1", 1), ("b2", "2"), ("j1", 1), ("j2", 2)):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps({"results": {"lambada": {"acc": 0.5}}, "seed": seed}))
    rc, out, err = run("compare", ["--baseline", files["b1"], files["b2"], "--jreg", files["j1"], files["j2"]], capsys)
    line = one_line(err, "compare")
    assert rc == 2 and 'b2.json: "seed": "2" is not a whole number' in line and '"seed": 2' in line


# ------------------------------------------------------------------------------------------------ convert
def test_convert_hf_given_a_file_names_its_folder(tiny, tmp_path, capsys):
    """Was: NotADirectoryError traceback after the imports."""
    weights = tiny / "model.safetensors"
    rc, _, err = run("convert", ["hf-to-mcore", "--hf", weights, "--output", tmp_path / "out"], capsys)
    line = one_line(err, "convert")
    assert rc == 2 and f"--hf {weights}: a file" in line and f"--hf {tiny}" in line
    assert not (tmp_path / "out").exists()


def test_convert_refuses_an_output_it_cannot_use_before_reading_anything(tiny, tmp_path, capsys):
    """An --output that holds files is refused up front for both directions (was: after loading the model)."""
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    for argv in (["hf-to-mcore", "--hf", tiny], ["mcore-to-hf", "--load", tmp_path / "no-such-checkpoint"]):
        rc, _, err = run("convert", [*argv, "--output", busy], capsys)
        line = one_line(err, "convert")
        assert rc == 2 and f"--output {busy} exists and is not empty" in line
    assert (busy / "keep.txt").read_text() == "mine"


def test_convert_into_a_read_only_folder_is_one_line(tiny, tmp_path):
    """Was: PermissionError traceback from the staging folder. Run as a process that cannot override permission
    bits (root gives up CAP_DAC_OVERRIDE through setpriv), as an ordinary user's would be."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv: cannot drop the permission override")
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        proc = subprocess.run([*prefix, sys.executable, "-m", "megatron_jreg.cli", "convert", "hf-to-mcore", "--hf",
                               str(tiny), "--output", str(locked / "ckpt")], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    finally:
        locked.chmod(0o755)
    line = one_line(proc.stderr, "convert")
    assert proc.returncode == 2 and f"cannot write in {locked}" in line, proc.stderr
    assert not list(locked.iterdir())


# ---------------------------------------------------------------------------------------------- lm-eval
def test_lm_eval_wrapper_names_a_missing_dataset_before_the_model(tmp_path, capsys, offline, monkeypatch):
    """Was: the checkpoint loaded, then datasets' traceback. The model here does not even exist: the dataset is
    named first, as `evaluate` names it."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "empty-datasets-cache")
    rc, _, err = run("lm-eval", ["--model", "megatron-jreg", "--model_args", f"load={tmp_path / 'no-ckpt'}",
                                 "--tasks", "sciq"], capsys)
    assert rc == 2, err
    assert "megatron-jreg lm-eval: error: these lm-eval tasks have no data on this machine" in err
    assert "sciq: needs the Hugging Face dataset allenai/sciq" in err and "no-ckpt" not in err
    assert "Traceback" not in err


# --------------------------------------------------------------------------- Megatron-LM checkpoints (slow)
def nan_copy(good: Path, out: Path) -> None:
    """`good` (a checkpoint) with one weight set to NaN, saved again at `out` (run in its own process)."""
    import torch

    from megatron_jreg.checkpoints import Checkpoint
    from megatron_jreg.convert.from_hf import save_release_checkpoint

    checkpoint = Checkpoint.open(good)
    loaded = checkpoint.load_model()
    with torch.no_grad():
        loaded.model.decoder.layers[1].mlp.linear_fc2.weight.fill_(float("nan"))
    save_release_checkpoint(out, loaded.model, checkpoint.args, {"source": "test"})


@pytest.mark.slow
def test_megatron_checkpoints_import_verified_and_nan_weights_refused_by_every_reader(tiny, tmp_path):
    """`convert hf-to-mcore` prints a train command with what this machine needs (`--transformer-impl local`
    without Transformer Engine) and writes integrity.json (was: none, so the next load called the project's own
    output unverified); a good checkpoint evaluates without megatron-core's CPU warnings (was ~25 lines); one
    holding NaN is refused by the loader, in one line, for evaluate, generate and convert (was: evaluate acc 0.0
    exit 0, generate an empty answer)."""
    from megatron_jreg.checkpoints.files import verify_integrity
    from megatron_jreg.layer_spec import have_transformer_engine

    def cli(*argv) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "megatron_jreg.cli", *map(str, argv)], capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)

    good = tmp_path / "good"
    made = cli("convert", "hf-to-mcore", "--hf", tiny, "--output", good)
    assert made.returncode == 0, made.stderr[-3000:]
    command = next(line for line in made.stdout.splitlines() if line.strip().startswith("megatron-jreg train"))
    assert ("--transformer-impl local" in command) == (not have_transformer_engine()), command
    assert quiet(made.stderr), made.stderr  # no Transformer Engine/Apex fallbacks, deprecations, DCP notices
    assert verify_integrity(good / "release") == len([p for p in (good / "release").iterdir()]) - 1

    evaluated = cli("evaluate", "--load", good, "--limit", 2)
    assert evaluated.returncode == 0, evaluated.stderr
    assert quiet(evaluated.stderr), evaluated.stderr
    assert "lambada  acc" in evaluated.stdout and "WARNING" not in evaluated.stdout

    nan = tmp_path / "nan"
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from pathlib import Path; "
            f"from tests.test_bad_input_eval import nan_copy; nan_copy(Path({str(good)!r}), Path({str(nan)!r}))")
    copied = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert copied.returncode == 0, copied.stderr[-3000:]
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps(QUESTION) + "\n")
    for prog, argv in (
        ("evaluate", ["--load", nan, "--limit", 2]),
        ("generate", ["--load", nan, "--prompts", questions, "--output", tmp_path / "a.jsonl", "--max-new-tokens", 2]),
        ("convert", ["mcore-to-hf", "--load", nan, "--output", tmp_path / "hf"]),
    ):
        proc = cli(prog, *argv)
        line = one_line(proc.stderr, prog)
        assert proc.returncode == 2, proc.stderr
        assert "weight decoder.layers.1.mlp.linear_fc2.weight holds" in line and "NaN" in line, line
    assert not (tmp_path / "a.jsonl").exists() and not (tmp_path / "hf").exists()


@pytest.mark.slow
@pytest.mark.parametrize("stdout", ["closed-pipe", "dev-full"])
def test_a_failing_stdout_loses_no_results(tiny, tmp_path, stdout):
    """issue 46.7: `evaluate ... --output x.json | head -n 0` ended "[Errno 32] Broken pipe", exit 1, with no x.json
    although every passage was scored (stdout on /dev/full the same). The results are written before anything is
    printed; a pipe whose reader left is not an error of the run (exit 0, quiet); a full stdout is one line on stderr
    and exit 1, the results written."""
    output = tmp_path / "x.json"
    argv = [sys.executable, "-m", "megatron_jreg.cli", "evaluate", "--hf", str(tiny), "--tasks", "lambada",
            "--limit", "4", "--output", str(output)]
    if stdout == "closed-pipe":
        read, write = os.pipe()
        os.close(read)  # `| head -n 0`: the reader is gone before evaluate prints
        try:
            proc = subprocess.run(argv, stdout=write, stderr=subprocess.PIPE, text=True, timeout=600)
        finally:
            os.close(write)
    else:
        with open("/dev/full", "w") as full:
            proc = subprocess.run(argv, stdout=full, stderr=subprocess.PIPE, text=True, timeout=600)
    err = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("Loading weights"))
    assert "Traceback" not in err and "Broken pipe" not in err, err[-3000:]
    assert json.loads(output.read_text())["samples"] == {"lambada": 4}, output.read_text()[:2000]
    if stdout == "closed-pipe":
        assert proc.returncode == 0 and err == "", err[-3000:]
    else:
        assert proc.returncode == 1, err[-3000:]
        assert err.splitlines() == ["megatron-jreg evaluate: stdout: No space left on device ([Errno 28]): the "
                                    "command goes on without its printed output and writes its files"], err
