"""paramserver.plumbing.heap: malloc_trim gives freed heap memory back to the OS (glibc)."""

from __future__ import annotations

import os
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
