"""Giving freed memory back to the operating system: glibc keeps what Python frees in its heap
(`malloc_trim` returns it), so a daemon that refused a large stream would otherwise stay as large
as the stream made it. A no-op where the C library has no `malloc_trim` (macOS, musl)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["return_freed_memory"]


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def return_freed_memory() -> None:
    """Return the free parts of the C heap to the system (a few ms); nothing if not possible."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
