"""The C heap of a long-lived process: hand freed memory back to the OS, cap malloc's arenas.

glibc's malloc keeps what a process frees (the accept path's decoded frames,
ZeroMQ message buffers, a step's temporaries) in its arenas, one arena per
thread that ever allocated (ZeroMQ's I/O thread, XLA's and the codec's
workers), up to 8 per core; RSS then stays at its high-water mark. A shard
calls `trim` on its first quiet turn after a step, and the supervisor starts its shards
with `ARENA_ENV` (MALLOC_ARENA_MAX=2, read by glibc at startup). Both are
no-ops off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

ARENA_ENV = {"MALLOC_ARENA_MAX": "2"}  # a shard child's environment additions (glibc)


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def trim() -> bool:
    """Return the free memory of every malloc arena to the OS (glibc `malloc_trim(0)`).

    Returns:
        True when memory was released, False when none was or off glibc.
    """
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False
