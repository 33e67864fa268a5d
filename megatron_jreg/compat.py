"""megatron-core on CPU with gloo (laptops, CI, tests): redirects exactly the CUDA-only calls that stop it, and nothing
when CUDA is available; CPU training only where no sign of a GPU exists (DEVELOPERS.md, "megatron-core on CPU")."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from megatron_jreg import patches
from megatron_jreg.process_env import gpu_signs

log = logging.getLogger(__name__)

_applied = False
_device_rng = torch.Generator()  # stands in for the CUDA default generator


class _NullStream:
    """Enough of torch.cuda.Stream/Event for megatron's grad-sync and p2p code to run synchronously."""

    def _nothing(self, *args: Any, **kwargs: Any) -> None:
        pass

    __init__ = wait_stream = wait_event = record = synchronize = _nothing

    def record_event(self, *args: Any) -> _NullStream:
        return self

    def query(self) -> bool:
        return True


def _is_cuda_device(device: Any) -> bool:
    return (isinstance(device, torch.device) and device.type == "cuda") or (
        isinstance(device, str) and device.startswith("cuda"))


class _CudaToCpu(torch.overrides.TorchFunctionMode):
    """Sends tensors asked for on "cuda" to the CPU; a mode is not active in autograd's backward, so the
    one factory run there (the causal mask rebuilt by recomputation) is replaced instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda") else name
        if _is_cuda_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and args and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


# The signatures of megatron-core's _get/_set_cuda_rng_state (patches.py checks a wrapper against them).
def _get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return _device_rng.get_state()


def _set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    _device_rng.set_state(new_state)


def _seed(seed: int) -> None:
    _device_rng.manual_seed(int(seed))


def _tracker_add(self, name: str, seed: int) -> None:  # noqa: ANN001 - megatron's CudaRNGStatesTracker
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    self.seeds_.add(seed)
    self.states_[name] = torch.Generator().manual_seed(seed).get_state()


def _causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _value(value: Any) -> Callable[[Any], Any]:
    """A maker (megatron_jreg.patches) that replaces the original by `value`."""
    return lambda _original: value


# What apply_cpu_compat replaces: targets of megatron_jreg.patches.PATCHES (why and until are there).
_CPU_PATCHES = {
    "torch.cuda.current_device": _value(lambda: torch.device("cpu")),
    "torch.cuda.synchronize": _value(lambda *a, **k: None),
    "torch.cuda.current_stream": _value(lambda *a, **k: _NullStream()),
    "torch.cuda.default_stream": _value(lambda *a, **k: _NullStream()),
    "torch.cuda.Stream": _value(_NullStream),
    "torch.cuda.Event": _value(_NullStream),
    "torch.cuda.stream": _value(lambda *a, **k: contextlib.nullcontext()),
    "torch.cuda.manual_seed": _value(_seed),
    "torch.cuda.manual_seed_all": _value(_seed),
    "torch.cuda.get_rng_state": _value(lambda *a, **k: _device_rng.get_state()),
    "torch.cuda.set_rng_state": _value(lambda state, *a, **k: _device_rng.set_state(state)),
    "megatron.core.tensor_parallel.random._get_cuda_rng_state": _value(_get_state),
    "megatron.core.tensor_parallel.random._set_cuda_rng_state": _value(_set_state),
    "megatron.core.tensor_parallel.random.CudaRNGStatesTracker.add": _value(_tracker_add),
    "megatron.core.transformer.utils.get_default_causal_mask": _value(_causal_mask),
    "megatron.core.fusions.fused_softmax.get_default_causal_mask": _value(_causal_mask),
}


def _allow_no_cuda(initialize: Callable) -> Callable:
    """initialize_megatron with allow_no_cuda=True (pretrain() does not pass it)."""

    @functools.wraps(initialize)
    def initialize_megatron(*a: Any, **k: Any) -> Any:
        k["allow_no_cuda"] = True
        return initialize(*a, **k)

    return initialize_megatron


# What apply_cpu_training_compat adds.
_CPU_TRAINING_PATCHES = {
    "torch.cuda.device_count": _value(lambda: 1),
    "torch.cuda.set_device": _value(lambda *a, **k: None),
    "megatron.training.arguments.get_device_arch_version": _value(lambda: 9),
    "megatron.training.training.initialize_megatron": _allow_no_cuda,
}


_FORK_WARNING = "CPU RNG state changed within GPU RNG context"


def _not_fork_warning(record: logging.LogRecord) -> bool:
    """Drops megatron-core's warning of a CPU random draw inside `CudaRNGStatesTracker.fork`: on the CPU every draw
    there is one by design, so it fired 50-121 times a training log while saying nothing about the run."""
    return record.getMessage() != _FORK_WARNING


def apply_cpu_compat() -> bool:
    """megatron-core on CPU/gloo when CUDA is absent; True when active."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    patches.apply_process(_CPU_PATCHES)
    _CudaToCpu().__enter__()  # stays active for the life of the process
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_not_fork_warning)
    _applied = True
    log.info("CUDA not available: megatron-core runs on CPU (gloo) through megatron_jreg.compat")
    return True


def apply_cpu_training_compat(args: Any | None = None) -> bool:
    """`apply_cpu_compat()` plus what `megatron.training.pretrain` needs, `args` set to gloo without CUDA kernels."""
    if not apply_cpu_compat():
        return False
    patches.apply_process(_CPU_TRAINING_PATCHES)
    if args is not None:
        args.distributed_backend = "gloo"
        # Megatron-LM asks for it with TP/CP (CUDA kernel ordering); nothing to order on a CPU
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        for name in CUDA_KERNELS:
            setattr(args, name, False)
        args.no_persist_layer_norm = True
    return True


# Megatron-LM flags whose default is a CUDA/apex/TE kernel (each has a --no-… flag on GPUs).
CUDA_KERNELS = ("gradient_accumulation_fusion", "masked_softmax_fusion", "bias_gelu_fusion", "bias_swiglu_fusion",
                "bias_dropout_fusion", "apply_rope_fusion")


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def dist_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


# cuInit's answers worth naming (CUDA driver API, cuda.h)
_CU_ERRORS = {100: "the driver sees no CUDA device (CUDA_ERROR_NO_DEVICE)",
              35: "the driver is older than the CUDA runtime (CUDA_ERROR_INSUFFICIENT_DRIVER)",
              803: "the driver and its user-space library differ (CUDA_ERROR_SYSTEM_DRIVER_MISMATCH)",
              804: "forward compatibility is not supported on this GPU (CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE)",
              999: "unknown CUDA error (often a driver that needs a reboot after an update, or no /dev/nvidia-uvm)"}


def driver_report(lib: Any, built: str) -> str:
    """What the CUDA driver library `lib` (libcuda.so.1) says, against the CUDA version torch is built for."""
    version = ctypes.c_int(0)
    found = lib.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value
    driver = f"{version.value // 1000}.{version.value % 1000 // 10}" if found else None
    if driver is not None and int(driver.split(".")[0]) < int(built.split(".")[0]):
        return (f"the NVIDIA driver supports CUDA {driver} but torch is built for CUDA {built}: update the driver, or "
                f"install a torch built for CUDA {driver.split('.')[0]}.x")
    rc = lib.cuInit(0)
    why = "cuInit succeeded, yet torch found no device" if rc == 0 else _CU_ERRORS.get(rc, f"cuInit error {rc}")
    return f"{why}; driver supports CUDA {driver or 'unknown'}, torch is built for CUDA {built}"


def cuda_diagnosis() -> str:
    """Why torch sees no usable GPU, as far as can be told without CUDA."""
    built = torch.version.cuda
    if built is None:
        return f"torch {torch.__version__} is a CPU-only build"
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return (f"no NVIDIA driver library (libcuda.so.1) loads: no driver here, or a container started without GPU "
                f"access (docker --gpus, enroot/pyxis); torch {torch.__version__} is built for CUDA {built}")
    return driver_report(lib, built)


def cpu_training_refusal(environ: Mapping[str, str] | None = None, dev: Path = Path("/dev")) -> str | None:
    """The line that stops a CPU run where a GPU is expected (`gpu_signs`); None where the CPU is what there is."""
    signs = gpu_signs(environ, dev)
    if not signs:
        return None
    return (f"this run expects a GPU ({'; '.join(signs)}) but CUDA is not usable: {cuda_diagnosis()}; stopping "
            "rather than training on the CPU (add --allow-cpu to train on the CPU on purpose)")
