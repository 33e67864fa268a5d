"""The JREG op as training runs it, against the memory floor on the same device, side by side.

A layer call of the plugin: h_in and h_out = h_in + y are not leaves and receive gradients from the rest of the
graph (⟨h_in, w_in⟩ + ⟨h_out, w_out⟩ stand in for it), and JREG adds its term λ·w_ℓ·Ψ_ℓ as the plugin wires it
(`jreg.LayerPenalty`: a pre-hook on h_in, a post-hook on h_out). The op's cost is what that graph's forward and
backward take with JREG less the same graph without it: time (median over rounds; on a GPU, CUDA events around
`--reps` back-to-back calls, so the host's share of a call overlaps as in training), aten ops and device kernels
(torch's profiler over one call: the CPU's aten ops are the proxy for a GPU's launches) and bytes allocated (the
profiler's memory records). Two kinds of call: a step that does not log ("step"), and one that logs Ψ ("logging",
plus `jreg.token_figures` and the masked sum, as the plugin records). The floor is a plain copy of 3·T·h elements
(`dst.copy_(src)`: 6 passes over [T, h], reading h_in and h_out and the two gradients and writing the gradients),
on the same device.

`--baseline REV` also runs megatron_jreg/jreg.py (with its jreg_kernels.py and jreg_triton.py) as it was at that
git revision, wired as that revision's plugin wired it (the term's scalar through an identity on h_out whose
backward seeds it with ones: `attach_loss`), in the same rounds.

    python benchmarks/jreg_op.py                               # CPU: [16384, 768 | 2048 | 3072] × bf16, fp32
    python benchmarks/jreg_op.py --baseline 94871a5            # ... and the op as it was at that revision
    python benchmarks/jreg_op.py --device cuda --reps 20       # the GPU check's call
    python benchmarks/jreg_op.py --compile-cost                # CPU: first call of fresh processes, eager vs compiled

`--backend triton|compiled|torch` forces jreg_kernels' backend (default: its choice for the device).
Last line: op_vs_floor=… launches=… allocated_mib=… (the worse dtype of a step that does not log at
[16384, 2048]; launches: a GPU's kernels, the CPU's aten ops), and op_vs_baseline=… with --baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from megatron_jreg.process_env import huge_pages_for_cpu_training  # noqa: E402

huge_pages_for_cpu_training()  # as the train entry sets it, before torch loads (THP_MEM_ALLOC_ENABLE=0: without)
import torch  # noqa: E402

SHAPES = ((16384, 768), (16384, 2048), (16384, 3072))  # the paper's 170M / 1B / 3B widths, 8 × 2048 tokens
TARGET = (16384, 2048)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Sizes around jreg_kernels.COMPILE_MIN_ELEMENTS (4M): the demo's layer, then 1M, 4M, 16M elements.
SMALL_SHAPES = ((512, 64), (4096, 256), (8192, 512), (16384, 1024))
FACTOR = 0.5  # λ·w_ℓ of the layer
MODULES = ("jreg", "jreg_kernels", "jreg_triton")  # the op's files, loaded together at a revision


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def load_baseline(rev: str) -> types.ModuleType:
    """megatron_jreg/jreg.py at git revision `rev` with that revision's jreg_kernels.py and jreg_triton.py (where
    they existed), as a package of their own: their `megatron_jreg` imports point into it."""
    name = f"jreg_at_{re.sub(r'[^0-9A-Za-z]', '_', rev)}"
    folder = Path(tempfile.mkdtemp(prefix="jreg-baseline-")) / name
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    for module in MODULES:
        src = subprocess.run(["git", "show", f"{rev}:megatron_jreg/{module}.py"], cwd=ROOT, capture_output=True,
                             text=True)
        if src.returncode != 0:
            if module == "jreg":
                raise SystemExit(f"--baseline {rev}: git show failed ({src.stderr.strip()}); give a revision of "
                                 "this checkout")
            continue
        text = re.sub(r"\bfrom megatron_jreg import\b", f"from {name} import", src.stdout)
        (folder / f"{module}.py").write_text(re.sub(r"\bfrom megatron_jreg\.", f"from {name}.", text))
    sys.path.insert(0, str(folder.parent))
    import importlib

    return importlib.import_module(f"{name}.jreg")


class _AttachLoss(torch.autograd.Function):
    """The plugin's wiring before LayerPenalty (up to 94871a5): identity on h_out whose backward seeds d(term) = 1."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, term: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.term_shape, ctx.term_dtype = term.shape, term.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return grad_output, torch.ones(ctx.term_shape, dtype=ctx.term_dtype, device=grad_output.device)


def _attach_loss(output: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
    out = _AttachLoss.apply(output, term)
    try:
        from megatron.core.utils import make_viewless_tensor
    except ImportError:  # no megatron-core here: the view stays (an alias op less than that revision's plugin)
        return out
    return make_viewless_tensor(out, requires_grad=True, keep_graph=True)


class Graph:
    """One layer call's graph: leaves x, y [T, h]; h_in = x·1, h_out = h_in + y; loss ⟨h_in, w_in⟩ + ⟨h_out, w_out⟩
    (so both receive gradients from elsewhere), with JREG added as `variant` wires it."""

    def __init__(self, rows: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        g = torch.Generator(device=device).manual_seed(0)
        self.x = torch.randn(rows, width, generator=g, device=device).to(dtype).requires_grad_(True)
        self.y = (0.3 * torch.randn(rows, width, generator=g, device=device)).to(dtype).requires_grad_(True)
        self.w_in = torch.randn(rows, width, generator=g, device=device).to(dtype)
        self.w_out = torch.randn(rows, width, generator=g, device=device).to(dtype)
        self.up = torch.full((1,), 1.0 / rows, device=device).expand(rows)  # the microbatch's scale / tokens
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)  # what a logging step adds Ψ into

    def run(self, variant: str, module: types.ModuleType | None, record: bool) -> None:
        """Forward and backward of the graph: variant "none" (without JREG), "op" (`module`'s LayerPenalty) or
        "baseline" (`module` at a revision, wired through `_attach_loss`)."""
        self.x.grad = self.y.grad = None
        h_in = self.x * 1
        if variant == "op":
            penalty = module.LayerPenalty()
            h_in = penalty.watch(h_in)
        h_out = h_in + self.y
        if variant == "op":
            if record:
                self.sums += module.token_figures(h_in, h_out).flatten(1).sum(1).double() / self.up.shape[0]
            h_out = penalty.attach(h_out, h_in, self.up, FACTOR)
        elif variant == "baseline":
            total = (module.displacement_total(h_in, h_out) if hasattr(module, "displacement_total")
                     else module.displacement_sum(h_in, h_out)[0])  # before displacement_total existed
            share = total / self.up.shape[0]
            if record:
                self.sums[0] += share.detach().double()
            h_out = _attach_loss(h_out, share * FACTOR)
        ((h_in * self.w_in).sum() + (h_out * self.w_out).sum()).backward()


def profile_call(run: Callable[[], None], device: torch.device) -> dict:
    """aten ops (nested included), device kernels and bytes allocated by one call, from torch's profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        run()
        _sync(device)()
    events = prof.events()
    memory = (lambda e: e.self_device_memory_usage) if device.type == "cuda" else (lambda e: e.self_cpu_memory_usage)
    return {"aten_ops": sum(1 for e in events if e.name.startswith("aten::")),
            "kernels": sum(1 for e in events if e.device_type == DeviceType.CUDA),
            "allocated": sum(max(0, memory(e)) for e in events if e.device_type == DeviceType.CPU)}


def timed(calls: dict[str, Callable[[], object]], device: torch.device, rounds: int, reps: int) -> dict:
    """Median seconds per call of each entry, alternated round by round (the order rotates); on a GPU CUDA events
    around `reps` back-to-back calls (no sync between them), on the CPU the wall clock around each call."""
    sync, names = _sync(device), list(calls)
    for run in calls.values():  # warm-up (compiles where the op compiles)
        run()
    sync()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    calls[name]()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / 1e3 / reps)
            else:
                t0 = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in times.items()}


def measure(shape: tuple[int, int], dtype: torch.dtype, device: torch.device, rounds: int, reps: int,
            variants: dict[str, tuple[str, types.ModuleType]]) -> dict:
    """Per variant and kind of call: its time, ops, kernels and bytes less the graph's without JREG."""
    rows, width = shape
    graph = Graph(rows, width, dtype, device)
    src = torch.randn(3 * rows * width, device=device).to(dtype)
    dst = torch.empty_like(src)
    calls: dict[str, Callable[[], object]] = {"none": lambda: graph.run("none", None, False),
                                              "floor": lambda: dst.copy_(src)}
    for name, (kind, module) in variants.items():
        for record in (False, True):
            calls[f"{name}/{'logging' if record else 'step'}"] = (
                lambda k=kind, m=module, rec=record: graph.run(k, m, rec))
    seconds = timed(calls, device, rounds, reps)
    base = profile_call(calls["none"], device)
    element = torch.finfo(dtype).bits // 8
    result = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "rounds": rounds, "reps": reps,
              "floor_bytes": 6 * rows * width * element, "seconds": seconds, "graph": base, "calls": {}}
    for name in calls:
        if "/" not in name:
            continue
        counts = profile_call(calls[name], device)
        extra = seconds[name] - seconds["none"]
        result["calls"][name] = {"seconds": extra, "vs_floor": extra / seconds["floor"],
                                 **{k: counts[k] - base[k] for k in counts}}
    return result


def first_call(shape: tuple[int, int], dtype: str) -> dict:
    """In this (fresh) process: importing torch._dynamo and inductor (megatron-core imports them anyway), then
    the first and the second layer call (seconds)."""
    t0 = time.perf_counter()
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401

    from megatron_jreg import jreg, jreg_kernels

    imported = time.perf_counter() - t0
    graph = Graph(*shape, DTYPES[dtype], torch.device("cpu"))
    t1 = time.perf_counter()
    graph.run("op", jreg, False)
    t2 = time.perf_counter()
    graph.run("op", jreg, False)
    t3 = time.perf_counter()
    return {"import": imported, "first": t2 - t1, "second": t3 - t2, "backend": jreg_kernels.backend_for(graph.x)}


def compile_cost(dtype: str) -> dict:
    """First-call seconds of fresh processes at [16384, 2048]: empty inductor cache, then warm; and the eager
    and compiled per-call times (the two gradient kernels) around COMPILE_MIN_ELEMENTS."""
    from megatron_jreg import jreg_kernels

    out: dict = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        for label in ("empty_cache", "warm_cache", "eager"):
            run_env = {**env, jreg_kernels.ENV: "torch"} if label == "eager" else env
            proc = subprocess.run([sys.executable, __file__, "--first-call", dtype], env=run_env, capture_output=True,
                                  text=True, cwd=ROOT)
            if proc.returncode != 0:
                raise RuntimeError(f"--first-call failed:\n{proc.stderr[-2000:]}")
            out[label] = json.loads(proc.stdout.strip().splitlines()[-1])
    small = {}
    for rows, width in SMALL_SHAPES:
        a, b, g = (torch.randn(rows, width).to(DTYPES[dtype]) for _ in range(3))
        up = torch.ones(rows)

        def call(backend: str, a: torch.Tensor = a, b: torch.Tensor = b, g: torch.Tensor = g,
                 up: torch.Tensor = up) -> None:
            _, figures = jreg_kernels.grad_b(a, b, up, 1.0, True, g, out=g, backend=backend)
            jreg_kernels.grad_a(a, b, figures, g, out=g, backend=backend)

        per: dict[str, list[float]] = {"torch": [], "compiled": []}
        for backend in per:
            call(backend)
        reps = max(3, min(200, 2**24 // (rows * width)))
        for r in range(5):
            for backend in (("torch", "compiled") if r % 2 == 0 else ("compiled", "torch")):
                t0 = time.perf_counter()
                for _ in range(reps):
                    call(backend)
                per[backend].append((time.perf_counter() - t0) / reps)
        small[f"{rows}x{width}"] = {k: statistics.median(v) for k, v in per.items()}
    out["per_call"] = small
    return out


def report(results: list[dict], device: str) -> list[str]:
    r0 = results[0]
    timing = (f"CUDA events around {r0['reps']} back-to-back calls" if device.startswith("cuda") or "NVIDIA" in device
              else "wall clock per call")
    lines = [f"device {device}; a layer call as training runs it (h_in, h_out not leaves, gradients from the rest "
             f"of the graph), less the same graph without JREG; floor = copy of 6 passes over [T, h]; medians of "
             f"{r0['rounds']} alternated rounds, {timing}; THP_MEM_ALLOC_ENABLE="
             f"{os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}"]
    for r in results:
        lines.append(f"[{r['shape'][0]}, {r['shape'][1]}] {r['dtype']:>8}: floor {1e3 * r['seconds']['floor']:8.2f} ms "
                     f"({r['floor_bytes'] / 2**20:.0f} MiB); the graph without JREG {1e3 * r['seconds']['none']:.2f} "
                     f"ms, {r['graph']['aten_ops']} aten ops, {r['graph']['kernels']} kernels, "
                     f"{r['graph']['allocated'] / 2**20:.0f} MiB allocated")
        for name, v in r["calls"].items():
            lines.append(f"    {name:>18}: +{1e3 * v['seconds']:8.2f} ms = {v['vs_floor']:5.2f} x floor, "
                         f"{v['aten_ops']:+d} aten ops, {v['kernels']:+d} kernels, "
                         f"{v['allocated'] / 2**20:+.1f} MiB allocated")
    return lines


def summary(results: list[dict], device: torch.device, baseline: str | None) -> str:
    at_target = [r for r in results if tuple(r["shape"]) == TARGET] or results
    step = [r["calls"]["op/step"] for r in at_target]
    worst = max(step, key=lambda v: v["vs_floor"])
    launches = max(v["kernels" if device.type == "cuda" else "aten_ops"] for v in step)
    shape = at_target[0]["shape"]
    line = (f"op_vs_floor={worst['vs_floor']:.2f} launches={launches} "
            f"allocated_mib={max(v['allocated'] for v in step) / 2**20:.1f}")
    if baseline:
        ratio = max(r["calls"]["op/step"]["seconds"] / r["calls"][f"@{baseline}/step"]["seconds"] for r in at_target)
        line += f" op_vs_baseline={ratio:.2f}"
    return line + f" shape={shape[0]}x{shape[1]} device={device.type}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--rounds", type=int, default=7, help="alternated timed rounds per shape and dtype")
    p.add_argument("--reps", type=int, default=20, help="GPU: back-to-back calls between two CUDA events")
    p.add_argument("--dtypes", default="bf16,fp32", help="comma-separated: bf16, fp32")
    p.add_argument("--shapes", default=None, help="comma-separated TxH (default: 16384x768,16384x2048,16384x3072)")
    p.add_argument("--backend", choices=["auto", "triton", "compiled", "torch"], default="auto")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads; default torch's)")
    p.add_argument("--baseline", metavar="REV", help="also time megatron_jreg's op at this git revision")
    p.add_argument("--compile-cost", action="store_true", help="CPU: first-call seconds of fresh processes")
    p.add_argument("--json", type=Path, help="also write every figure here")
    p.add_argument("--first-call", metavar="DTYPE", help=argparse.SUPPRESS)  # the fresh process of --compile-cost
    args = p.parse_args(argv)
    if args.first_call:
        print(json.dumps(first_call(TARGET, args.first_call)))
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if args.threads is not None:
        if args.threads < 1:
            p.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    dtypes = [d.strip() for d in args.dtypes.split(",")]
    if bad := [d for d in dtypes if d not in DTYPES]:
        p.error(f"--dtypes {','.join(bad)}: use bf16 and/or fp32")
    try:
        shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",")] if args.shapes \
            else list(SHAPES)
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        p.error(f"--shapes {args.shapes}: give TxH pairs, e.g. 16384x2048")
    from megatron_jreg import jreg, jreg_kernels

    saved = os.environ.get(jreg_kernels.ENV)
    os.environ[jreg_kernels.ENV] = args.backend
    try:
        return run(args, device, shapes, dtypes, jreg)
    finally:
        if saved is None:
            del os.environ[jreg_kernels.ENV]
        else:
            os.environ[jreg_kernels.ENV] = saved


def run(args: argparse.Namespace, device: torch.device, shapes: list[tuple[int, int]], dtypes: list[str],
        jreg: types.ModuleType) -> int:
    """Measure every shape × dtype (and the compile cost when asked), print, write --json."""
    variants = {"op": ("op", jreg)}
    if args.baseline:
        variants[f"@{args.baseline}"] = ("baseline", load_baseline(args.baseline))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    results = []
    for shape in shapes:
        for dtype in dtypes:
            results.append(measure(shape, DTYPES[dtype], device, args.rounds, args.reps, variants))
            print("\n".join(report(results[-1:], name)[1:]), flush=True)
    print("\n".join(report(results, name)), flush=True)
    out = {"results": results, "device": name}
    if args.compile_cost:
        cost = {d: compile_cost(d) for d in dtypes}
        out["compile_cost"] = cost
        for dtype, c in cost.items():
            e, w, eager = c["empty_cache"], c["warm_cache"], c["eager"]
            print(f"first layer call of a fresh process at [{TARGET[0]}, {TARGET[1]}] {dtype}: compiled "
                  f"{e['first']:.1f} s with an empty inductor cache, {w['first']:.1f} s with a warm one "
                  f"(then {w['second']:.2f} s a call); eager {eager['first']:.2f} s (then {eager['second']:.2f} s); "
                  f"importing torch._dynamo and inductor before it (megatron-core does): {w['import']:.1f} s")
            for shape, t in c["per_call"].items():
                print(f"    [{shape.replace('x', ', ')}] {dtype}: eager {1e3 * t['torch']:.2f} ms, compiled "
                      f"{1e3 * t['compiled']:.2f} ms per layer call's backward")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    print(summary(results, device, args.baseline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
