"""paramserver.plumbing.heap: freed C heap memory goes back to the OS (glibc)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import glibc_linux

from paramserver.plumbing import heap


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@glibc_linux
def test_trim_returns_freed_heap_memory_that_free_alone_keeps():
    # 48 MiB in 64 KiB pieces (under malloc's mmap threshold: they live in the
    # heap), then one piece kept above them so free() cannot shrink the heap's top
    pieces = [b"x" * (64 << 10) for _ in range(768)]
    pin = b"y" * (64 << 10)
    del pieces
    held = rss_bytes()
    assert heap.trim() is True
    assert held - rss_bytes() >= 24 << 20  # most of the 48 MiB went back
    assert pin[:1] == b"y"


# A thread takes a burst of 64 frames of 65 KiB (an island's client I/O thread copying
# the re-sends of a cut link's unacked pushes) after the process freed an 8 MiB mapped
# buffer (glibc then raises its trim threshold to 16 MiB), and frees them all: they join
# its arena's free top. Prints the RSS (bytes) after `heap.trim` alone and after
# `heap.trim_thread_top`, both called on that thread. In a child process:
# `trim_thread_top` sets the process's trim threshold.
_BURST = """
import ctypes, json, os, threading
from pathlib import Path
from paramserver.plumbing import heap

def rss():
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(8 << 20))
out = {}

def burst():
    frames = [bytes(bytearray(65 << 10)) for _ in range(64)]
    out["held"] = rss()
    del frames
    heap.trim()
    out["trimmed"] = rss()
    out["ran"] = heap.trim_thread_top()
    out["top_trimmed"] = rss()

thread = threading.Thread(target=burst)
thread.start()
thread.join()
print(json.dumps(out))
"""


@glibc_linux
def test_trim_thread_top_returns_what_a_threads_freed_burst_left_and_trim_keeps():
    done = subprocess.run(
        [sys.executable, "-c", _BURST], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["ran"] is True
    burst = 64 * (65 << 10)
    # malloc_trim leaves the free top of the thread's arena mapped and resident ...
    assert out["held"] - out["trimmed"] < burst // 4
    # ... trim_thread_top gives it back
    assert out["trimmed"] - out["top_trimmed"] >= burst * 3 // 4
