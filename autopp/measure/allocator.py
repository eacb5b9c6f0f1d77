"""Keep the C allocator's freed memory in the process, so that the profiler and the runner time the same thing.

On Linux, glibc serves allocations above a threshold (128 KiB at start, moved up by its own heuristics) with a
fresh `mmap` and unmaps them when freed, and trims free memory at the top of the heap. Each such tensor then
page-faults in anew on first touch: on examples/mlp.py at microbatch 2 (weights of 4-8 MiB whose gradients are
allocated on every backward), one forward and backward took 9-10 ms in a fresh process and 14-21 ms in the same
process once `torch.distributed.pipelining.pipeline` had split the model (364 vs 1,760-2,850 minor page faults per
step), because the heuristics had moved with what the split allocated. The measured time of a unit then depends on
what ran before in the process, and the profiler's process and a pipeline rank differ in exactly that.

`keep_freed_memory()` turns those heuristics off with `mallopt`: no `mmap` for allocations (M_MMAP_MAX = 0), no
trimming below 1 GiB free (M_TRIM_THRESHOLD) and 64 MiB of padding when the heap grows (M_TOP_PAD). The same step
then took 11 ms both before and after the split (~200-450 faults per step). The cost is memory that stays with the
process after tensors are freed (it is reused by the next allocations, not returned to the system). This is the
glibc counterpart of running PyTorch on CPU with jemalloc or tcmalloc, which PyTorch's CPU performance guide
recommends for the same reason.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["keep_freed_memory"]

# mallopt parameters from glibc's malloc.h.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
_SETTINGS = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20))

_applied: str | None = None


def keep_freed_memory() -> str:
    """Apply the settings above once per process; returns what the allocator now does, for profiles and logs:
    "glibc: no mmap, no trim" or why nothing was changed (not Linux, not glibc, mallopt refused)."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> str:
    if not sys.platform.startswith("linux"):
        return f"default ({sys.platform}: not glibc)"
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "default (no glibc mallopt)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    refused = [param for param, value in _SETTINGS if mallopt(param, value) != 1]
    if refused:
        return f"default (mallopt refused parameters {refused})"
    return "glibc: no mmap, no trim"
