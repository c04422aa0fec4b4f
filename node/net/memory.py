"""The C heap of a process that moves messages: freed message buffers are kept for the next message
(`reuse_message_buffers`), and given back to the operating system after a refused stream
(`return_freed_memory`). No-ops where the C library is not glibc (macOS, musl)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["return_freed_memory", "reuse_message_buffers"]

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD_MAX = 32 << 20  # the largest glibc accepts on 64-bit
TRIM_THRESHOLD = 256 << 20


@functools.cache
def _libc_function(symbol: str):
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), symbol) if name else None
    except (OSError, AttributeError):
        return None


def reuse_message_buffers() -> bool:
    """Keep freed buffers of up to 32 MiB in the heap, and up to 256 MiB of free heap, instead of
    giving them back to the system at once. Without it glibc maps each frame (1 MiB) and each
    reassembled envelope afresh and faults every page in again: serializing a 64 MiB message's
    frames took 35 ms instead of 4 (docs/benchmarks-log.md, "The host path's heap"). True if set."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def return_freed_memory() -> None:
    """Return the free parts of the C heap to the system (a few ms); nothing if not possible."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)
