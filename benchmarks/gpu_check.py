"""The GPU check: what a first cluster run needs to know, in one call of at most 5 minutes (docs/gpu.md).

Run through `benchmarks/gpu_check.sh` on a bare GPU machine (torch, triton, transformers; no megatron-core, no
Transformer Engine, no registry): what it lacks travels in `.whl/` (`make gpu-wheels`, required: the call carries
it): megatron-core's and einops' wheels in .whl/gpu, Megatron-LM core_v0.19.0's pretrain_gpt.py, gpt_builders.py and
model_provider.py in .whl/megatron-lm. Steps, in the order of what their figures are worth (a run cut short by the
budget loses the last ones), each reported even when another fails:

1. wheels: each wheel of .whl/gpu whose distribution is absent or at another version is unpacked into
   `--site` (first on PYTHONPATH); megatron-core 0.19.2 must import afterwards. A torch other than
   constraints.txt's pin (the lent machine's 2.11 against 2.13) is named: an untested pairing this check tests.
2. JREG op: `benchmarks/jreg_op.py --device cuda --rounds 5 --reps 20 --shapes 16384x2048`: the op as training
   runs it (h_in, h_out not leaves, its gradients added into theirs) less the same graph without it, timed with
   CUDA events over 20 back-to-back calls, its kernels counted by torch's profiler, against its memory floor
   (noted as absent when that benchmark is not in the checkout).
3. numerics: bf16 hidden states → JREG's Ψ and its gradient on the device, against fp64 on the same values
   (near-parallel and generic states): relative error of Ψ, of the gradient, and bf16's own rounding of that
   gradient for scale.
4. training, in one worker process (one import of megatron-core for every run), garbage collected between runs
   (Megatron-LM's --manual-gc leaves Python's collector off after a run: the previous run's model and optimizer
   would stay allocated and bias the memory ratios; each run's record says how many models were still alive):
   - a torch.cuda.set_sync_debug_mode("error") run of JREG steps (forward+backward with JREG's hooks, λ = 1), and
     the syncs that λ = 1 adds to λ = 0 counted in "warn" mode;
   - tokens/s, MFU and the JREG time ratio for the 1B and 170M presets: `megatron-jreg train` at λ = 0 and λ = 1
     in two rounds whose order alternates (λ = 0, λ = 1; then the reverse), each timed over its logged intervals
     after the first; MFU is Megatron-LM's model FLOPs per iteration (num_floating_point_operations, its
     --log-throughput formula) per second over the device's dense bf16 peak, named (`PEAKS`);
   - Megatron-LM's own pretrain_gpt.py (λ = 0 by definition) on the same Megatron-LM arguments, twice per preset:
     its tokens/s and its lm losses against our λ = 0's (the same arguments, seed and mock data);
   - peak memory λ = 1 / λ = 0 at PP = 1 (the throughput runs) and at PP = 2: each pipeline stage alone on the
     one GPU through Megatron-LM's --fake-process-group (its own memory-profiling mode: communication skipped,
     WORLD_SIZE and RANK name the stage), the larger of the two stages' ratios.
5. one `key=value` line (`KEYS` first, in the same order of worth, `nan` where a step failed or is absent).

`--dry-run` does all of it on the CPU at tiny sizes, within 7 minutes (CPU values: MFU against a measured fp32
matmul rate, peak memory the worker's peak RSS reset per run); `--out DIR` (default $OUT) gets three files, fewer
than the 8 a lent machine returns: the console (gpu_check.txt), a JSON of every figure (gpu_check.json) and every
log in one archive (gpu_check_logs.tar.gz). Exit status: 0 all steps ran (absent jreg_op.py included), 1 a step
failed, 2 no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.metadata
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path
from unittest import mock

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
DEFAULT_WHEELS = REPO / ".whl" / "gpu"
DEFAULT_MEGATRON_LM = REPO / ".whl" / "megatron-lm"
MEGATRON_LM_FILES = ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py")  # core_v0.19.0, not in the wheel
REQUIRED = {"megatron-core": "0.19.2"}  # must import after step 1 (setup.py's pin)
# 5 minutes: a machine start (minutes), this check, a rerun and the idle between them fit the device's 15.
BUDGET_S = 300.0
DRY_RUN_BUDGET_S = 420.0  # here, on a shared CPU: the 7 minutes (a loaded 2-core machine needs ~4)
CONSTRAINTS = REPO / "constraints.txt"
# Dense (not sparse) bf16 tensor-core peaks of NVIDIA's datasheets, TFLOP/s, by device name (first match wins).
PEAKS = (("H200 NVL", "H200 NVL", 835.0), ("H200", "H200 SXM", 989.0), ("GH200", "GH200", 989.0),
         ("H100 NVL", "H100 NVL", 835.0), ("H100 PCIe", "H100 PCIe", 756.0), ("H100", "H100 SXM", 989.0),
         ("A100", "A100", 312.0))
PRESET_LABELS = ("1b", "170m")  # the paper's 1B first: its figures are worth more
# The summary line's keys, in the order of worth: the op, the JREG time ratio, MFU, Megatron-LM comparisons, memory.
KEYS = ("op_vs_floor", "op_launches",
        *(f"{k}_{p}" for k in ("time_ratio", "mfu", "loss_vs_megatron_lm", "vs_megatron_lm", "tokens_per_sec",
                               "memory_ratio_pp1", "memory_ratio_pp2") for p in PRESET_LABELS),
        "psi_rel_err", "grad_rel_err", "sync_debug_ok")
OUT_FILES = 8  # what a lent GPU machine returns from $OUT at most
# Without Transformer Engine or apex (docs/gpu.md): the fused kernels only they provide, off.
GPU_FLAGS = ["--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-rope-fusion",
             "--no-masked-softmax-fusion"]
# On the CPU megatron_jreg.compat turns these off for our runs; Megatron-LM's own script gets them as flags.
CPU_FLAGS = [*GPU_FLAGS, "--distributed-backend", "gloo", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
             "--no-persist-layer-norm"]
# The recipes' settings (docs/gpu.md) that act on one GPU: the fused cross-entropy and the manual GC.
RECIPE_FLAGS = ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "native", "--manual-gc"]


class Sizes:
    """The issue's sizes on a GPU; tiny ones for --dry-run on the CPU (same code paths)."""

    def __init__(self, dry_run: bool) -> None:
        self.dry_run = dry_run
        # label -> (megatron-jreg preset, micro-batch, extra architecture flags)
        self.presets = ({"1b": ("tiny", 2, ["--num-layers", "6"]), "170m": ("tiny", 2, [])} if dry_run else
                        {"1b": ("llama-1b", 4, []), "170m": ("llama-170m", 8, [])})
        self.seq_length = 128 if dry_run else 2048
        self.vocab_size = 512 if dry_run else 128256  # the Llama-3 tokenizer's: the paper's 174M / 1.24B
        # timed over the intervals after the first (compilation, allocator warm-up): 10 iterations a run on the GPU
        self.iters, self.log_interval = (6, 2) if dry_run else (15, 5)
        self.rounds = 2
        # 2 iterations: the second holds the optimizer's states beside its activations (the steady peak)
        self.pp2_iters, self.pp2_microbatches = 2, (2 if dry_run else 4)
        self.numerics = (256, 64) if dry_run else (8192, 2048)  # tokens, hidden size
        self.recipe = RECIPE_FLAGS
        # the JREG op's step: at most op_cap_s, and never into the training step's share of the budget
        self.op_cap_s, self.training_s = (120.0, 250.0) if dry_run else (45.0, 220.0)


# -- output ----------------------------------------------------------------------------------------------
class Console:
    """print() to stdout and, when an output folder is set, to OUT/gpu_check.txt."""

    def __init__(self, path: Path | None) -> None:
        self.file = open(path, "w", encoding="utf-8") if path else None  # noqa: SIM115 - closed in close()

    def __call__(self, *parts: object) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        if self.file:
            self.file.write(line + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()


def fmt(value: object) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "nan"
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.6g}" if abs(value) < 1e6 else f"{value:.1f}"
    return re.sub(r"\s+", "_", str(value))


def summary_line(figures: dict) -> str:
    """KEYS first (nan where a step failed), then every other figure in insertion order."""
    keys = [*KEYS, *(k for k in figures if k not in KEYS)]
    return " ".join(f"{k}={fmt(figures.get(k))}" for k in keys)


def device_peak(name: str) -> tuple[str, float] | None:
    """(the device as named in `PEAKS`, its dense bf16 peak in TFLOP/s) for a torch device name, or None."""
    for pattern, label, tflops in PEAKS:
        if pattern in name:
            return label, tflops
    return None


# -- step 1: wheels --------------------------------------------------------------------------------------
def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_info(path: Path) -> tuple[str, str, list[str]]:
    """(distribution, version, tags) from a wheel's file name: name-version(-build)?-python-abi-platform.whl."""
    parts = path.name[: -len(".whl")].split("-")
    if len(parts) not in (5, 6):
        raise ValueError(f"{path.name}: not a wheel file name")
    return normalize(parts[0]), parts[1], parts[-3:]


def wheel_fits(tags: list[str]) -> bool:
    """Whether a wheel's python/abi/platform tags fit this interpreter (CPython 3.12 on Linux x86-64 there)."""
    python, abi, platform = tags
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    python_ok = any(t in (f"cp{version}", f"py{sys.version_info.major}", f"py{version}") for t in python.split("."))
    abi_ok = any(t in ("none", "abi3", f"cp{version}") for t in abi.split("."))
    machine = sysconfig.get_platform().split("-")[-1]  # x86_64
    platform_ok = any(t == "any" or (t.startswith(("manylinux", "linux")) and t.endswith(machine)
                                     and sys.platform == "linux") for t in platform.split("."))
    return python_ok and abi_ok and platform_ok


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def unpack_wheel(path: Path, site: Path) -> None:
    """Install a wheel for import: its files into `site`, `NAME.data/{purelib,platlib}` merged into it
    (scripts, headers and data files are not needed to import and are left out)."""
    with zipfile.ZipFile(path) as z:
        for member in z.infolist():
            parts = Path(member.filename).parts
            if not parts or member.is_dir() or ".." in parts:
                continue
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            target = site.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            if (member.external_attr >> 16) & 0o111:
                target.chmod(0o755)


def install_wheels(wheels: Path, site: Path) -> list[dict]:
    """Unpack each wheel of `wheels` whose distribution is absent or at another version; one row each."""
    rows = []
    for path in sorted(wheels.glob("*.whl")) if wheels.is_dir() else []:
        dist, version, tags = wheel_info(path)
        have = installed_version(dist)
        if have == version:
            rows.append({"dist": dist, "version": version, "action": "present"})
            continue
        if not wheel_fits(tags):
            rows.append({"dist": dist, "version": version, "action": f"skipped: tags {'-'.join(tags)} do not fit "
                         f"this Python {sys.version_info.major}.{sys.version_info.minor} "
                         f"{sysconfig.get_platform()}"})
            continue
        site.mkdir(parents=True, exist_ok=True)
        for old in site.glob("*.dist-info"):  # an earlier version unpacked here
            if old.name.split("-")[0].replace("_", "-").lower() == dist:
                shutil.rmtree(old)
        unpack_wheel(path, site)
        rows.append({"dist": dist, "version": version, "action": "installed" + (f" (had {have})" if have else "")})
    importlib.invalidate_caches()
    return rows


def pinned_version(dist: str) -> str | None:
    """constraints.txt's `dist==version` pin, or None."""
    if not CONSTRAINTS.is_file():
        return None
    for line in CONSTRAINTS.read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep and normalize(name) == normalize(dist):
            return version.strip()
    return None


def check_required() -> list[str]:
    """What is still missing after step 1 (empty: good)."""
    return [f"{dist}=={version} (found {installed_version(dist) or 'none'})" for dist, version in REQUIRED.items()
            if installed_version(dist) != version]


# -- step 2: numerics ------------------------------------------------------------------------------------
def psi_fp64(h_in, h_out):  # noqa: ANN001, ANN201 - torch tensors [t, h] in float64
    """The paper's Ψ = mean_t arccos(cos(h_in, h_out)) / π, written out in fp64 (the reference)."""
    import torch

    cos = (h_in * h_out).sum(-1) / (h_in.norm(dim=-1) * h_out.norm(dim=-1))
    return torch.arccos(cos.clamp(-1.0, 1.0)).mean() / math.pi


def numerics(device: str, tokens: int, hidden: int) -> dict:
    """JREG's Ψ and gradient from bf16 states on `device` against fp64 on the same bf16 values, for near-parallel
    states (Ψ ≈ 0.003, where arccos is least forgiving) and generic ones (Ψ ≈ 0.3); the worst of the two."""
    import torch

    from megatron_jreg.jreg import displacement

    g = torch.Generator().manual_seed(0)
    rows = {}
    for case, scale in (("near-parallel", 0.01), ("generic", 1.0)):
        h_in = torch.randn(tokens, 1, hidden, generator=g)
        h_out = (h_in + scale * torch.randn(tokens, 1, hidden, generator=g)).bfloat16()
        h_in = h_in.bfloat16()
        ref = [h.double().requires_grad_() for h in (h_in, h_out)]
        psi_ref = psi_fp64(ref[0], ref[1])
        psi_ref.backward()
        dev = [h.to(device).requires_grad_() for h in (h_in, h_out)]
        psi = displacement(dev[0], dev[1], kind="angular")
        psi.backward()
        grads = [(d.grad.double().cpu(), r.grad) for d, r in zip(dev, ref, strict=True)]
        grad_err = max(float((a - b).norm() / b.norm()) for a, b in grads)
        floor = max(float((b.bfloat16().double() - b).norm() / b.norm()) for _, b in grads)
        psi, psi_ref = float(psi.detach()), float(psi_ref.detach())
        rows[case] = {"psi": psi, "psi_fp64": psi_ref, "psi_rel_err": abs(psi - psi_ref) / psi_ref,
                      "grad_rel_err": grad_err, "grad_bf16_rounding": floor, "grad_dtype": str(dev[0].grad.dtype)}
    return rows


# -- step 4: the worker (one process, every training run) -------------------------------------------------
_CONSOLE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)"
                      r"(?:.*?throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+))?")


def console_losses(text: str) -> list[float]:
    """The `lm loss` of each logged training interval."""
    return [float(x) for x in re.findall(r"iteration\s+\d+/\s*\d+ \|.*? lm loss: ([0-9.E+-]+)", text)]


def console_intervals(text: str) -> list[tuple[int, float, float | None]]:
    """(iteration, ms per iteration, model TFLOP/s per GPU or None) of each logged training interval."""
    return [(int(i), float(ms), float(tf) if tf else None) for i, ms, tf in _CONSOLE.findall(text)]


def steady(intervals: list[tuple[int, float, float | None]], skip_through: int) -> dict:
    """Mean ms per iteration and TFLOP/s over the intervals logged after iteration `skip_through`, weighted by
    their length (the first interval holds compilation and allocator warm-up)."""
    spans, previous = [], 0
    for iteration, ms, tflops in sorted(intervals):
        if previous >= skip_through:
            spans.append((iteration - previous, ms, tflops))
        previous = iteration
    if not spans:
        raise ValueError(f"no logged interval after iteration {skip_through} (logged: {[i for i, *_ in intervals]})")
    n = sum(k for k, *_ in spans)
    ms = sum(k * m for k, m, _ in spans) / n
    flop = [k * m * t for k, m, t in spans if t is not None]
    return {"iterations": n, "iteration_ms": ms,
            "tflops": sum(flop) / sum(k * m for k, m, t in spans if t is not None) if flop else None}


class Redirect:
    """stdout and stderr of this process (file descriptors 1 and 2, so C++ and logging too) into `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> Redirect:
        sys.stdout.flush()
        sys.stderr.flush()
        self.file = open(self.path, "w")  # noqa: SIM115 - closed in __exit__
        self.saved = [os.dup(1), os.dup(2)]
        os.dup2(self.file.fileno(), 1)
        os.dup2(self.file.fileno(), 2)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in zip((1, 2), self.saved, strict=True):
            os.dup2(saved, fd)
            os.close(saved)
        self.file.close()


class Memory:
    """Peak memory of one run inside a process that runs many: CUDA's allocator peak less what was allocated
    before the run; on the CPU the process's peak RSS (VmHWM), reset through /proc/self/clear_refs."""

    def __init__(self) -> None:
        import torch

        self.cuda = torch.cuda.is_available()
        self.kind = "allocated" if self.cuda else "rss"

    def start(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with contextlib.suppress(OSError):
                Path("/proc/self/clear_refs").write_text("5")
            self.base = 0

    def peak(self) -> float:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return float(torch.cuda.max_memory_allocated() - self.base)
        status = Path("/proc/self/status").read_text()
        return float(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024


def _ours(argv: list[str]) -> int:
    from megatron_jreg.train import main as train_main

    return train_main(argv)


def _megatron_lm(argv: list[str], folder: Path) -> int:
    """Megatron-LM's own pretrain_gpt.py (core_v0.19.0) in this process, as `python pretrain_gpt.py argv` would
    run it, with what the wheel lacks: its dataset helpers' Makefile (compile_helpers() kept from running) and,
    without CUDA, megatron_jreg.compat (DEVELOPERS.md, "Comparing with Megatron-LM itself")."""
    import runpy

    import torch

    from megatron_jreg import compat, patches

    if not torch.cuda.is_available():
        compat.apply_cpu_training_compat()
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(folder / "pretrain_gpt.py"), *argv]
    sys.path.insert(0, str(folder))
    for name in ("gpt_builders", "model_provider"):  # fresh each run, as a new process would have them
        sys.modules.pop(name, None)
    try:
        with patches.patched({"megatron.core.datasets.utils.compile_helpers": lambda _original: (lambda: None)}):
            runpy.run_path(str(folder / "pretrain_gpt.py"), run_name="__main__")
        return 0
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        from megatron_jreg.training.run import teardown

        teardown()


def _run(spec: dict, memory: Memory, folder: Path | None) -> dict:
    """One training run of the worker: ours or Megatron-LM's, console to its log; its exit code and peak."""
    import torch

    fake = "--fake-process-group" in spec["argv"]
    if fake and torch.distributed.is_initialized():  # Megatron-LM starts its fake world only where none is
        torch.distributed.destroy_process_group()
    memory.start()
    start = time.perf_counter()
    rc = 1
    try:
        with mock.patch.dict(os.environ, spec.get("env", {})), Redirect(Path(spec["log"])):
            try:
                rc = _ours(spec["argv"]) if spec["kind"] == "ours" else _megatron_lm(spec["argv"], folder)
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:  # noqa: BLE001 - the log holds it; the next run still runs
                import traceback

                traceback.print_exc()
                rc = 1
    finally:
        if fake and torch.distributed.is_initialized():  # the next stage is another rank of another world
            torch.distributed.destroy_process_group()
    peak = memory.peak()
    return {"name": spec["name"], "rc": rc, "seconds": time.perf_counter() - start, "peak_bytes": peak,
            "peak_kind": memory.kind, "models_alive_after": collect_garbage()}


def collect_garbage() -> int:
    """Python's collector on again and run (Megatron-LM's --manual-gc turns it off in train() and never back on, so
    a finished run's model and optimizer, held in reference cycles, would stay allocated into the next run); how
    many megatron-core GPT models are still alive after it."""
    gc.enable()
    gc.collect()
    from megatron.core.models.gpt import GPTModel

    return sum(1 for o in gc.get_objects() if isinstance(o, GPTModel))


def sync_debug(flags: list[str], vocab_size: int, micro_batch: int) -> dict:
    """JREG steps (forward+backward with its hooks at λ = 1, as between logging steps) under
    torch.cuda.set_sync_debug_mode("error"); and the host syncs of λ = 1 and of λ = 0 counted in "warn" mode, by
    the line that made them, so that a sync of the model itself is told apart from one JREG adds. On the CPU there
    is no device to sync with: the steps run and nothing is counted."""
    import warnings

    import torch

    sys.path.insert(0, str(BENCH))
    from jreg_overhead import Bench

    bench = Bench(flags, vocab_size, bf16=True, distance="angular")
    cuda = bench.device.type == "cuda"
    try:
        for lam in (0.0, 1.0, 0.0, 1.0):  # warm-up: compilation, allocator
            bench.step(lam, micro_batch)
        bench.sync()
        sites: dict[str, list[str]] = {}
        for lam in (0.0, 1.0):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    bench.step(lam, micro_batch)
                finally:
                    if cuda:
                        torch.cuda.set_sync_debug_mode(0)
            sites[str(lam)] = [f"{Path(w.filename).name}:{w.lineno}" for w in caught
                               if "synchroniz" in str(w.message)]
        extra = sorted(set(sites["1.0"]) - set(sites["0.0"]))
        errors = {}
        for lam in (0.0, 1.0):  # λ = 0 first: a sync of the model itself is not JREG's
            if cuda:
                torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(2):
                    bench.step(lam, micro_batch)
                errors[str(lam)] = None
            except RuntimeError as e:
                errors[str(lam)] = " ".join(str(e).split())[:300]
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode(0)
            bench.sync()
        if errors["1.0"] is None:
            verdict = "passed"
        elif errors["0.0"] is None:
            verdict = f"raised by JREG's steps only: {errors['1.0']}"
        else:  # the model syncs at λ = 0 already: the counted sites decide
            verdict = f"inconclusive (the model itself syncs at λ = 0: {errors['0.0']})"
        return {"device": str(bench.device), "syncs": {k: len(v) for k, v in sites.items()}, "sites": sites,
                "jreg_extra_sites": extra, "error_mode": verdict, "errors": errors,
                "ok": not extra and (errors["1.0"] is None or errors["0.0"] is not None)}
    finally:
        bench.close()


def worker(plan_path: Path) -> int:
    """Every run of the plan in this process; one JSON line per result appended to plan['results'] as it ends."""
    plan = json.loads(plan_path.read_text())
    results = Path(plan["results"])
    folder = Path(plan["megatron_lm"]) if plan.get("megatron_lm") else None

    def emit(record: dict) -> None:
        with open(results, "a") as f:
            f.write(json.dumps(record) + "\n")

    flops = {}
    for label, f in plan.get("flops", {}).items():  # Megatron-LM's model FLOPs of one iteration, per label
        from megatron.training.training import num_floating_point_operations

        from megatron_jreg.checkpoints.args import model_args

        with Redirect(Path(f["log"])):
            flops[label] = num_floating_point_operations(model_args(f["argv"], f["vocab_size"]), f["batch"])
    emit({"flops": flops})
    if plan.get("sync_debug"):
        s = plan["sync_debug"]
        try:
            with Redirect(Path(s["log"])):
                emit({"sync_debug": sync_debug(s["flags"], s["vocab_size"], s["micro_batch"])})
        except Exception as e:  # noqa: BLE001 - reported, the runs still go
            emit({"sync_debug": {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}})
    memory = Memory()
    for spec in plan["runs"]:
        emit(_run(spec, memory, folder))
    return 0


# -- the check -------------------------------------------------------------------------------------------
class Check:
    """State of one gpu_check invocation: options, clock, output, figures."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.start = time.monotonic()
        self.out = Path(args.out) if args.out else None
        self.work = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=args.work))
        self.logs = self.work / "logs"  # archived into OUT at the end (a lent machine returns at most 8 files)
        self.logs.mkdir(parents=True, exist_ok=True)
        if self.out:
            self.out.mkdir(parents=True, exist_ok=True)
        self.say = Console(self.out / "gpu_check.txt" if self.out else None)
        self.sizes = Sizes(args.dry_run)
        self.figures: dict = {}
        self.details: dict = {"mode": "dry-run" if args.dry_run else "gpu", "errors": [], "notes": []}
        self.device = "cpu" if args.dry_run else "cuda"

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.start)

    def error(self, step: str, message: str) -> None:
        self.details["errors"].append(f"{step}: {message}")
        self.say(f"   ERROR ({step}): {message}")

    def step(self, title: str, fn) -> bool:  # noqa: ANN001 - a method of this class
        self.say(f"== {title}  [{time.monotonic() - self.start:.0f} s]")
        t0 = time.monotonic()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a failed step is reported and the others still run
            self.error(title.split(":")[0], f"{type(e).__name__}: {' '.join(str(e).split())[:600]}")
            return False
        finally:
            self.details.setdefault("step_seconds", {})[title.split(":")[0]] = round(time.monotonic() - t0, 1)
        return True

    # -- 1 ---------------------------------------------------------------------------------------------
    def wheels(self) -> None:
        wheels, site = self.args.wheels, self.args.site
        rows = install_wheels(wheels, site)
        if not rows:
            self.say(f"   no wheels in {wheels} (`make gpu-wheels` fetches them)")
        for r in rows:
            where = f" into {site}" if r["action"].startswith("installed") else ""
            self.say(f"   {r['dist']} {r['version']}: {r['action']}{where}")
        self.details["wheels"] = rows
        missing = check_required()
        if missing:
            raise RuntimeError(f"missing {', '.join(missing)}: run `make gpu-wheels` where PyPI is reachable and "
                               "carry .whl (docs/gpu.md)")
        import torch

        self.details["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                                    "megatron-core": installed_version("megatron-core"),
                                    "transformer-engine": installed_version("transformer-engine")}
        self.say("   " + ", ".join(f"{k} {v}" for k, v in self.details["versions"].items()))
        pinned = pinned_version("torch")
        if pinned and torch.__version__.split("+")[0] != pinned:
            note = (f"torch {torch.__version__} here, constraints.txt pins {pinned}: a pairing the tests have not run "
                    "(this check's figures are its test)")
            self.details["notes"].append(note)
            self.say(f"   note: {note}")

    def peak(self) -> None:
        """The device and its dense bf16 peak (or, in the dry run, a measured CPU fp32 matmul rate)."""
        import torch

        if self.args.dry_run:
            rate = matmul_tflops(512, torch.float32, 4, torch.device("cpu"))
            name, tflops = "CPU (measured fp32 matmul rate; a dry run's stand-in for a datasheet peak)", rate
        elif self.args.peak_tflops:
            name, tflops = f"{torch.cuda.get_device_name()} (--peak-tflops)", self.args.peak_tflops
        else:
            found = device_peak(torch.cuda.get_device_name())
            if found is None:
                raise RuntimeError(f"no dense bf16 peak known for {torch.cuda.get_device_name()!r}: give "
                                   "--peak-tflops N from its datasheet")
            name, tflops = f"{found[0]} dense bf16", found[1]
        self.figures["peak_tflops"] = tflops
        self.figures["device"] = torch.cuda.get_device_name() if not self.args.dry_run else "cpu"
        self.details["peak"] = name
        self.say(f"   MFU against {fmt(tflops)} TFLOP/s: {name}")

    # -- 2 ---------------------------------------------------------------------------------------------
    def numerics(self) -> None:
        tokens, hidden = self.sizes.numerics
        rows = numerics(self.device, tokens, hidden)
        self.details["numerics"] = rows
        for case, r in rows.items():
            self.say(f"   {case}: Ψ {r['psi']:.6g} vs fp64 {r['psi_fp64']:.6g} (relative {r['psi_rel_err']:.2e}); "
                     f"gradient ({r['grad_dtype']}) vs fp64: relative {r['grad_rel_err']:.2e}, bf16's own rounding "
                     f"{r['grad_bf16_rounding']:.2e}")
        self.figures["psi_rel_err"] = max(r["psi_rel_err"] for r in rows.values())
        self.figures["grad_rel_err"] = max(r["grad_rel_err"] for r in rows.values())
        self.figures["grad_bf16_rounding"] = max(r["grad_bf16_rounding"] for r in rows.values())

    # -- 3 ---------------------------------------------------------------------------------------------
    def jreg_op(self) -> None:
        script = BENCH / "jreg_op.py"
        if not script.exists():
            note = "benchmarks/jreg_op.py is not in this checkout yet: op_vs_floor not measured"
            self.details["notes"].append(note)
            self.say(f"   {note}")
            return
        log = self.logs / "jreg_op.log"
        # its documented GPU call at the shape its summary reports (one Triton compile per shape and dtype); the
        # dry run at one small shape (the op's code path, not its figure)
        cmd = [sys.executable, str(script), "--device", self.device, "--rounds", "5", "--reps", "20", "--shapes",
               "16384x2048"]
        if self.args.dry_run:
            cmd = [sys.executable, str(script), "--device", "cpu", "--rounds", "2", "--shapes", "4096x256"]
        timeout = max(10.0, min(self.sizes.op_cap_s, self.left() - self.sizes.training_s))
        with open(log, "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=child_environment(),
                                timeout=timeout).returncode
        text = log.read_text(errors="replace").strip()
        last = text.splitlines()[-1] if text else ""
        values = dict(re.findall(r"(\w+)=([^\s,]+)", last))
        if rc != 0 or "op_vs_floor" not in values:
            raise RuntimeError(f"{' '.join(cmd[1:])} exit {rc}; last line {last!r} (log {archived(log)})")
        self.details["jreg_op"] = values
        for key, value in values.items():
            with contextlib.suppress(ValueError):
                self.figures[key if key.startswith("op_") else f"op_{key}"] = float(value)
        self.say(f"   {last}")

    # -- 4 ---------------------------------------------------------------------------------------------
    def common_flags(self, label: str, micro_batch: int, global_batch: int, iters: int, log_interval: int) -> list[str]:
        """The Megatron-LM flags both megatron-jreg train and pretrain_gpt.py get for a preset."""
        from megatron_jreg.training.flags import preset_flags

        s = self.sizes
        preset, _, extra = s.presets[label]
        return [*preset_flags(preset), *extra, "--seq-length", str(s.seq_length), "--max-position-embeddings",
                str(s.seq_length), "--bf16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                str(s.vocab_size), "--micro-batch-size", str(micro_batch), "--global-batch-size", str(global_batch),
                "--train-iters", str(iters), "--lr", "1e-4", "--log-interval", str(log_interval), "--eval-iters",
                "0", "--eval-interval", str(10**9), "--log-throughput", "--seed", "1234",
                *(CPU_FLAGS if self.args.dry_run else GPU_FLAGS), *s.recipe]

    def plan(self) -> dict:
        s = self.sizes
        runs = []
        kinds = {}
        for label, (_, mbs, _) in s.presets.items():
            common = self.common_flags(label, mbs, mbs, s.iters, s.log_interval)
            kinds[label] = {"l0": ("ours", [*common, "--jreg-lambda", "0", "--no-progress"]),
                            "l1": ("ours", [*common, "--jreg-lambda", "1", "--jreg-alpha", "1", "--no-progress"]),
                            "megatron-lm": ("megatron-lm", common)}
        # in the order of worth: λ = 0 / λ = 1 pairs (time ratio, MFU) in alternated rounds, then Megatron-LM's
        order = [(r, key) for r in range(s.rounds) for key in (("l0", "l1") if r % 2 == 0 else ("l1", "l0"))]
        order += [(r, "megatron-lm") for r in range(s.rounds)]
        for r, key in order:
            for label in s.presets:
                kind, argv = kinds[label][key]
                name = f"{label}-{key}-r{r}"
                runs.append({"name": name, "kind": kind, "argv": argv, "log": str(self.logs / f"{name}.log"),
                             "label": label, "key": key})
        for label, (_, mbs, _) in s.presets.items():  # PP=2: each stage alone on the GPU (Megatron-LM's fake PG)
            common = self.common_flags(label, mbs, mbs * s.pp2_microbatches, s.pp2_iters, 1)
            for lam in ("0", "1"):
                for stage in (0, 1):
                    name = f"{label}-pp2-l{lam}-stage{stage}"
                    runs.append({"name": name, "kind": "ours", "log": str(self.logs / f"{name}.log"),
                                 "argv": [*common, "--pipeline-model-parallel-size", "2", "--fake-process-group",
                                          "--no-exit-signal-handler", "--jreg-lambda", lam, "--no-progress"],
                                 "env": {"WORLD_SIZE": "2", "RANK": str(stage), "LOCAL_RANK": "0"},
                                 "label": label, "key": f"pp2-l{lam}", "stage": stage})
        preset, mbs, extra = s.presets["170m"]
        from megatron_jreg.training.flags import preset_flags

        sync = {"flags": [*preset_flags(preset), *extra, "--seq-length", str(s.seq_length),
                          "--max-position-embeddings", str(s.seq_length)],
                "vocab_size": s.vocab_size, "micro_batch": mbs, "log": str(self.logs / "sync_debug.log")}
        folder = self.args.megatron_lm if all((self.args.megatron_lm / f).is_file() for f in MEGATRON_LM_FILES) \
            else None
        if folder is None:
            runs = [r for r in runs if r["kind"] != "megatron-lm"]
        flops = {label: {"argv": [*preset_flags(preset), *extra, "--seq-length", str(s.seq_length),
                                  "--max-position-embeddings", str(s.seq_length)],
                         "vocab_size": s.vocab_size, "batch": mbs, "log": str(self.logs / f"flops-{label}.log")}
                 for label, (preset, mbs, extra) in s.presets.items()}
        return {"runs": runs, "sync_debug": sync, "flops": flops, "megatron_lm": str(folder) if folder else None,
                "results": str(self.work / "results.jsonl")}

    def training(self) -> None:
        plan = self.plan()
        if plan["megatron_lm"] is None:  # an error where it counts (the GPU); the dry run still runs the rest
            message = (f"Megatron-LM's {', '.join(MEGATRON_LM_FILES)} (core_v0.19.0) are not in "
                       f"{self.args.megatron_lm}: `make gpu-wheels` puts them there (docs/gpu.md); the reference "
                       "runs are skipped")
            if self.args.dry_run:
                self.details["notes"].append(message)
                self.say(f"   {message}")
            else:
                self.error("megatron-lm", message)
        plan_path = self.work / "plan.json"
        plan_path.write_text(json.dumps(plan))
        Path(plan["results"]).unlink(missing_ok=True)
        env = child_environment({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                                 "MASTER_PORT": str(free_port())})
        timeout = self.left() - 15
        self.say(f"   {len(plan['runs'])} runs in one worker process, at most {timeout:.0f} s")
        try:
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", str(plan_path)],
                                  cwd=REPO, env=env, timeout=timeout, capture_output=True, text=True)
            if proc.returncode != 0:
                self.error("training", f"the worker exited {proc.returncode}: {proc.stderr.strip()[-600:]}")
        except subprocess.TimeoutExpired:
            self.error("training", f"out of time after {timeout:.0f} s: the runs not reported below did not finish")
        records = [json.loads(line) for line in Path(plan["results"]).read_text().splitlines()] \
            if Path(plan["results"]).exists() else []
        self.details["runs"] = [r for r in records if "name" in r]
        for r in records:
            if "sync_debug" in r:
                self.report_sync(r["sync_debug"])
        flops = next((r["flops"] for r in records if "flops" in r), {})
        self.details["flops_per_iteration"] = flops
        done = {r["name"]: r for r in records if "name" in r}
        alive = {name: r["models_alive_after"] for name, r in done.items() if r.get("models_alive_after")}
        self.figures["models_alive_after_runs"] = max(alive.values(), default=0) if done else None
        self.say(f"   garbage collected after each run: {len(done)} runs, GPT models still alive after "
                 + (", ".join(f"{k}: {v}" for k, v in alive.items()) if alive else "none of them"))
        self.report_training(plan, done, flops)

    def report_sync(self, s: dict) -> None:
        self.details["sync_debug"] = s
        if "error" in s:
            self.error("sync debug", s["error"])
            return
        self.figures["sync_debug_ok"] = s["ok"]
        self.figures["jreg_extra_syncs"] = len(s["jreg_extra_sites"])
        self.say(f"   sync debug on {s['device']}: set_sync_debug_mode('error') over JREG steps: {s['error_mode']}; "
                 f"host syncs per step λ=0 {s['syncs']['0.0']}, λ=1 {s['syncs']['1.0']}"
                 + (f"; added by λ=1 at {', '.join(s['jreg_extra_sites'])}" if s["jreg_extra_sites"] else ""))
        if not s["ok"]:
            self.details["errors"].append(f"sync debug: {s['error_mode']}; extra {s['jreg_extra_sites']}")

    def report_training(self, plan: dict, done: dict, flops: dict) -> None:
        s, peak = self.sizes, self.figures.get("peak_tflops")
        for spec in plan["runs"]:
            r = done.get(spec["name"])
            if r is None:
                continue
            text = Path(spec["log"]).read_text(errors="replace")
            r["intervals"], r["losses"] = console_intervals(text), console_losses(text)
            if r["rc"] == 0 and spec["key"] in ("l0", "l1", "megatron-lm"):
                try:
                    r.update(steady(r["intervals"], self.sizes.log_interval))
                except ValueError as e:
                    r["rc"] = "no timings"
                    self.error(spec["name"], f"{e} (log {archived(spec['log'])})")
            elif r["rc"] != 0:
                self.error(spec["name"], f"exit {r['rc']}: {' | '.join(text.strip().splitlines()[-3:])[-500:]}")
        for label, (preset, mbs, _) in s.presets.items():
            tokens = mbs * s.seq_length
            by_key: dict[str, list[dict]] = {}
            for spec in plan["runs"]:
                r = done.get(spec["name"])
                if (r is not None and r["rc"] == 0 and spec["label"] == label
                        and spec["key"] in ("l0", "l1", "megatron-lm")):
                    by_key.setdefault(spec["key"], []).append(r)
            stats = {}
            for key, rs in by_key.items():
                ms = statistics.median(x["iteration_ms"] for x in rs)
                # Megatron-LM's model FLOPs (its --log-throughput formula) at full precision; the console's
                # figure has one decimal
                tflops = flops[label] / (ms / 1e3) / 1e12 if label in flops else None
                stats[key] = {"iteration_ms": ms, "tokens_per_sec": tokens / (ms / 1e3), "runs": len(rs),
                              "tflops": tflops, "console_tflops": [x["tflops"] for x in rs],
                              "peak_gib": max(x["peak_bytes"] for x in rs) / 2**30, "peak_kind": rs[0]["peak_kind"]}
                st = stats[key]
                mfu = st["tflops"] / peak if st["tflops"] and peak else None
                st["mfu"] = mfu
                self.say(f"   {label} ({preset}, {mbs} × {s.seq_length} tokens) {key:>11}: "
                         f"{st['tokens_per_sec']:>10,.0f} tokens/s, {ms:8.1f} ms/iteration, {fmt(st['tflops'])} "
                         f"TFLOP/s, MFU {fmt(mfu)}, peak {st['peak_kind']} {st['peak_gib']:.2f} GiB ({len(rs)} runs)")
            self.details.setdefault("training", {})[label] = stats
            if "l0" in stats:
                self.figures[f"tokens_per_sec_{label}"] = stats["l0"]["tokens_per_sec"]
                self.figures[f"mfu_{label}"] = stats["l0"]["mfu"]
            if "l1" in stats:
                self.figures[f"tokens_per_sec_{label}_jreg"] = stats["l1"]["tokens_per_sec"]
                self.figures[f"mfu_{label}_jreg"] = stats["l1"]["mfu"]
            if "l0" in stats and "l1" in stats:
                self.figures[f"time_ratio_{label}"] = _paired_ratio(by_key["l1"], by_key["l0"], "iteration_ms")
                self.figures[f"memory_ratio_pp1_{label}"] = stats["l1"]["peak_gib"] / stats["l0"]["peak_gib"]
            if "l0" in stats and "megatron-lm" in stats:
                self.figures[f"vs_megatron_lm_{label}"] = (stats["l0"]["tokens_per_sec"]
                                                           / stats["megatron-lm"]["tokens_per_sec"])
                # same arguments, seed and data: λ = 0 is Megatron-LM's training (bit-equal losses on the CPU)
                pairs = [(a, b) for x in by_key["l0"] for y in by_key["megatron-lm"]
                         for a, b in zip(x["losses"], y["losses"], strict=False)]
                if pairs:
                    diff = max(abs(a - b) / abs(b) for a, b in pairs)
                    self.figures[f"loss_vs_megatron_lm_{label}"] = diff
                    self.say(f"   {label}: lm loss of λ = 0 vs Megatron-LM's, {len(pairs)} pairs: max relative "
                             f"difference {diff:.2e}")
                self.figures[f"tokens_per_sec_{label}_megatron_lm"] = stats["megatron-lm"]["tokens_per_sec"]
            stages = {}
            for stage in (0, 1):
                peaks = {lam: done.get(f"{label}-pp2-l{lam}-stage{stage}") for lam in ("0", "1")}
                if all(p is not None and p["rc"] == 0 for p in peaks.values()):
                    stages[stage] = (peaks["0"]["peak_bytes"], peaks["1"]["peak_bytes"])
            if len(stages) == 2:
                self.figures[f"memory_ratio_pp2_{label}"] = max(b / a for a, b in stages.values())
                self.say(f"   {label} PP=2 (each stage alone, --fake-process-group), peak GiB λ=0 → λ=1: "
                         + "; ".join(f"stage {k} {a / 2**30:.2f} → {b / 2**30:.2f}" for k, (a, b) in stages.items()))
            self.details.setdefault("pp2", {})[label] = stages

    # -- all -------------------------------------------------------------------------------------------
    def finish(self) -> int:
        self.figures["elapsed_s"] = round(time.monotonic() - self.start, 1)
        self.figures["mode"] = self.details["mode"]
        self.details["figures"] = self.figures
        if self.details["errors"]:
            self.say(f"   {len(self.details['errors'])} error(s): " + " | ".join(self.details["errors"]))
        if self.out:
            archive = self.out / "gpu_check_logs.tar.gz"
            with tarfile.open(archive, "w:gz") as tar:
                tar.add(self.logs, arcname="gpu_check_logs")
            (self.out / "gpu_check.json").write_text(json.dumps(self.details, indent=1, default=str))
            files = [p for p in self.out.rglob("*") if p.is_file()]
            if len(files) + 1 > OUT_FILES:  # + this console's own file
                self.error("out", f"{len(files) + 1} files in {self.out}: a lent machine returns {OUT_FILES}")
            self.say(f"   written: {self.out / 'gpu_check.txt'}, {self.out / 'gpu_check.json'}, {archive} "
                     "(every log)")
        self.say(summary_line(self.figures))
        self.say.close()
        return 1 if self.details["errors"] else 0


def archived(log: str | Path) -> str:
    """Where a log is in OUT's archive."""
    return f"gpu_check_logs.tar.gz: gpu_check_logs/{Path(log).name}"


def _paired_ratio(a: list[dict], b: list[dict], key: str) -> float:
    """Median over rounds of a[r][key] / b[r][key] (runs of one round side by side)."""
    return statistics.median(x[key] / y[key] for x, y in zip(a, b, strict=False))


def matmul_tflops(n: int, dtype, reps: int, device) -> float:  # noqa: ANN001 - torch dtype and device
    """Best of 3 timings of `reps` n×n×n matmuls, in TFLOP/s (2n³ FLOPs each)."""
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    best = math.inf
    for _ in range(4):
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=c)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 * reps / best / 1e12


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_environment(extra: dict | None = None) -> dict:
    """This process's environment for a child: a world of its own, Python warnings off, `extra` added."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(PYTHONWARNINGS="ignore", **(extra or {}))
    return env


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker(Path(argv[1]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="everything on the CPU at tiny sizes (no GPU needed)")
    p.add_argument("--wheels", type=Path, default=DEFAULT_WHEELS, help="folder of wheels (make gpu-wheels)")
    p.add_argument("--megatron-lm", type=Path, default=DEFAULT_MEGATRON_LM,
                   help=f"folder with Megatron-LM core_v0.19.0's {', '.join(MEGATRON_LM_FILES)} (make gpu-wheels)")
    p.add_argument("--site", type=Path, default=None,
                   help="where missing wheels are unpacked; must be on PYTHONPATH (gpu_check.sh sees to it)")
    p.add_argument("--out", default=os.environ.get("OUT") or None, help="output folder (default: $OUT)")
    p.add_argument("--work", default=None, help="parent of the scratch folder (default: the system's temp)")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"time for the whole check (default {BUDGET_S:.0f}; --dry-run {DRY_RUN_BUDGET_S:.0f})")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's dense bf16 peak, for a device not in the table (docs/gpu.md)")
    args = p.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = DRY_RUN_BUDGET_S if args.dry_run else BUDGET_S
    import logging
    import warnings

    # megatron-core's import-time notes about absent apex/Transformer Engine (docs/gpu.md says what runs instead)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime is found"
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    if args.dry_run:  # tiny sizes gain nothing from threads, and on a busy machine they spin (timing noise)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.site is None:
        args.site = Path(tempfile.gettempdir()) / "megatron-jreg-gpu-site"
    if str(args.site) not in sys.path:
        sys.path.insert(0, str(args.site))
    check = Check(args)
    check.say(f"gpu_check ({check.details['mode']}): budget {args.budget_s:.0f} s, Python {sys.version.split()[0]}")
    if not check.step("1/5 wheels: megatron-core and what else is missing", check.wheels):
        return check.finish()
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        from megatron_jreg.compat import cuda_diagnosis

        check.error("device", f"no usable CUDA device ({cuda_diagnosis()}): run this on the GPU machine, or pass "
                    "--dry-run")
        check.finish()
        return 2
    check.step("   device peak", check.peak)
    check.step(f"2/5 JREG op as training runs it vs its memory floor: benchmarks/jreg_op.py --device {check.device}",
               check.jreg_op)
    check.step(f"3/5 numerics: bf16 Ψ and its gradient on {check.device} vs fp64", check.numerics)
    labels = ", ".join(f"{k} = {v[0]}" for k, v in check.sizes.presets.items())
    check.step(f"4/5 training ({labels}): sync debug; λ = 0 and λ = 1 in alternated rounds; Megatron-LM's "
               "pretrain_gpt.py; PP = 2 memory", check.training)
    check.say("== 5/5 summary")
    return check.finish()


if __name__ == "__main__":  # dist_checkpointing's writer processes re-import __main__
    sys.exit(main())
