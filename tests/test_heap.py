"""paramserver.plumbing.heap: malloc_trim gives freed memory back; `steady` keeps a freed scratch mapped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
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


# One thread takes a step's scratch six times over: 16 MiB in 60 KiB pieces (under
# glibc's default mmap threshold: kept in the heap), all freed after each turn, so they
# end as the heap's free top. Prints the page faults of turns 2-6, then the bytes a
# 24 MiB buffer added to the blocks malloc maps on their own (mallinfo2's hblkhd).
SCRATCH = """
import ctypes, resource, sys
from paramserver.plumbing import heap
if sys.argv[1] == "steady":
    print(heap.steady({}), file=sys.stderr)
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def turn():
    scratch = [bytearray(60 << 10) for _ in range(273)]
    del scratch
turn()
before = faults()
for _ in range(5):
    turn()
print(faults() - before)
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
mapped = libc.mallinfo2().hblkhd
buffer = bytearray(24 << 20)
print(libc.mallinfo2().hblkhd - mapped)
"""


def scratch_run(mode: str) -> tuple[int, int]:
    """(page faults of five more turns, bytes a 24 MiB buffer mapped) in a fresh process."""
    done = subprocess.run(
        [sys.executable, "-c", SCRATCH, mode],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    faults, mapped = done.stdout.split()[-2:]
    return int(faults), int(mapped)


@glibc_linux
@pytest.mark.timeout(120)
def test_steady_keeps_a_freed_scratch_mapped_and_mid_sized_buffers_in_the_heap():
    steady_faults, steady_mapped = scratch_run("steady")
    default_faults, default_mapped = scratch_run("default")
    page_turns = 5 * (16 << 20) // 4096
    # fixed trim threshold: the freed scratch stays mapped, the next turns reuse it
    assert steady_faults < page_turns // 10, (steady_faults, page_turns)
    # the control (the case falls without `steady`): glibc hands the free top back
    # after each turn and the next one faults it in again
    assert default_faults > page_turns // 2, (default_faults, page_turns)
    # fixed mmap threshold (32 MiB): a 24 MiB buffer lives in the heap; by default it
    # is mapped on its own
    assert steady_mapped == 0
    assert default_mapped >= 24 << 20


@glibc_linux
@pytest.mark.timeout(60)
def test_steady_leaves_a_setting_the_environment_makes_to_it():
    code = "from paramserver.plumbing import heap; print(sorted(heap.steady({'MALLOC_TRIM_THRESHOLD_': '4096'})))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split("\n")[0] == "['mmap_threshold']"
