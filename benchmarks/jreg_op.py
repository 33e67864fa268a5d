"""The JREG displacement op alone against the memory floor on the same device, side by side.

The op is what the plugin runs per layer and microbatch: `jreg.displacement_total(h_in, h_out)` and its
backward into both hidden states [T, h]. It must move at least 6·T·h elements (forward: read h_in and h_out;
backward: read them again, write their two gradients); the floor is a plain copy of 3·T·h elements
(`dst.copy_(src)`, read + written: the same bytes) on the same device. Op and floor alternate over repeated
rounds (medians), after a warm-up call (which compiles where the op compiles). One profiled call gives the
aten ops per layer call, and the kernel launches on a GPU. Also timed: allocating and first touching two
[T, h] tensors, part of the op's time (its gradients are fresh tensors): on CPU that is page faults, which
torch's THP_MEM_ALLOC_ENABLE=1 (huge pages) cuts. The benchmark runs as `megatron-jreg train` does: with huge
pages on a machine with no sign of a GPU (megatron_jreg/process_env.py), unless THP_MEM_ALLOC_ENABLE is set.

    python benchmarks/jreg_op.py                               # CPU: [16384, 768 | 2048 | 3072] × bf16, fp32
    python benchmarks/jreg_op.py --device cuda --rounds 20     # the GPU check's call
    python benchmarks/jreg_op.py --baseline 0f551ac            # also jreg.py as it was at that git revision
    python benchmarks/jreg_op.py --compile-cost                # CPU: first call of fresh processes, eager vs compiled

`--backend triton|compiled|torch` forces jreg_kernels' backend (default: its choice for the device).
Last line: op_vs_floor=… launches=… — the worse dtype at [16384, 2048]; launches are the CUDA kernels of one
layer call on a GPU and its aten ops on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
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


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def load_baseline(rev: str) -> types.ModuleType:
    """megatron_jreg/jreg.py as it was at git revision `rev`, as a standalone module (it imports only torch)."""
    src = subprocess.run(["git", "show", f"{rev}:megatron_jreg/jreg.py"], cwd=ROOT, capture_output=True, text=True)
    if src.returncode != 0:
        raise SystemExit(f"--baseline {rev}: git show failed ({src.stderr.strip()}); give a revision of this checkout")
    module = types.ModuleType(f"jreg_at_{rev}")
    exec(compile(src.stdout, f"jreg.py@{rev}", "exec"), module.__dict__)  # noqa: S102 - our own file at a revision
    return module


def op_of(jreg_module: types.ModuleType, kind: str) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One layer call: the summed displacement and its backward into both (leaf) hidden states."""
    total = getattr(jreg_module, "displacement_total", None)
    if total is None:  # before displacement_total existed: the sum of displacement_sum
        total = lambda a, b, mask, kind: jreg_module.displacement_sum(a, b, mask, kind)[0]  # noqa: E731

    def run(a: torch.Tensor, b: torch.Tensor) -> None:
        a.grad = b.grad = None
        total(a, b, None, kind).backward()

    return run


def counts(run: Callable[[], None], device: torch.device) -> dict:
    """aten ops (nested included) and device kernels of one call, from torch's profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run()
        _sync(device)()
    events = prof.events()
    return {"aten_ops": sum(1 for e in events if e.name.startswith("aten::")),
            "kernels": sum(1 for e in events if e.device_type == DeviceType.CUDA)}


def measure(shape: tuple[int, int], dtype: torch.dtype, device: torch.device, rounds: int, kind: str,
            variants: dict[str, types.ModuleType]) -> dict:
    """Median seconds of each variant's layer call and of the floor copy, alternated round by round."""
    rows, width = shape
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(rows, width, generator=g, device=device).to(dtype).requires_grad_(True)
    b = (a.detach().float() + 0.3 * torch.randn(rows, width, generator=g, device=device)).to(dtype)
    b.requires_grad_(True)
    src = torch.randn(3 * rows * width, generator=g, device=device).to(dtype)
    dst = torch.empty_like(src)
    sync = _sync(device)
    ops = {name: op_of(module, kind) for name, module in variants.items()}
    calls: dict[str, Callable[[], object]] = {name: (lambda op=op: op(a, b)) for name, op in ops.items()}
    calls["floor"] = lambda: dst.copy_(src)
    # what the op's time includes for its two fresh gradient tensors: allocating and first touching them (page
    # faults on CPU)
    calls["alloc"] = lambda: torch.empty(2 * rows * width, dtype=dtype, device=device).fill_(0)
    for run in calls.values():  # warm-up (compiles where the op compiles)
        run()
    sync()
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order every round
            sync()
            t0 = time.perf_counter()
            calls[name]()
            sync()
            times[name].append(time.perf_counter() - t0)
    element = torch.finfo(dtype).bits // 8
    result = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "rounds": rounds,
              "bytes": 6 * rows * width * element + 40 * rows,  # + the [T] figures and the upstream gradient
              "seconds": {name: statistics.median(v) for name, v in times.items()}}
    for name in variants:
        result[name] = {"vs_floor": result["seconds"][name] / result["seconds"]["floor"], **counts(calls[name], device)}
    return result


def first_call(shape: tuple[int, int], dtype: str) -> dict:
    """In this (fresh) process: importing torch._dynamo and inductor (megatron-core imports them anyway), then
    the first and the second layer call (seconds)."""
    t0 = time.perf_counter()
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401

    from megatron_jreg import jreg, jreg_kernels

    imported = time.perf_counter() - t0
    a = torch.randn(*shape).to(DTYPES[dtype]).requires_grad_(True)
    b = torch.randn(*shape).to(DTYPES[dtype]).requires_grad_(True)
    op = op_of(jreg, "angular")
    t1 = time.perf_counter()
    op(a, b)
    t2 = time.perf_counter()
    op(a, b)
    t3 = time.perf_counter()
    return {"import": imported, "first": t2 - t1, "second": t3 - t2, "backend": jreg_kernels.backend_for(a)}


def compile_cost(dtype: str) -> dict:
    """First-call seconds of fresh processes at [16384, 2048]: empty inductor cache, then warm; and the eager
    and compiled per-call times around COMPILE_MIN_ELEMENTS."""
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
        a = torch.randn(rows, width).to(DTYPES[dtype])
        b = torch.randn(rows, width).to(DTYPES[dtype])
        grad = torch.ones(rows)
        per: dict[str, list[float]] = {"torch": [], "compiled": []}
        for backend in per:
            jreg_kernels.backward(a, b, grad, jreg_kernels.forward(a, b, True, backend)[1:], True, backend)
        reps = max(3, min(200, 2**24 // (rows * width)))
        for r in range(5):
            for backend in (("torch", "compiled") if r % 2 == 0 else ("compiled", "torch")):
                t0 = time.perf_counter()
                for _ in range(reps):
                    rows_ = jreg_kernels.forward(a, b, True, backend)[1:]
                    jreg_kernels.backward(a, b, grad, rows_, True, backend)
                per[backend].append((time.perf_counter() - t0) / reps)
        small[f"{rows}x{width}"] = {k: statistics.median(v) for k, v in per.items()}
    out["per_call"] = small
    return out


def report(results: list[dict], variants: list[str], device: str) -> list[str]:
    lines = [f"device {device}; op = jreg.displacement_total forward + backward of one layer call; floor = copy of "
             f"the same bytes; medians over {results[0]['rounds']} alternated rounds; "
             f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}"]
    for r in results:
        head = f"[{r['shape'][0]}, {r['shape'][1]}] {r['dtype']:>8}: floor {1e3 * r['seconds']['floor']:8.1f} ms, " \
               f"{r['bytes'] / 2**20:7.0f} MiB moved; allocating + first touch of the two gradients " \
               f"{1e3 * r['seconds']['alloc']:.1f} ms"
        lines.append(head)
        for name in variants:
            v = r[name]
            kernels = f", {v['kernels']} kernels" if device.startswith("cuda") else ""
            lines.append(f"    {name:>9}: {1e3 * r['seconds'][name]:8.1f} ms = {v['vs_floor']:5.2f} x floor, "
                         f"{v['aten_ops']} aten ops{kernels}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--rounds", type=int, default=7, help="alternated timed rounds per shape and dtype")
    p.add_argument("--dtypes", default="bf16,fp32", help="comma-separated: bf16, fp32")
    p.add_argument("--shapes", default=None, help="comma-separated TxH (default: 16384x768,16384x2048,16384x3072)")
    p.add_argument("--distance", choices=["angular", "cosine"], default="angular")
    p.add_argument("--backend", choices=["auto", "triton", "compiled", "torch"], default="auto")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads; default torch's)")
    p.add_argument("--baseline", metavar="REV", help="also time megatron_jreg/jreg.py at this git revision")
    p.add_argument("--compile-cost", action="store_true", help="CPU: first-call seconds of fresh processes")
    p.add_argument("--json", type=Path, help="also write every figure here")
    p.add_argument("--first-call", metavar="DTYPE", help=argparse.SUPPRESS)  # the fresh process of --compile-cost
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.first_call:
        print(json.dumps(first_call(TARGET, args.first_call)))
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
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
    variants = {"op": jreg}
    if args.baseline:
        variants[f"@{args.baseline}"] = load_baseline(args.baseline)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    results = []
    for shape in shapes:
        for dtype in dtypes:
            results.append(measure(shape, DTYPES[dtype], device, args.rounds, args.distance, variants))
            print("\n".join(report(results[-1:], list(variants), name)[1:]), flush=True)
    print("\n".join(report(results, list(variants), name)), flush=True)
    summary = {"results": results, "device": name}
    if args.compile_cost:
        cost = {d: compile_cost(d) for d in dtypes}
        summary["compile_cost"] = cost
        for dtype, c in cost.items():
            e, w, eager = c["empty_cache"], c["warm_cache"], c["eager"]
            print(f"first layer call of a fresh process at [{TARGET[0]}, {TARGET[1]}] {dtype}: compiled "
                  f"{e['first']:.1f} s with an empty inductor cache, {w['first']:.1f} s with a warm one "
                  f"(then {w['second']:.2f} s a call); eager {eager['first']:.2f} s (then {eager['second']:.2f} s); "
                  f"importing torch._dynamo and inductor before it (megatron-core does): {w['import']:.1f} s")
            for shape, t in c["per_call"].items():
                print(f"    [{shape.replace('x', ', ')}] {dtype}: eager {1e3 * t['torch']:.2f} ms, compiled "
                      f"{1e3 * t['compiled']:.2f} ms per layer call")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    at_target = [r for r in results if tuple(r["shape"]) == TARGET] or results
    worst = max(r["op"]["vs_floor"] for r in at_target)
    launches = max(r["op"]["kernels" if device.type == "cuda" else "aten_ops"] for r in at_target)
    shape = at_target[0]["shape"]
    print(f"op_vs_floor={worst:.2f} launches={launches} shape={shape[0]}x{shape[1]} device={device.type}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
