"""One-command GPU check: correctness on CUDA, tokens/s, MFU and JREG's cost on the llama-170m preset.

Run through `benchmarks/gpu_check.sh` (docs/gpu.md). Steps, all within `--budget-s` (8 minutes):

1. wheels: install every wheel of `--wheels` (.whl/gpu, filled by `make gpu-wheels`) whose distribution
   is missing or at another version, by unpacking it into `--site` (first on PYTHONPATH); megatron-core
   0.19.2 must import afterwards. No registry, no pip needed.
2. correctness: a tiny fp32 model trains 1 iteration on CPU and saves a checkpoint; from it, the same
   5 iterations run on CPU and on the GPU (`--no-load-rng`, JREG λ = 1). Both start from identical
   weights, optimizer state and data position, so their losses must agree: relative ≤ 1e-4.
   (Megatron-LM draws initial weights from the device's RNG, so two fresh runs could not be compared.)
3. JREG kernel: benchmarks/jreg_overhead.py on llama-170m (bf16, 2048 tokens, 128,256-token vocabulary
   = the paper's 174M parameters) finds the largest micro-batch that fits training's memory and times
   forward+backward at λ = 0 against λ = 1 (kernel_time_ratio, kernel_memory_ratio).
4. training: `megatron-jreg train` on that preset and micro-batch, λ = 0 then λ = 1, 30 iterations each
   (logged every 10; the 20 after the first 10 are timed): tokens/s, Megatron-LM's model TFLOP/s and the
   peak allocated memory of each run (jreg_time_ratio, jreg_memory_ratio).
5. large bf16 matmuls (8192³, 16384³) measure the GPU's attainable rate; MFU = model TFLOP/s ÷ that rate (and ÷ 790,
   the H200's usual figure); then one key=value line:
   loss_rel_diff tokens_per_sec mfu jreg_time_ratio jreg_memory_ratio kernel_time_ratio, then more keys.

With `$OUT` (or `--out`) set, the console, a JSON of every figure and each run's log and metrics go there.
`--dry-run` does all of it on CPU at tiny sizes (the "GPU" run is a second CPU run, in this process;
memory ratios are the kernel's saved activations): the suite runs it. `--dry-run --isolated` rehearses
the GPU run's process layout on CPU: every run in a process of its own, as there (~2 minutes here).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import io
import json
import math
import os
import re
import shutil
import sys
import sysconfig
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
DEFAULT_WHEELS = REPO / ".whl" / "gpu"
REQUIRED = {"megatron-core": "0.19.2"}  # must import after step 1 (setup.py's pin)
H200_BF16_TFLOPS = 790.0  # what a large bf16 matmul usually reaches on an H200 (dense peak: 989)
LOSS_RTOL = 1e-4
KEYS = ("loss_rel_diff", "tokens_per_sec", "mfu", "jreg_time_ratio", "jreg_memory_ratio", "kernel_time_ratio")

# Step 2: a tiny fp32 model; iteration 1 saves (--exit-interval 1), iterations 2-6 are compared.
CORRECTNESS = ("--model-preset tiny --transformer-impl local --mock-data --tokenizer-type NullTokenizer "
               "--vocab-size 512 --micro-batch-size 2 --global-batch-size 4 --train-iters 6 --lr 1e-3 "
               "--log-interval 1 --eval-interval 1000000 --eval-iters 0 --jreg-lambda 1 --jreg-alpha 1 "
               "--seed 1234 --no-progress").split()


class Sizes:
    """What steps 3-5 run: the issue's sizes on a GPU, tiny ones for --dry-run on CPU."""

    def __init__(self, dry_run: bool) -> None:
        self.dry_run = dry_run
        self.preset = "tiny" if dry_run else "llama-170m"
        self.seq_length = 128 if dry_run else 2048
        self.vocab_size = 512 if dry_run else 128256  # the Llama-3 tokenizer's: 174M parameters
        self.bf16 = True
        self.iters = 6 if dry_run else 30  # training iterations per λ
        self.log_interval = 2 if dry_run else 10  # the first interval is warm-up; the rest are timed
        self.kernel_iters = 3 if dry_run else 20
        self.fallback_micro_batch = 2 if dry_run else 8  # when step 3 found none (gpu_smoke.sh's default)
        self.budget_mib = 24.0 if dry_run else None  # dry run: a pretend memory budget (saved activations)
        # (n, repetitions) of n×n×n matmuls; the best rate counts
        self.matmul_dtype = torch_dtype("float32" if dry_run else "bfloat16")
        self.matmuls = [(512, 4)] if dry_run else [(8192, 50), (16384, 8)]


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


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
    if isinstance(value, float):
        return f"{value:.6g}" if abs(value) < 1e6 else f"{value:.1f}"
    return str(value)


def summary_line(figures: dict) -> str:
    """KEYS first (nan where a step failed), then every other figure in insertion order."""
    keys = [*KEYS, *(k for k in figures if k not in KEYS)]
    return " ".join(f"{k}={fmt(figures.get(k))}" for k in keys)


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
            mode = member.external_attr >> 16
            if mode & 0o111:
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


def check_required() -> list[str]:
    """What is still missing after step 1 (empty: good)."""
    missing = []
    for dist, version in REQUIRED.items():
        have = installed_version(dist)
        if have != version:
            missing.append(f"{dist}=={version} (found {have or 'none'})")
    return missing


# -- steps 2-4: runs -------------------------------------------------------------------------------------
def loss_rel_diff(ref: list[dict], dev: list[dict]) -> tuple[float, list[tuple[int, float, float]]]:
    """max |dev − ref| / |ref| over the iterations both logged, and (iteration, ref, dev) rows."""
    a = {r["iteration"]: r["lm_loss"] for r in ref if r.get("lm_loss") is not None}
    b = {r["iteration"]: r["lm_loss"] for r in dev if r.get("lm_loss") is not None}
    common = sorted(set(a) & set(b))
    if not common or set(a) != set(b):
        raise ValueError(f"the runs logged different iterations: CPU {sorted(a)}, GPU {sorted(b)}")
    rows = [(i, a[i], b[i]) for i in common]
    return max(abs(d - r) / abs(r) for _, r, d in rows), rows


def is_oom(log_text: str) -> bool:
    return "out of memory" in log_text.lower()


class Check:
    """State of one gpu_check invocation: options, clock, output, figures."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.start = time.monotonic()
        self.out = Path(args.out) if args.out else None
        self.work = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=args.work))
        self.logs = (self.out / "gpu_check") if self.out else (self.work / "logs")
        self.logs.mkdir(parents=True, exist_ok=True)
        if self.out:
            self.out.mkdir(parents=True, exist_ok=True)
        self.say = Console(self.out / "gpu_check.txt" if self.out else None)
        self.sizes = Sizes(args.dry_run)
        self.figures: dict = {}
        mode = ("dry-run-isolated" if args.isolated else "dry-run") if args.dry_run else "gpu"
        self.details: dict = {"mode": mode, "errors": []}
        self.gpu_flags: list[str] = []
        # Runs in processes of their own (the GPU layout), or in this one (the quick dry run).
        self.isolated = not args.dry_run or args.isolated

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.start)

    def timeout(self, cap: float, reserve: float = 20.0) -> float:
        """Seconds a run may take: its cap, within what is left of the budget (less a reserve for the end)."""
        left = self.left() - reserve
        if left < 10:
            raise TimeoutError(f"out of time budget ({self.args.budget_s:.0f} s)")
        return min(cap, left)

    def error(self, step: str, message: str) -> None:
        self.details["errors"].append(f"{step}: {message}")
        self.say(f"   ERROR ({step}): {message}")

    def train(self, name: str, argv: list[str], *, device: str, cap: float, own_process: bool | None = None):
        """One `megatron-jreg train` run on device "cpu" (CUDA hidden) or "gpu", in a process of its own
        (default: as the layout says) or in this one (the quick dry run: one import for several runs)."""
        from train_throughput import run_training

        own_process = self.isolated if own_process is None else own_process
        env = {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" and own_process else None
        result = run_training(argv, self.logs / f"{name}.log", isolated=own_process, env=env,
                              timeout=self.timeout(cap))
        self.details.setdefault("runs", {})[name] = {
            "rc": result.rc, "seconds": round(result.seconds, 1), "peak_bytes": result.peak_bytes,
            "peak_kind": result.peak_kind, "argv": argv}
        return result

    # -- step 1 ------------------------------------------------------------------------------------------
    def wheels(self) -> None:
        wheels, site = self.args.wheels, self.args.site
        rows = install_wheels(wheels, site)
        if not rows:
            self.say(f"   no wheels in {wheels} (make gpu-wheels fetches them)")
        for r in rows:
            where = f" into {site}" if r["action"] == "installed" else ""
            self.say(f"   {r['dist']} {r['version']}: {r['action']}{where}")
        self.details["wheels"] = rows
        missing = check_required()
        if missing:
            shown = wheels.relative_to(REPO) if wheels.is_relative_to(REPO) else wheels
            raise RuntimeError(f"missing {', '.join(missing)}: run `make gpu-wheels` where PyPI is reachable and "
                               f"carry {shown}")
        import torch

        self.details["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                                    "megatron-core": installed_version("megatron-core")}
        self.say("   " + ", ".join(f"{k} {v}" for k, v in self.details["versions"].items()))

    # -- step 2 ------------------------------------------------------------------------------------------
    def correctness(self) -> None:
        dry = self.args.dry_run  # on CPU: the "GPU" run is a second CPU run
        ck = self.work / "ck"
        base = list(CORRECTNESS)
        save = self.train("save", [*base, "--exit-interval", "1", "--save", str(ck), "--save-interval", "1000000",
                                   "--metrics-file", str(self.logs / "save.jsonl")],
                          device="cpu", cap=150)
        if save.rc != 0 or not (ck / "latest_checkpointed_iteration.txt").exists():
            raise RuntimeError(f"the CPU run that saves iteration 1 failed (exit {save.rc}); see {save.log}")
        resume = [*base, "--load", str(ck), "--no-load-rng"]
        ref = self.train("cpu", [*resume, "--metrics-file", str(self.logs / "cpu.jsonl")], device="cpu", cap=150,
                         own_process=True)
        if ref.rc != 0:
            raise RuntimeError(f"the CPU run failed (exit {ref.rc}); see {ref.log}")
        dev_argv = [*resume, *self._gpu_flags(), "--metrics-file", str(self.logs / "gpu.jsonl")]
        dev = self.train("gpu", dev_argv, device="gpu", cap=180)
        if dev.rc != 0 and not dry:
            from train_throughput import EAGER_FLAGS

            self.say(f"   the GPU run failed (exit {dev.rc}); once more with {' '.join(EAGER_FLAGS)} "
                     "(no torch.compile)")
            self.details["gpu_failure_with_compiled_fusions"] = dev.log_tail(2000)
            self.gpu_flags += EAGER_FLAGS
            (self.logs / "gpu.jsonl").unlink(missing_ok=True)
            dev = self.train("gpu-eager", [*resume, *self._gpu_flags(), "--metrics-file", str(self.logs / "gpu.jsonl")],
                             device="gpu", cap=150)
        if dev.rc != 0:
            raise RuntimeError(f"the {'second CPU' if dry else 'GPU'} run failed (exit {dev.rc}); see {dev.log}")
        diff, rows = loss_rel_diff(ref.records, dev.records)
        self.figures["loss_rel_diff"] = diff
        self.details["losses"] = rows
        where = "GPU" if not dry else "CPU (its own process)" if self.isolated else "CPU (this process)"
        self.say(f"   lm loss, iterations {rows[0][0]}-{rows[-1][0]}: CPU "
                 + ", ".join(f"{r:.6f}" for _, r, _ in rows) + f"; {where} " + ", ".join(f"{d:.6f}" for *_, d in rows))
        ok = diff <= LOSS_RTOL
        self.say(f"   max relative difference {diff:.2e} (limit {LOSS_RTOL:.0e}): {'ok' if ok else 'FAILED'}")
        if not ok:
            self.details["errors"].append(f"correctness: losses differ by {diff:.2e} > {LOSS_RTOL:.0e}")

    def _gpu_flags(self) -> list[str]:
        from train_throughput import GPU_FLAGS

        return [*GPU_FLAGS, *self.gpu_flags]

    # -- step 3 ------------------------------------------------------------------------------------------
    def kernel(self) -> None:
        s = self.sizes
        result_file = self.logs / "jreg_overhead.json"
        if not self.isolated:
            import jreg_overhead  # noqa: I001 - benchmarks/, put on sys.path by main()
            from megatron_jreg.training.arguments import preset_flags

            flags = [*preset_flags(s.preset), "--seq-length", str(s.seq_length), "--max-position-embeddings",
                     str(s.seq_length)]
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                result = jreg_overhead.measure(flags, s.vocab_size, "auto", s.kernel_iters, s.bf16,
                                               budget_bytes=s.budget_mib * 2**20)
            (self.logs / "jreg_overhead.log").write_text(buf.getvalue() + jreg_overhead.report(result) + "\n")
            result_file.write_text(json.dumps(result, indent=1))
        else:
            import subprocess

            from train_throughput import child_environment

            cmd = [sys.executable, str(BENCH / "jreg_overhead.py"), "--preset", s.preset, "--seq-length",
                   str(s.seq_length), "--vocab-size", str(s.vocab_size), "--micro-batch-size", "auto",
                   "--iters", str(s.kernel_iters), "--json", str(result_file)]
            cmd += ["--bf16"] if s.bf16 else []
            cmd += ["--memory-budget-mib", str(s.budget_mib)] if s.budget_mib else []
            with open(self.logs / "jreg_overhead.log", "w") as log:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, timeout=self.timeout(200),
                                    env=child_environment()).returncode
            if rc != 0 or not result_file.exists():
                tail = (self.logs / "jreg_overhead.log").read_text(errors="replace")[-1500:]
                raise RuntimeError(f"jreg_overhead.py failed (exit {rc}):\n{tail}")
            result = json.loads(result_file.read_text())
        self.details["kernel"] = result
        self.figures["kernel_time_ratio"] = result["time_ratio"]
        self.figures["kernel_memory_ratio"] = result["memory_ratio"]
        self.figures["micro_batch"] = result["micro_batch"]
        self.figures["seq_length"] = result["seq_length"]
        peaks = ", ".join(f"{b}: {v / 2**30:.2f}" for b, v in result.get("probe_peaks", {}).items())
        self.say(f"   {result['device']}: {result['params'] / 1e6:.1f}M parameters; largest micro-batch "
                 f"{result['micro_batch']} within {result.get('budget_bytes', 0) / 2**30:.2f} GiB "
                 f"(GiB by micro-batch: {peaks})")
        self.say(f"   step {result['step_ms']['0.0']:.1f} ms (λ=0) vs {result['step_ms']['1.0']:.1f} ms (λ=1): "
                 f"time ratio {result['time_ratio']:.4f}; {result['memory_kind']} ratio {result['memory_ratio']:.4f}")

    # -- step 4 ------------------------------------------------------------------------------------------
    def throughput(self) -> None:
        from train_throughput import compare, train_flags

        s = self.sizes
        b = int(self.figures.get("micro_batch") or s.fallback_micro_batch)
        for attempt in range(2):
            runs = {}
            for lam in (0.0, 1.0):
                name = f"lambda{lam:g}"
                metrics = self.logs / f"{name}.jsonl"
                metrics.unlink(missing_ok=True)
                argv = train_flags(s.preset, lam, b, s.iters, metrics, seq_length=s.seq_length,
                                   vocab_size=s.vocab_size, log_interval=s.log_interval, bf16=s.bf16)
                argv += self._gpu_flags()  # harmless on CPU, where they are off anyway
                runs[lam] = self.train(name, argv, device="gpu", cap=200)
                if runs[lam].rc != 0:
                    break
            failed = [r for r in runs.values() if r.rc != 0]
            if not failed:
                break
            if attempt == 0 and b > 1 and is_oom(failed[0].log_tail(20000)):
                b = max(1, b * 3 // 4)
                self.say(f"   out of memory in training: micro-batch {b} instead")
                self.figures["micro_batch"] = b
                continue
            raise RuntimeError(f"training failed (exit {failed[0].rc}):\n{failed[0].log_tail(1500)}")
        c = compare(runs[0.0], runs[1.0], skip_through=s.log_interval)
        self.details["training"] = c
        self.figures["tokens_per_sec"] = c["baseline"]["tokens_per_sec"]
        self.figures["jreg_time_ratio"] = c["time_ratio"]
        if c["memory_ratio"] is not None and c["memory_kind"] == "allocated":
            self.figures["jreg_memory_ratio"] = c["memory_ratio"]
            self.details["jreg_memory_source"] = "training peak allocated"
        else:  # a CPU process's RSS is mostly torch itself: the kernel's saved activations say more
            self.figures["jreg_memory_ratio"] = self.figures.get("kernel_memory_ratio")
            self.details["jreg_memory_source"] = "kernel saved activations (no allocator statistics on CPU)"
        self.figures["tokens_per_sec_jreg"] = c["jreg"]["tokens_per_sec"]
        self.figures["model_tflops"] = c["baseline"]["tflops_per_rank"]
        for lam, key in ((0.0, "baseline"), (1.0, "jreg")):
            r, st = runs[lam], c[key]
            mem = f", peak {r.peak_kind} {r.peak_bytes / 2**30:.2f} GiB" if r.peak_bytes and r.peak_kind else ""
            self.say(f"   λ={lam:g}: {st['tokens_per_sec']:,.0f} tokens/s, {st['iteration_ms']:.1f} ms/iteration, "
                     f"{st['tflops_per_rank']:.2f} model TFLOP/s over {st['iterations']} iterations{mem}")
        self.say(f"   time ratio {c['time_ratio']:.4f}, memory ratio {fmt(self.figures['jreg_memory_ratio'])} "
                 f"({self.details['jreg_memory_source']})")

    # -- step 5 ------------------------------------------------------------------------------------------
    def matmul(self) -> None:
        import torch

        dtype = self.sizes.matmul_dtype
        device = torch.device("cpu" if self.args.dry_run else "cuda")
        rates = {n: matmul_tflops(n, dtype, reps, device) for n, reps in self.sizes.matmuls}
        rate = max(rates.values())
        self.details["matmul_tflops"] = rates
        self.figures["matmul_tflops"] = rate
        model = self.figures.get("model_tflops")
        if model is not None:
            self.figures["mfu"] = model / rate
            if not self.args.dry_run:
                self.figures["mfu_vs_790"] = model / H200_BF16_TFLOPS
        tried = ", ".join(f"{k}³ {v:.1f}" for k, v in rates.items())
        self.say(f"   {str(dtype).removeprefix('torch.')} matmul on {device.type}, TFLOP/s: {tried}; "
                 f"MFU {fmt(self.figures.get('mfu'))} (model {fmt(model)} TFLOP/s)"
                 + ("" if self.args.dry_run else f", {fmt(self.figures.get('mfu_vs_790'))} of {H200_BF16_TFLOPS:.0f}"))

    # -- all ---------------------------------------------------------------------------------------------
    def step(self, number: int, title: str, fn: Callable[[], None]) -> bool:
        self.say(f"== {number}/5 {title}  [{time.monotonic() - self.start:.0f} s]")
        t0 = time.monotonic()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a failed step is reported and the others still run
            self.error(title.split(":")[0], f"{type(e).__name__}: {e}")
            return False
        finally:
            self.details.setdefault("step_seconds", {})[title.split(":")[0]] = round(time.monotonic() - t0, 1)
        return True

    def finish(self) -> int:
        self.figures["elapsed_s"] = round(time.monotonic() - self.start, 1)
        self.figures["mode"] = self.details["mode"]
        line = summary_line(self.figures)
        self.details["figures"] = self.figures
        goals = []
        for key, limit in (("jreg_time_ratio", 1.01), ("jreg_memory_ratio", 1.02), ("mfu", 0.40)):
            v = self.figures.get(key)
            if v is not None:
                met = v >= limit if key == "mfu" else v <= limit
                goals.append(f"{key} {v:.4f} {'>=' if key == 'mfu' else '<='} {limit}: {'met' if met else 'not met'}")
        self.details["goals"] = goals
        if goals:
            self.say("   goals (issue 16): " + "; ".join(goals))
        if self.details["errors"]:
            self.say(f"   {len(self.details['errors'])} error(s): " + " | ".join(self.details["errors"]))
        if self.out:
            (self.out / "gpu_check.json").write_text(json.dumps(self.details, indent=1, default=str))
            self.say(f"   written: {self.out / 'gpu_check.txt'}, {self.out / 'gpu_check.json'}, logs in {self.logs}")
        else:
            self.say(f"   logs in {self.logs}")
        self.say(line)
        self.say.close()
        shutil.rmtree(self.work / "ck", ignore_errors=True)
        return 1 if self.details["errors"] else 0


def matmul_tflops(n: int, dtype, reps: int, device) -> float:
    """Best of 3 timings of `reps` n×n×n matmuls, in TFLOP/s (2n³ FLOPs each)."""
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        torch.mm(a, b, out=c)
    best = math.inf
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=c)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 * reps / best / 1e12


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="everything on CPU at tiny sizes (no GPU needed)")
    p.add_argument("--isolated", action="store_true",
                   help="with --dry-run: every run in a process of its own, as on the GPU (slower)")
    p.add_argument("--wheels", type=Path, default=DEFAULT_WHEELS, help="folder of wheels (make gpu-wheels)")
    p.add_argument("--site", type=Path, default=None,
                   help="where missing wheels are unpacked; must be on PYTHONPATH (gpu_check.sh sees to it)")
    p.add_argument("--out", default=os.environ.get("OUT") or None, help="output folder (default: $OUT)")
    p.add_argument("--work", default=None, help="parent of the scratch folder (default: the system's temp)")
    p.add_argument("--budget-s", type=float, default=480.0, help="time for the whole check (default 8 minutes)")
    args = p.parse_args(argv)
    if args.dry_run:  # tiny sizes gain nothing from threads, and on a busy machine they spin (timing noise)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.site is None:
        args.site = Path(tempfile.gettempdir()) / "megatron-jreg-gpu-site"
    if str(args.site) not in sys.path:
        sys.path.insert(0, str(args.site))
    sys.path.insert(0, str(BENCH))  # train_throughput, jreg_overhead
    check = Check(args)
    check.say(f"gpu_check ({check.details['mode']}): budget {args.budget_s:.0f} s, Python {sys.version.split()[0]}")

    if not check.step(1, "wheels: megatron-core and what else is missing", check.wheels):
        return check.finish()
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        check.error("device", "no CUDA device is visible: run this on the GPU machine, or pass --dry-run")
        check.finish()
        return 2
    s = check.sizes  # the step titles name them
    check.step(2, "correctness: tiny fp32, 5 iterations from one checkpoint, CPU vs "
               + ("a second CPU run (dry run)" if args.dry_run else "GPU"), check.correctness)
    check.step(3, f"JREG kernel: {s.preset} {'bf16' if s.bf16 else 'fp32'}, {s.seq_length} tokens, largest micro-batch",
               check.kernel)
    check.step(4, f"training: {s.preset}, λ = 0 and λ = 1, {s.iters} iterations each", check.throughput)
    check.step(5, "matmul rate and MFU", check.matmul)
    return check.finish()


if __name__ == "__main__":  # dist_checkpointing's writer processes re-import __main__
    sys.exit(main())
