"""The C heap of a long-lived process: hand freed memory back to the OS, cap malloc's arenas.

glibc's malloc keeps what a process frees (the accept path's decoded frames,
ZeroMQ message buffers, a step's temporaries) in its arenas, one arena per
thread that ever allocated (ZeroMQ's I/O thread, XLA's and the codec's
workers), up to 8 per core; RSS then stays at its high-water mark. A shard
calls `trim` on its first quiet turn after a step, and the supervisor starts its shards
with `ARENA_ENV` (MALLOC_ARENA_MAX=2, read by glibc at startup). Both are
no-ops off glibc.

An island daemon calls `steady` first thing, before any thread starts. Its
train step frees and takes back ~16 MB of XLA scratch per inner step (`tiny`),
on whichever XLA thread runs it: with an arena per thread, several arenas each
kept a copy, and with glibc's moving thresholds each arena gave its top back
and took it again; RSS sat at one of several levels 16 MB apart for minutes at
a time (issue 37's soak). One arena and fixed thresholds keep the scratch in
one place, mapped, and reused: RSS holds its working set, and the push
thread's periodic `trim` still hands back what is truly free.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Mapping

ARENA_ENV = {"MALLOC_ARENA_MAX": "2"}  # a shard child's environment additions (glibc)

# mallopt(3) parameters (glibc's malloc.h) and an island's values for them, each with the
# environment variable that, when set, says the operator chose it instead
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
STEADY = (
    ("arena_max", _M_ARENA_MAX, 1, "MALLOC_ARENA_MAX"),
    # a free top of an arena up to this stays mapped (glibc's default moves with the
    # largest freed block, so a step's scratch went back and came again)
    ("trim_threshold", _M_TRIM_THRESHOLD, 512 << 20, "MALLOC_TRIM_THRESHOLD_"),
    # blocks from this up are mapped on their own and unmapped when freed (glibc's own
    # ceiling for its moving threshold on 64-bit)
    ("mmap_threshold", _M_MMAP_THRESHOLD, 32 << 20, "MALLOC_MMAP_THRESHOLD_"),
)


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


@functools.cache
def _mallopt():
    """glibc's mallopt, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn


def steady(environ: Mapping[str, str] = os.environ) -> dict[str, int]:
    """Keep a training process's C heap in one arena at fixed thresholds (glibc `mallopt`).

    Call it before the process starts threads (XLA's, ZeroMQ's): an arena cap binds only
    arenas created after it. A setting whose glibc environment variable is set is left
    to it.

    Args:
        environ: the environment to look for the operator's own settings in.

    Returns:
        {name: value} of the settings applied ({} off glibc).
    """
    fn = _mallopt()
    if fn is None:
        return {}
    return {
        name: value for name, param, value, env in STEADY if env not in environ and fn(param, value)
    }


def trim() -> bool:
    """Return the free memory of every malloc arena to the OS (glibc `malloc_trim(0)`).

    Returns:
        True when memory was released, False when none was or off glibc.
    """
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False
