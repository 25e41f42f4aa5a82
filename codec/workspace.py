"""Reusable scratch buffers for the chunked kernels.

Owns the chunk size rule and one set of buffers per (thread, block size), so
that kernels never allocate in their inner loop (fresh memory is ~3x slower
to write than memory that was touched before).
"""

import threading

import numpy as np

CHUNK_TARGET = 1 << 17  # large enough that threads rarely wait for the GIL

_local = threading.local()


class Workspace:
    """Scratch arrays for one chunk of `chunk` elements.

    Attributes:
        chunk: elements per chunk (a multiple of `block`).
        tmp, work, noise: float32 [chunk] scratch.
        q: int8 [chunk] scratch (int4 packing and unpacking).
        blk_a, blk_b, blk_c: float32 [chunk // block] per-block scratch.
    """

    def __init__(self, block: int):
        self.block = block
        self.chunk = max(block, (CHUNK_TARGET // block) * block)
        nb = self.chunk // block
        self.tmp = np.empty(self.chunk, np.float32)
        self.work = np.empty(self.chunk, np.float32)
        self.noise = np.empty(self.chunk, np.float32)
        self.q = np.empty(self.chunk, np.int8)
        self.blk_a = np.empty(nb, np.float32)
        self.blk_b = np.empty(nb, np.float32)
        self.blk_c = np.empty(nb, np.float32)


def workspace(block: int) -> Workspace:
    """This thread's workspace for a block size.

    Args:
        block: block size in elements (1 for raw kernels).

    Returns:
        a Workspace, created on first use and reused after.
    """
    cache = getattr(_local, "cache", None)
    if cache is None:
        cache = _local.cache = {}
    ws = cache.get(block)
    if ws is None:
        ws = cache[block] = Workspace(block)
    return ws


def scratch(name: str, n: int, dtype) -> np.ndarray:
    """This thread's scratch array `name` of at least n elements (first n returned).

    Args:
        name: buffer name (one buffer per name and thread, grown as needed).
        n: elements needed.
        dtype: element type (a name keeps one dtype).

    Returns:
        array view of n elements (contents undefined).
    """
    bufs = getattr(_local, "scratch", None)
    if bufs is None:
        bufs = _local.scratch = {}
    buf = bufs.get(name)
    if buf is None or buf.shape[0] < n or buf.dtype != dtype:
        buf = bufs[name] = np.empty(max(n, 1), dtype)
    return buf[:n]
