"""jreg_kernels' choice of backend, its fallback when torch.compile fails, and benchmarks/jreg_op.py's command line.

The backends' numerics against the float64 reference are in test_jreg_math.py (the `kernel` fixture).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def test_backend_follows_device_size_and_the_environment(monkeypatch):
    import torch

    from megatron_jreg import jreg_kernels

    monkeypatch.delenv(jreg_kernels.ENV, raising=False)
    small = torch.empty(512, 64)
    large = torch.empty(jreg_kernels.COMPILE_MIN_ELEMENTS // 256, 256)
    assert jreg_kernels.backend_for(small) == "torch"  # as fast eagerly, and nothing to compile
    assert jreg_kernels.backend_for(large) == "compiled"
    assert jreg_kernels.backend_for(torch.empty(large.shape, device="meta")) == "torch"
    for name in ("torch", "triton", "compiled"):
        monkeypatch.setenv(jreg_kernels.ENV, name)
        assert jreg_kernels.backend_for(small) == name
    monkeypatch.setenv(jreg_kernels.ENV, "auto")
    assert jreg_kernels.backend_for(large) == "compiled"
    monkeypatch.setenv(jreg_kernels.ENV, "fast")
    with pytest.raises(ValueError, match=r"MEGATRON_JREG_KERNEL='fast': use one of auto, triton, compiled, torch"):
        jreg_kernels.backend_for(small)


def test_a_failing_compile_warns_once_and_runs_the_eager_path(monkeypatch):
    """No C++ compiler (or any inductor failure): one warning, the same numbers, and no further attempt."""
    import torch

    from megatron_jreg import jreg_kernels

    attempts = []

    def broken_compile(fn, **kwargs):
        def run(*args):
            attempts.append(fn.__name__)
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setattr(jreg_kernels, "_COMPILED", jreg_kernels._Compiled())
    monkeypatch.delenv(jreg_kernels.ENV, raising=False)
    torch.manual_seed(0)
    a, b, grad = torch.randn(9, 16), torch.randn(9, 16), torch.rand(9)
    with pytest.warns(UserWarning, match=r"torch.compile of the JREG displacement kernel failed \(RuntimeError: "
                                         r"InvalidCxxCompiler.*MEGATRON_JREG_KERNEL=torch"):
        out = jreg_kernels.forward(a, b, backend="compiled")
    torch.testing.assert_close(out, jreg_kernels.forward(a, b, backend="torch"))
    grad_b, figures = jreg_kernels.grad_b(a, b, grad, 1.0, True, backend="compiled")
    eager_b, eager_figures = jreg_kernels.grad_b(a, b, grad, 1.0, True, backend="torch")
    torch.testing.assert_close(grad_b, eager_b)
    torch.testing.assert_close(figures, eager_figures)
    torch.testing.assert_close(jreg_kernels.grad_a(a, b, figures, backend="compiled"),
                               jreg_kernels.grad_a(a, b, eager_figures, backend="torch"))
    assert attempts == ["_row_sums"]
    assert jreg_kernels.backend_for(torch.empty(jreg_kernels.COMPILE_MIN_ELEMENTS, 1)) == "torch"


@pytest.mark.slow  # a fresh process importing torch and triton, the kernels interpreted in numpy
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_in_the_interpreter():
    """test_jreg_math.py's numerics on the Triton kernels, interpreted on CPU tensors (TRITON_INTERPRET=1 must be
    set before triton is imported, hence a fresh process)."""
    import os
    import subprocess
    import sys

    root = BENCH.parent
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                           "-k", "triton", "-W", "ignore::RuntimeWarning", "tests/test_jreg_math.py"],
                          cwd=root, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "passed" in summary and "skipped" not in summary and "failed" not in summary, summary


def _jreg_op():
    spec = importlib.util.spec_from_file_location("jreg_op", BENCH / "jreg_op.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_jreg_op_prints_the_op_against_the_floor(capsys):
    """The benchmark's documented calls at a tiny shape: the op as training runs it, and at a git revision."""
    jreg_op = _jreg_op()
    assert jreg_op.main(["--shapes", "64x32", "--rounds", "2", "--dtypes", "fp32,bf16", "--backend", "torch",
                         "--baseline", "HEAD"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("op_vs_floor=") and " launches=" in lines[-1] and "shape=64x32 device=cpu" in lines[-1]
    figures = dict(item.split("=") for item in lines[-1].split())
    assert float(figures["op_vs_floor"]) > 0 and int(figures["launches"]) > 0 and float(figures["op_vs_baseline"]) > 0
    for call in ("op/step", "op/logging", "@HEAD/step", "@HEAD/logging"):
        assert any(line.strip().startswith(f"{call}:") and "x floor" in line and "aten ops" in line for line in lines)


@pytest.mark.slow  # compiles the two gradient kernels (about a minute on two shared cores)
def test_compiled_op_as_training_runs_it_adds_two_aliases_and_no_tensor():
    """The CPU's fused path (torch.compile), counted by torch's profiler in a graph where h_in and h_out are not
    leaves: a layer call that does not log adds at most 12 aten ops to the same graph without JREG (two aliases in
    forward; each backward kernel is one compiled call) and allocates less than one [T, h] tensor (the [5, T]
    figures). The CPU's aten ops stand in for a GPU's launches (jreg_triton: two kernels)."""
    import os
    from unittest import mock

    import torch

    from megatron_jreg import jreg, jreg_kernels

    jreg_op = _jreg_op()
    rows, width = 256, 128
    with mock.patch.dict(os.environ, {jreg_kernels.ENV: "compiled"}):
        for dtype in (torch.float32, torch.bfloat16):
            graph = jreg_op.Graph(rows, width, dtype, torch.device("cpu"))
            for _ in range(2):  # compiles
                graph.run("op", jreg, False)
            assert jreg_kernels._COMPILED.failed is None
            without = jreg_op.profile_call(lambda g=graph: g.run("none", None, False), torch.device("cpu"))
            with_jreg = jreg_op.profile_call(lambda g=graph: g.run("op", jreg, False), torch.device("cpu"))
            extra_ops = with_jreg["aten_ops"] - without["aten_ops"]
            extra_bytes = with_jreg["allocated"] - without["allocated"]
            assert 0 < extra_ops <= 12 and extra_bytes < rows * width * dtype.itemsize, (extra_ops, extra_bytes)


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "64"], "--shapes 64: give TxH pairs"),
    (["--dtypes", "fp16"], "--dtypes fp16: use bf16 and/or fp32"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--device", "cuda"], "--device cuda: no CUDA device here"),
])
def test_jreg_op_refuses_bad_arguments_in_one_line(argv, message, capsys):
    import torch

    if argv[:2] == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    with pytest.raises(SystemExit) as e:
        _jreg_op().main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
