"""The C heap of a long-lived process: hand freed memory back to the OS, cap malloc's arenas.

glibc's malloc keeps what a process frees (the accept path's decoded frames,
ZeroMQ message buffers, a step's temporaries) in its arenas, one arena per
thread that ever allocated (ZeroMQ's I/O thread, XLA's and the codec's
workers), up to 8 per core; RSS then stays at its high-water mark. A shard
calls `trim` on its first quiet turn after a step, and the supervisor starts its shards
with `ARENA_ENV` (MALLOC_ARENA_MAX=2, read by glibc at startup).

`trim` does not reach one place: the free top of a thread's own arena (what a
burst of that thread's allocations left once all of it was freed). glibc's
`malloc_trim` skips it, and `free` gives it back only once it exceeds the trim
threshold, which glibc raises as the process frees large buffers (to twice the
mmap threshold, up to 64 MiB). An island's client I/O thread copies each push
frame under 64 KiB into a ZeroMQ message (pyzmq's copy threshold; every push of
`tiny`), and re-sends every unacked delta while a link is cut: up to
`max_unacked` of them, about 4 MB, each longer cut leaving a higher free top that
the RSS kept. `trim_thread_top` gives a thread's top back; the client's I/O
thread and the island's push thread call it every `TRIM_EVERY_S`.

libzmq's own I/O thread runs none of our code; it allocates what it receives, and
a paused island's backlog (the updates its SUB missed, read at once on resume)
left a few MB as that arena's top. A block of another arena freed while the
threshold is 0 shrinks that arena's top: the client's I/O thread keeps its newest
received frames of 16 KiB to 1 MiB, 256 KiB of them (`RELEASE_MIN_BYTES`,
`RELEASE_MAX_BYTES`, `RELEASE_TOTAL_BYTES`), and hands them to `trim_thread_top` to
free. Both are no-ops off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Sequence
from typing import Any

ARENA_ENV = {"MALLOC_ARENA_MAX": "2"}  # a shard child's environment additions (glibc)
# a long-lived thread that trims (the island's push thread, the client's I/O thread) does
# so at most this often
TRIM_EVERY_S = 5.0
M_TRIM_THRESHOLD = -1  # mallopt's parameter number for the trim threshold (malloc.h)
# the received frames the client's I/O thread keeps for `trim_thread_top` to free: each
# over the 8 KiB of libzmq's receive batch (a larger message is a block of its own) and
# under 1 MiB, the newest that make `RELEASE_TOTAL_BYTES` (what it holds meanwhile). A
# freed block joins the free blocks around it; once they make 64 KiB, glibc tries to
# shrink the arena's top: several freed together (often allocated side by side) make it.
RELEASE_MIN_BYTES = 16 << 10
RELEASE_MAX_BYTES = 1 << 20
RELEASE_TOTAL_BYTES = 256 << 10
# the trim threshold `trim_thread_top` leaves set: glibc's own adjustment stops there
# (twice its 32 MiB ceiling for the mmap threshold)
KEPT_TRIM_THRESHOLD = 64 << 20
# what `trim_thread_top` allocates and frees: at least the 64 KiB whose free makes glibc
# try to shrink the arena's top, under the 128 KiB below which malloc never maps alone
_TRIM_PROBE = 96 << 10


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc with malloc_trim, mallopt, malloc and free typed, or None off glibc."""
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
        if lib is None or not hasattr(lib, "malloc_trim") or not hasattr(lib, "mallopt"):
            return None  # musl, macOS, Windows
    except OSError:
        return None
    lib.malloc_trim.argtypes, lib.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    lib.mallopt.argtypes, lib.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    lib.malloc.argtypes, lib.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    lib.free.argtypes, lib.free.restype = [ctypes.c_void_p], None
    return lib


def trim() -> bool:
    """Return the free memory of every malloc arena to the OS (glibc `malloc_trim(0)`).

    Returns:
        True when memory was released, False when none was or off glibc.
    """
    lib = _libc()
    return bool(lib.malloc_trim(0)) if lib is not None else False


def keep_for_release(kept: list[Any], frames: Sequence[Any]) -> None:
    """Add the frames of `RELEASE_MIN_BYTES` to `RELEASE_MAX_BYTES` to `kept`, then drop its
    oldest while the rest still make `RELEASE_TOTAL_BYTES`: for `trim_thread_top` to free.

    Args:
        kept: the frames kept so far (changed in place).
        frames: one received message's frames (anything with a length in bytes).
    """
    added = [f for f in frames if RELEASE_MIN_BYTES <= len(f) < RELEASE_MAX_BYTES]
    if not added:  # most messages (acks, heartbeats): nothing to count again
        return
    kept.extend(added)
    total = sum(len(f) for f in kept)
    while kept and total - len(kept[0]) >= RELEASE_TOTAL_BYTES:
        total -= len(kept.pop(0))


def trim_thread_top(release: list[Any] | None = None) -> bool:
    """Return the free top of the calling thread's malloc arena to the OS (glibc).

    Sets the trim threshold to 0, frees a block of this thread's arena (the free
    that makes glibc shrink the arena's top down to its pad), empties `release`,
    then sets the threshold to `KEPT_TRIM_THRESHOLD`. Setting it ends glibc's own
    adjustment of both thresholds for the process: the mmap threshold keeps the
    value it has reached. Another thread's large free in between may trim its
    arena too.

    Args:
        release: objects whose last references go while the threshold is 0. A block
            that another thread allocated (a ZeroMQ frame received with ``copy=False``:
            libzmq's I/O thread allocates it), freed then next to free blocks of 64 KiB
            or more, shrinks the top of that thread's arena, which no code of ours runs on.

    Returns:
        True when it ran, False off glibc.
    """
    lib = _libc()
    if lib is None:
        if release:
            release.clear()
        return False
    lib.mallopt(M_TRIM_THRESHOLD, 0)
    try:
        block = lib.malloc(_TRIM_PROBE)
        lib.free(block)
        if release:
            release.clear()
    finally:
        lib.mallopt(M_TRIM_THRESHOLD, KEPT_TRIM_THRESHOLD)
    return True
