"""Decoding: frames (any scheme) back to a tree of arrays.

Owns the reading side: validate the header against everything declared
before allocating, reassemble and verify the payload, reconstruct every
tensor in its original dtype and shape. Whatever the input, it returns a tree
or raises CodecError.
"""

import numpy as np

from . import format as fmt
from . import parallel
from .compress import gather
from .errors import CodecError
from .quant import decode_blocks
from .sparse import decode_topk
from .tree import build_tree
from .workspace import workspace

PIECE_ELEMENTS = 1 << 18  # elements per parallel dequantize job


def _views(frames) -> list:
    if isinstance(frames, bytes | bytearray | memoryview | str) or not hasattr(frames, "__len__"):
        raise CodecError("frames must be a list of bytes-like objects")
    if len(frames) == 0:
        raise CodecError("no frames: a codec message has at least its header frame")
    views = []
    for i, f in enumerate(frames):
        try:
            v = memoryview(f)
            views.append(v if v.format == "B" and v.ndim == 1 else v.cast("B"))
        except TypeError:
            raise CodecError(f"frame {i} is not bytes-like ({type(f).__name__})") from None
    return views


def decode(frames, max_elements: int = fmt.DEFAULT_MAX_ELEMENTS, threads: int = 0) -> dict:
    """Decode frames written by any codec scheme.

    Args:
        frames: list of bytes-like (bytes, memoryview, zmq.Frame), header first.
        max_elements: refuse headers declaring more elements than this
            (checked before anything is allocated or decompressed).
        threads: decompress payload frames and dequantize on this many
            threads (0 or 1: the calling thread only).

    Returns:
        nested dict of arrays in their encoded dtype and shape (writable,
        C-contiguous). The arrays of one message are views into one buffer
        (one allocation, whose fresh pages cost far less than one per
        tensor), which lives as long as any of them does.
    """
    try:
        pool = parallel.pool(parallel.check_threads(threads))
        views = _views(frames)
        header = fmt.parse_header(views[0], len(views) - 1, max_elements)
        # raw tensors are returned as views of the payload; quantized ones only read it
        reuse = header.scheme != "raw"
        payload = gather(views[1:], header.frames, header.zstd, header.total, pool, reuse)
        with np.errstate(all="ignore"):
            outs, jobs = [], []
            arena = _Arena(header)
            for t in header.tensors:
                out, more = _tensor(header, t, payload, arena)
                outs.append(out)
                jobs += more
            parallel.run_all(pool, run_job, jobs)
        return build_tree([(t.path, o) for t, o in zip(header.tensors, outs, strict=True)])
    except CodecError:
        raise
    except Exception as e:  # safety net: decode must only ever raise CodecError
        raise CodecError(f"malformed frames ({type(e).__name__}: {e})") from None


def _section(payload: np.ndarray, offset: int, count: int, dtype) -> np.ndarray:
    return payload[offset : offset + count * np.dtype(dtype).itemsize].view(dtype)


def run_job(fn, *args) -> None:
    """Run one decode job (numpy warnings off: the checks raise CodecError instead)."""
    with np.errstate(all="ignore"):  # thread-local: set in the thread that computes
        fn(*args)


class _Arena:
    """One output buffer for every decoded (non-raw) tensor of a message."""

    ALIGN = 64

    def __init__(self, header):
        sizes = [] if header.scheme == "raw" else [self._span(t) for t in header.tensors]
        self._buf = np.empty(sum(sizes), np.uint8)
        self._pos = 0

    def _span(self, t) -> int:
        return -(-t.size * fmt.DTYPES[t.dtype].itemsize // self.ALIGN) * self.ALIGN

    def take(self, t) -> np.ndarray:
        """The next tensor's 1-D output array (contents undefined)."""
        dtype = fmt.DTYPES[t.dtype]
        a = self._pos
        self._pos += self._span(t)
        return self._buf[a : a + t.size * dtype.itemsize].view(dtype)


def _tensor(header, t, payload: np.ndarray, arena: _Arena) -> tuple:
    """A tensor's output array and the jobs that fill it (none when it is done)."""
    dtype = fmt.DTYPES[t.dtype]
    if header.scheme == "raw":
        store = fmt.DTYPES[header.store]
        flat = _section(payload, t.offset, t.size, store)
        if store == dtype:
            return flat.reshape(t.shape), []  # zero-copy: a writable view of the payload
        return flat.astype(dtype).reshape(t.shape), []
    scales = _section(payload, t.scales_offset, t.blocks, np.float32)
    if t.blocks and not (np.isfinite(scales.max()) and scales.min() >= 0):
        raise CodecError(f"tensor {'/'.join(t.path)!r} has a non-finite or negative block scale")
    if header.scheme == "topk":
        section = payload[t.offset : t.offset + t.codes_bytes]
        out = arena.take(t)
        try:
            decode_topk(section, scales, t, header.block, header.keep, header.bits, out)
        except ValueError as e:
            raise CodecError(f"tensor {'/'.join(t.path)!r}: {e}") from None
        return out.reshape(t.shape), []
    out = arena.take(t)
    return out.reshape(t.shape), block_jobs(t, payload, scales, out, header.scheme, header.block)


def block_jobs(t, payload: np.ndarray, scales: np.ndarray, out: np.ndarray, scheme: str, bs: int):
    """The jobs that dequantize one block-scheme tensor of an uncompressed payload into `out`.

    Args:
        t: the tensor's layout (`codec.format`).
        payload: the message's uncompressed payload (uint8).
        scales: the tensor's block scales (float32).
        out: its 1-D output array.
        scheme: "int8" or "int4".
        bs: the block size.

    Returns:
        (function, *args) jobs, each filling one piece of `out` (run them with `run_job`).
    """
    levels = fmt.LEVELS[scheme]
    code_type = np.uint8 if levels == 7 else np.int8
    codes = _section(payload, t.offset, t.codes_bytes, code_type)
    step = 2 if levels == 7 else 1
    piece = max(bs, (PIECE_ELEMENTS // bs) * bs)
    return [
        (_dequantize, codes[a // step : -(-b // step)], scales[a // bs : -(-b // bs)], out[a:b],
         levels, bs)
        for a in range(0, t.size, piece)
        for b in [min(a + piece, t.size)]
    ]  # fmt: skip


def _dequantize(codes, scales, out, levels, block) -> None:
    decode_blocks(codes, scales, out, levels, workspace(block))
