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


# A paused island's backlog: 24 updates of 260 KiB, then 96 messages of 12 KiB, that
# libzmq's I/O thread read at once into a SUB's queue (its arena), received with
# copy=False as the client's I/O thread does, under the thresholds an island runs with
# (`trim_thread_top` fixed the trim threshold after glibc had raised the mmap threshold).
# argv[1]: "held" (frames kept by `heap.keep_for_release` and handed to
# `trim_thread_top`, as `IOThread` does) or "dropped" (every frame goes before the
# trims). Prints the RSS (KiB) above the start with the backlog read and after the
# trims, and the backlog's size. (Updates of 28 KiB, a `tiny` island's, went back with
# `trim` alone here: the backlog ended below live blocks, not in the arena's top.)
_BACKLOG = """
import ctypes, json, os, sys, time
from pathlib import Path
import zmq
from paramserver.plumbing import heap

def rss():
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

libc = ctypes.CDLL(None)
libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: as high as glibc raises it
libc.mallopt(-1, heap.KEPT_TRIM_THRESHOLD)  # M_TRIM_THRESHOLD
ctx = zmq.Context()
pub = ctx.socket(zmq.PUB)
port = pub.bind_to_random_port("tcp://127.0.0.1")
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(f"tcp://127.0.0.1:{port}")
sizes = [260 << 10] * 24 + [12 << 10] * 96
deadline = time.monotonic() + 30
while not sub.poll(10):  # the subscription has arrived once a probe gets through
    pub.send(b"probe")
    assert time.monotonic() < deadline
while sub.poll(100):
    sub.recv()
start = rss()
for size in sizes:
    pub.send(b"x" * size)
while rss() - start < sum(sizes) * 3 // 4:
    time.sleep(0.01)  # libzmq's I/O thread reads it all into the SUB's queue
    assert time.monotonic() < deadline
time.sleep(0.2)
held = rss()
release = []
for _ in sizes:
    frame = sub.recv(copy=False)
    if sys.argv[1] == "held":
        heap.keep_for_release(release, [frame])
del frame
heap.trim()
heap.trim_thread_top(release)
print(json.dumps({"held": (held - start) >> 10, "trimmed": (rss() - start) >> 10,
                  "backlog": sum(sizes) >> 10}))
"""


@glibc_linux
def test_received_frames_freed_in_the_trim_return_the_backlog_libzmqs_thread_read():
    out = {}
    for mode in ("held", "dropped"):
        done = subprocess.run(
            [sys.executable, "-c", _BACKLOG, mode], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        out[mode] = json.loads(done.stdout)
    backlog = out["held"]["backlog"]
    assert out["held"]["held"] >= backlog * 3 // 4, out  # libzmq's thread read it all
    # the frames freed in the trim: libzmq's arena's top shrank, the small messages read
    # after them (~1.1 MiB) included
    assert out["held"]["trimmed"] < backlog // 16, out
    # the control: all freed outside the trim, the backlog stays as that arena's free top
    assert out["dropped"]["trimmed"] >= backlog // 4, out


def test_keep_for_release_keeps_the_newest_mid_sized_frames_that_make_its_total():
    kept: list[bytes] = []
    small, mid, big = b"s" * (8 << 10), b"m" * (100 << 10), b"b" * (2 << 20)
    heap.keep_for_release(kept, [small, big])
    assert kept == []  # under 16 KiB: inside libzmq's batch; 1 MiB and up: held too long
    for _ in range(3):
        heap.keep_for_release(kept, [small, mid])
    assert kept == [mid, mid, mid]  # 300 KiB: without the oldest, under 256 KiB
    heap.keep_for_release(kept, [mid])
    assert kept == [mid, mid, mid]  # the oldest went: the other three still make 300
