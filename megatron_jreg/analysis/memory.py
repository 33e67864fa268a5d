"""Peak memory of a block of work: what `analyze` reports per model, and what the benchmarks compare.

On the CPU, the kernel's resident-set high-water mark (VmHWM in /proc/self/status), reset to the
current resident set through /proc/self/clear_refs when the block starts: it counts everything the
process touched (weights, activations, allocator caches), which is what decides whether a model fits.
On CUDA, the caching allocator's `max_memory_allocated`. Where neither is available (not Linux) the
peak is None.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")


def _status_bytes(field: str) -> int | None:
    try:
        match = re.search(rf"{field}:\s+(\d+) kB", _STATUS.read_text())
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


class PeakMemory:
    """`with PeakMemory(device) as m: ...` → m.peak (bytes at the high point, the process's whole
    resident set on the CPU or allocated GPU memory), m.above (bytes above the level at entry)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.peak: int | None = None
        self.above: int | None = None
        self._base: int | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            try:
                Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            except OSError:
                pass
            self._base = _status_bytes("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self.peak = _status_bytes("VmHWM")
        if self.peak is not None and self._base is not None:
            self.above = self.peak - self._base


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD = 1 << 20


def return_large_blocks_to_the_os(threshold: int = MMAP_THRESHOLD) -> bool:
    """Make glibc serve every allocation of `threshold` bytes or more with its own mmap, so freeing it
    gives the memory back to the OS at once. True when set (glibc), False elsewhere.

    Why: glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), after
    which blocks of that size come from the heap, where freed ones stay in the resident set. Layer
    streaming frees a layer's weights and the activations of every batch over and over; without a
    fixed threshold the resident set creeps up by most of a layer per layer on models whose tensors
    are under 32 MiB, and the peak stops meaning "one layer". Fixing it is process-wide, and costs a
    system call per large allocation, which is small next to the matrix products those blocks feed.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False
