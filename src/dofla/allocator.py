"""glibc's allocator, tuned for PyTorch's large CPU temporaries (the ``dofla`` commands and benchmarks).

PyTorch allocates CPU tensors with ``malloc``. glibc serves every block above its mmap threshold (128
KiB at first) with a fresh ``mmap`` and returns it with ``munmap`` when freed, so each of the
megabyte-sized temporaries of a chunked attention form or an MLP is page-faulted in again, every layer,
every call. Its dynamic threshold only partly adapts, and setting just ``MALLOC_TRIM_THRESHOLD_`` switches
the adaptation off (worse). :func:`tune_allocator` sets the mmap threshold to glibc's largest allowed
value (32 MiB) and keeps up to :data:`TRIM_THRESHOLD` bytes of freed memory at the top of the heap, so
freed blocks are reused instead of faulted in again; the cost is that much memory kept after a peak.

It changes the whole process, so the library never calls it on import: the ``dofla`` command line and
the benchmarks do (both the teacher and the students of a benchmark run under it). It leaves the
allocator alone where the user chose one: with ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``
set, another allocator preloaded (``LD_PRELOAD``), ``DOFLA_ALLOCATOR=default``, or not on glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc refuses more on 64-bit systems (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1024 * 1024 * 1024
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD")


def user_chose_allocator(environment=os.environ) -> str | None:
    """The setting by which the user chose the allocator's behaviour, or None."""
    if environment.get("DOFLA_ALLOCATOR", "").strip().lower() == "default":
        return "DOFLA_ALLOCATOR=default"
    for name in USER_SETTINGS:
        if environment.get(name, "").strip():
            return name
    return None


def tune_allocator(environment=os.environ) -> bool:
    """Set glibc's mmap and trim thresholds for this process (module docstring); True if it did."""
    if not sys.platform.startswith("linux") or user_chose_allocator(environment):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # glibc returns 1 on success; another C library may lack the parameters and return 0
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
