"""glibc malloc settings for the CPU path: keep step-sized buffers in the heap.

By default glibc serves an allocation above its mmap threshold (128 KiB, raised as such blocks
are freed, up to 32 MiB) with a fresh ``mmap`` and gives it back with ``munmap`` on free, and
it trims the heap's free top above 128 KiB. A CPU forward allocates and frees the same
multi-megabyte activations every layer of every step (a 2,048-token prefill's gate/up output is
25 MB), so the kernel faulted in and zeroed fresh pages for each: W1 float32 took 1.6 million
minor page faults and 3.3-3.5 s of system time. With the mmap threshold at its maximum (32 MiB) and
the trim threshold at 256 MiB those buffers are reused from the heap (0.6 million faults, the
model load's; W1 4-5% faster, ``docs/benchmarks.md``). vLLM's CPU guide gets the same effect by
preloading tcmalloc.

``VLITE_CPU_MALLOC=default`` leaves glibc's settings alone (for an A/B or another allocator).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

from vlite.env import env_choice

logger = logging.getLogger("vlite.engine")

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest allowed value (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD_BYTES = 256 << 20
CHOICES = ("tuned", "default")


def malloc_choice() -> str:
    """``VLITE_CPU_MALLOC`` ("tuned" when unset).

    Raises:
        ValueError: the variable holds something else than tuned or default.
    """
    return env_choice("VLITE_CPU_MALLOC", CHOICES, "tuned")


def tune_malloc() -> bool:
    """Set glibc's mmap and trim thresholds for this process (once; later calls do nothing).
    Returns whether the settings are in force: False with ``VLITE_CPU_MALLOC=default`` or
    where the C library has no ``mallopt`` (musl, macOS).

    Raises:
        ValueError: a bad ``VLITE_CPU_MALLOC``.
    """
    return malloc_choice() == "tuned" and _set_thresholds()


@functools.cache
def _set_thresholds() -> bool:
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        logger.info("malloc: no mallopt in this C library; allocator settings unchanged")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success, 0 for a value out of range
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1


__all__ = ["CHOICES", "malloc_choice", "tune_malloc"]
