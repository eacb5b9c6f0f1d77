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

`release_large_allocations()` is for a model too large to materialize whole (autopp.model.meta): the profiler then
materializes one unit at a time, and memory that a freed 2 GB embedding gradient leaves resident would add to the
next unit's. It serves allocations of 256 MiB and more with `mmap` again (a fixed threshold: glibc's heuristics stay
off), returned to the system when freed; smaller ones, all of a transformer block's weights up to Llama-3-8B's MLP
(235 MB), stay in the kept heap. And `return_freed_memory()` (glibc's `malloc_trim(0)`) hands the heap's free pages
back once a unit is freed, so the next unit starts from the process's own baseline; its warm-up runs take the page
faults, its timed runs reuse the pages. The cost: each new tensor of 256 MiB or more page-faults in (an embedding's
or LM head's gradient: about 0.1 s per GB here). Measured on a Llama-3.2-1B-shaped model (128k vocabulary, 1 GB
embedding and head, one unit at a time, `autopp profile --microbatch-size 1 --warmup 1 --repeats 2` under
`/usr/bin/time -v`): peak RSS 6.3 GiB with `keep_freed_memory()` alone, 3.5 GiB with glibc's defaults, 3.9 GiB
with both functions here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Callable

__all__ = ["keep_freed_memory", "release_large_allocations", "return_freed_memory", "LARGE_BYTES"]

# mallopt parameters from glibc's malloc.h.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -2, -3, -4
#: Allocations from this size on are mmapped again by `release_large_allocations`.
LARGE_BYTES = 256 << 20
_SETTINGS = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20))

_applied: str | None = None


def keep_freed_memory() -> str:
    """Apply the settings above once per process; returns what the allocator now does, for profiles and logs:
    "glibc: no mmap, no trim" or why nothing was changed (not Linux, not glibc, mallopt refused)."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _mallopt() -> Callable[[int, int], int] | str:
    """glibc's mallopt, or why it is not available."""
    if not sys.platform.startswith("linux"):
        return f"default ({sys.platform}: not glibc)"
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "default (no glibc mallopt)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt  # type: ignore[no-any-return]


def _apply() -> str:
    mallopt = _mallopt()
    if isinstance(mallopt, str):
        return mallopt
    refused = [param for param, value in _SETTINGS if mallopt(param, value) != 1]
    if refused:
        return f"default (mallopt refused parameters {refused})"
    return "glibc: no mmap, no trim"


def release_large_allocations(threshold: int = LARGE_BYTES) -> str:
    """Serve allocations of `threshold` bytes and more with mmap again (module docstring), after or instead of
    `keep_freed_memory()`; returns what the allocator now does."""
    kept = keep_freed_memory()
    mallopt = _mallopt()
    if isinstance(mallopt, str):
        return mallopt
    if mallopt(_M_MMAP_THRESHOLD, threshold) != 1 or mallopt(_M_MMAP_MAX, 65536) != 1:
        return f"{kept} (mallopt refused the mmap threshold)"
    return f"glibc: no trim, mmap from {threshold >> 20} MiB"


def return_freed_memory() -> bool:
    """Return the heap's free pages to the system (glibc `malloc_trim(0)`); whether anything was returned."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))
