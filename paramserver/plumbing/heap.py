"""The C heap of a long-lived process: hand freed memory back to the OS, fix malloc's thresholds.

glibc's malloc keeps what a process frees (the accept path's decoded frames,
ZeroMQ message buffers, a step's temporaries) in its arenas, one arena per
thread that ever allocated (ZeroMQ's I/O thread, XLA's and the codec's
workers), up to 8 per core; RSS then stays at its high-water mark. A shard
calls `trim` on its first quiet turn after a step, and the supervisor starts its shards
with `ARENA_ENV` (MALLOC_ARENA_MAX=2, read by glibc at startup); an island's
push thread calls `trim` after its jobs. All are no-ops off glibc.

An island daemon calls `steady` first thing, before any thread starts: it
fixes malloc's two moving thresholds. By default glibc maps blocks from 128 KiB
up on their own, and the first time such a block is freed it raises that
threshold (and the trim threshold, twice it) to the block's size, so where a
process's mid-sized buffers live, and how much of an arena's free top
`free` hands back, depend on the order of its frees: each process of a run
found its own levels, and a freed top of a step's scratch was handed back and
faulted in again the next step. Fixed, every process places its buffers under
32 MiB in its arenas from the start, keeps an arena's free top for reuse, and
hands back what is truly free only at `trim`. Cost: none measured on the train
step (docs/results.md); an arena cap was measured too and cost the step up to a
third, so the arenas stay one per thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable, Mapping

ARENA_ENV = {"MALLOC_ARENA_MAX": "2"}  # a shard child's environment additions (glibc)

# mallopt(3) parameters (glibc's malloc.h) and an island's values for them, each with the
# environment variable that, when set, says the operator chose it instead
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
STEADY = (
    # a free top of an arena up to this stays mapped (glibc's default moves with the
    # largest freed block, so a step's scratch went back and came again)
    ("trim_threshold", _M_TRIM_THRESHOLD, 512 << 20, "MALLOC_TRIM_THRESHOLD_"),
    # blocks from this up are mapped on their own and unmapped when freed (glibc's own
    # ceiling for its moving threshold on 64-bit)
    ("mmap_threshold", _M_MMAP_THRESHOLD, 32 << 20, "MALLOC_MMAP_THRESHOLD_"),
)


@functools.cache
def _glibc(name: str, *argtypes: type) -> Callable[..., int] | None:
    """A glibc malloc function returning int, or None where the C library has none
    (musl, macOS, Windows)."""
    lib = ctypes.util.find_library("c")
    try:
        fn = getattr(ctypes.CDLL(lib), name) if lib else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
    return fn


def steady(environ: Mapping[str, str] = os.environ) -> dict[str, int]:
    """Fix a training process's malloc trim and mmap thresholds (glibc `mallopt`).

    Call it before the process's first large allocation (JAX, ZeroMQ): a threshold
    glibc has already moved is then overridden only from here on. A setting whose
    glibc environment variable is set is left to it.

    Args:
        environ: the environment to look for the operator's own settings in.

    Returns:
        {name: value} of the settings applied ({} off glibc).
    """
    fn = _glibc("mallopt", ctypes.c_int, ctypes.c_int)
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
    fn = _glibc("malloc_trim", ctypes.c_size_t)
    return bool(fn(0)) if fn is not None else False
