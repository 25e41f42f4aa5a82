"""Decoding: frames (any scheme) back to a tree of arrays.

Owns the reading side: validate the header against everything declared
before allocating, reassemble and verify the payload, reconstruct every
tensor in its original dtype and shape. Whatever the input, it returns a tree
or raises CodecError.
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import format as fmt
from .compress import gather
from .errors import CodecError
from .quant import decode_blocks
from .tree import build_tree
from .workspace import workspace


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
        threads: decompress payload frames on this many threads (0: caller's).

    Returns:
        nested dict of arrays in their encoded dtype and shape (writable,
        C-contiguous).
    """
    try:
        views = _views(frames)
        header = fmt.parse_header(views[0], len(views) - 1, max_elements)
        pool = _pool(threads) if threads else None
        # raw tensors are returned as views of the payload; quantized ones only read it
        reuse = header.scheme != "raw"
        payload = gather(views[1:], header.frames, header.zstd, header.total, pool, reuse)
        with np.errstate(all="ignore"):
            leaves = [(t.path, _tensor(header, t, payload)) for t in header.tensors]
        return build_tree(leaves)
    except CodecError:
        raise
    except Exception as e:  # safety net: decode must only ever raise CodecError
        raise CodecError(f"malformed frames ({type(e).__name__}: {e})") from None


_pools: dict = {}
_pools_lock = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    """A shared decompression pool per thread count."""
    if not isinstance(threads, int) or not 0 < threads <= 64:
        raise CodecError(f"threads must be an int in [0, 64], got {threads!r}")
    with _pools_lock:
        if threads not in _pools:
            _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="codec-unzstd")
        return _pools[threads]


def _section(payload: np.ndarray, offset: int, count: int, dtype) -> np.ndarray:
    return payload[offset : offset + count * np.dtype(dtype).itemsize].view(dtype)


def _tensor(header, t, payload: np.ndarray) -> np.ndarray:
    dtype = fmt.DTYPES[t.dtype]
    if header.scheme == "raw":
        store = fmt.DTYPES[header.store]
        flat = _section(payload, t.offset, t.size, store)
        if store == dtype:
            return flat.reshape(t.shape)  # zero-copy: a writable view of the payload
        return flat.astype(dtype).reshape(t.shape)
    levels = fmt.LEVELS[header.scheme]
    scales = _section(payload, t.scales_offset, t.blocks, np.float32)
    if t.blocks and not (np.isfinite(scales.max()) and scales.min() >= 0):
        raise CodecError(f"tensor {'/'.join(t.path)!r} has a non-finite or negative block scale")
    code_type = np.uint8 if levels == 7 else np.int8
    codes = _section(payload, t.offset, t.codes_bytes, code_type)
    out = np.empty(t.size, dtype)
    decode_blocks(codes, scales, out, levels, workspace(header.block))
    return out.reshape(t.shape)
