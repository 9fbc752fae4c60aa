"""Host memory for CPU runs: keep what malloc frees for reuse instead of returning it.

A zero-bubble schedule keeps each micro-batch's autograd graph alive from B to W, so more
memory is live at once, and glibc's malloc gives large freed blocks back to the kernel (mmap
and trim thresholds). Every step then faults the same pages in again: on the project's CPU
machine B + W cost 1.25x one full backward with glibc's defaults and 1.10x with freed memory
kept (`benchmarks/bench_split_backward.py`). PyTorch's CUDA allocator keeps freed memory for
the same reason; this does it for the host heap, through `mallopt`.

Only on glibc, and never over a setting of the user's: any of the MALLOC_MMAP_THRESHOLD_,
MALLOC_TRIM_THRESHOLD_ or MALLOC_TOP_PAD_ environment variables leaves malloc alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["keep_freed_memory", "USER_SETTINGS"]

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD = 32 * 2**20    # glibc's largest: blocks below it come from the heap
_TRIM_THRESHOLD = 2**30         # the heap's free top is kept up to this
_TOP_PAD = 64 * 2**20           # the heap grows in steps of at least this
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Make this process's malloc keep freed memory for reuse (once; later calls only say
    whether it did). False where that is not possible (not glibc) or the user set malloc's
    own environment variables."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    if not sys.platform.startswith("linux") or any(v in os.environ for v in USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):     # musl and others have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD),
        (_M_TOP_PAD, _TOP_PAD)))
