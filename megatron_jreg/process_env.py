"""Process settings that must be in place before torch loads (libgomp and torch's allocator read them at import),
so each entry point calls these first. Torch-free, the lowest layer; why each: DEVELOPERS.md, "Settings made before
torch loads"."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path

_SLURM_GPU = re.compile(r"SLURM_(?:JOB_|STEP_)?GPUS(?:_[A-Z_]+)?")  # SLURM_JOB_GPUS, SLURM_GPUS_ON_NODE, ...
_SLURM_TRES = ("SLURM_TRES_PER_TASK", "SLURM_JOB_GRES", "SLURM_STEP_GRES")  # "cpu=8,gres/gpu=1", "gpu:8"
_NOT_A_GPU = ("", "0", "none", "void", "NoDevFiles")  # values that allocate no GPU


def _gres_gpus(value: str) -> int:
    """GPUs a Slurm GRES/TRES value allocates: "gpu:8", "gpu:a100:2(IDX:0-1)", "cpu=8,gres/gpu=1",
    "gres/gpu:h100=2" (an entry without a count is one GPU; "gpu:0" is none)."""
    total = 0
    for entry in value.split(","):
        entry = entry.split("(")[0].strip().removeprefix("gres/").removeprefix("gres:")
        name, _, count = entry.partition("=")
        if name.split(":")[0] != "gpu":
            continue
        parts = name.split(":")
        count = count or (parts[-1] if len(parts) > 1 and parts[-1].isdigit() else "1")
        total += int(count) if count.isdigit() else 1
    return total


def _int(environ: Mapping[str, str], key: str) -> int:
    try:
        return int(environ.get(key, ""))
    except ValueError:
        return 0


def gpu_signs(environ: Mapping[str, str] | None = None, dev: Path = Path("/dev")) -> list[str]:
    """What says this run expects a GPU (device nodes, CUDA_VISIBLE_DEVICES even empty, a GPU container, a Slurm GPU
    allocation, ranks on several nodes). Empty: no sign of a GPU, where CPU training is what the user has."""
    env = os.environ if environ is None else environ
    signs = []
    nodes = sorted(p.name for p in dev.glob("nvidia*")) if dev.is_dir() else []
    if nodes:
        shown = ", ".join(str(dev / n) for n in nodes[:2]) + (", ..." if nodes[2:] else "")
        signs.append(f"NVIDIA device nodes ({shown})")
    if "CUDA_VISIBLE_DEVICES" in env:
        signs.append(f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}")
    if env.get("NVIDIA_VISIBLE_DEVICES", "") not in _NOT_A_GPU:
        signs.append(f"NVIDIA_VISIBLE_DEVICES={env['NVIDIA_VISIBLE_DEVICES']} (a GPU container)")
    # SLURM_JOB_GPUS / SLURM_STEP_GPUS list GPU indices ("0" is GPU 0); the others count ("0", "h100:0": none)
    slurm = [k for k in sorted(env) if _SLURM_GPU.fullmatch(k) and env[k] and (
        k in ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS") or not re.fullmatch(r"(?:\w+:)?0", env[k]))]
    slurm += [k for k in _SLURM_TRES if _gres_gpus(env.get(k, ""))]
    if slurm:
        signs.append("a Slurm GPU allocation (" + ", ".join(f"{k}={env[k]}" for k in slurm[:2]) + ")")
    world, local = _int(env, "WORLD_SIZE"), _int(env, "LOCAL_WORLD_SIZE")
    spread = [(k, env[k]) for k in ("GROUP_WORLD_SIZE", "NNODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
              if _int(env, k) > 1]
    if local and world > local:
        spread.append(("WORLD_SIZE/LOCAL_WORLD_SIZE", f"{world}/{local}"))
    if spread:
        signs.append("ranks on several nodes (" + ", ".join(f"{k}={v}" for k, v in spread[:2]) + ")")
    return signs


def sleep_while_waiting() -> None:
    """OMP_WAIT_POLICY=PASSIVE unless the environment chooses a wait; a no-op once torch is loaded (read then)."""
    if "torch" not in sys.modules and "GOMP_SPINCOUNT" not in os.environ:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def huge_pages_for_cpu_training(environ: Mapping[str, str] | None = None) -> bool:
    """THP_MEM_ALLOC_ENABLE=1 for CPU training (no `gpu_signs`) unless set or torch is loaded; True when set here."""
    env = os.environ if environ is None else environ
    if "torch" in sys.modules or "THP_MEM_ALLOC_ENABLE" in env or gpu_signs(env):
        return False
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    return True
