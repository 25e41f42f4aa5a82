"""The reader that decodes: frames to a tree of arrays (`decode`).

It validates the header before allocating, reassembles and verifies the
payload, and dequantizes every tensor (in parallel pieces on the codec's
pool) into its original dtype and shape; whatever the input, it returns a
tree or raises CodecError. The format is specified in codec/format.py's
docstring; the readers that keep codes are `codec.coded`'s.
"""

import numpy as np

from .format import DEFAULT_MAX_ELEMENTS, DTYPES, LEVELS, CodecError, parse_header
from .parallel import check_threads, pool, run_all
from .payload import frame_views, gather
from .quant import decode_blocks, workspace
from .sparse import decode_topk
from .tree import build_tree, leaf_items

PIECE_ELEMENTS = 1 << 18  # elements per parallel dequantize job


def decode(frames, max_elements: int = DEFAULT_MAX_ELEMENTS, threads: int = 0, out=None) -> dict:
    """Decode frames written by any codec scheme.

    Args:
        frames: list of bytes-like (bytes, memoryview, zmq.Frame), header first.
        max_elements: refuse headers declaring more elements than this
            (checked before anything is allocated or decompressed).
        threads: decompress payload frames and dequantize on this many
            threads (0 or 1: the calling thread only).
        out: None, or a tree of the message's names holding writable
            C-contiguous arrays of each tensor's shape and encoded dtype, to
            decode into (reusing them saves writing fresh memory, the largest
            cost of decoding a big message after zstd). Checked against the
            header before anything is decompressed; on a CodecError raised
            later its arrays may hold part of the message.

    Returns:
        nested dict of arrays in their encoded dtype and shape (writable,
        C-contiguous): the arrays of `out`, or else views into one fresh
        buffer per message (one allocation, whose fresh pages cost far less
        than one per tensor), which lives as long as any of them does.
    """
    try:
        workers = pool(check_threads(threads))
        views = frame_views(frames)
        header = parse_header(views[0], len(views) - 1, max_elements)
        given = None if out is None else _given(header, out)
        # raw tensors are returned as views of the payload (without `out`); others only read it
        reuse = header.scheme != "raw" or given is not None
        payload = gather(views[1:], header.frames, header.zstd, header.total, workers, reuse)
        if given is not None:
            targets = [a.reshape(-1) for a in given]
        else:
            arena = None if header.scheme == "raw" else _Arena(header)
            targets = [None if arena is None else arena.take(t) for t in header.tensors]
        with np.errstate(all="ignore"):
            outs, jobs = [], []
            for t, dst in zip(header.tensors, targets, strict=True):
                leaf, more = _tensor(header, t, payload, dst)
                outs.append(leaf)
                jobs += more
            run_all(workers, run_job, jobs)
        outs = outs if given is None else given
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


def _given(header, out) -> list:
    """`out`'s arrays in header order, once each fits its tensor."""
    have = dict(leaf_items(out))
    want = [t.path for t in header.tensors]
    if set(have) != set(want):
        names = sorted("/".join(p) for p in set(have) ^ set(want))
        raise CodecError(
            f"out does not hold the message's tensors (differs at {', '.join(names[:5])}); "
            "pass a tree of the same names as the encoded one"
        )
    arrays = []
    for t in header.tensors:
        a, name, dtype = have[t.path], "/".join(t.path), DTYPES[t.dtype]
        if not isinstance(a, np.ndarray) or a.shape != t.shape or a.dtype != dtype:
            got = f"{getattr(a, 'shape', '?')} {getattr(a, 'dtype', type(a).__name__)}"
            raise CodecError(f"out {name!r} is {got}; the message holds {t.shape} {dtype}")
        if not (a.flags.writeable and a.flags.c_contiguous):
            raise CodecError(f"out {name!r} must be a writable C-contiguous array")
        arrays.append(a)
    return arrays


class _Arena:
    """One output buffer for every decoded (non-raw) tensor of a message."""

    ALIGN = 64

    def __init__(self, header):
        self._buf = np.empty(sum(self._span(t) for t in header.tensors), np.uint8)
        self._pos = 0

    def _span(self, t) -> int:
        return -(-t.size * DTYPES[t.dtype].itemsize // self.ALIGN) * self.ALIGN

    def take(self, t) -> np.ndarray:
        """The next tensor's 1-D output array (contents undefined)."""
        dtype = DTYPES[t.dtype]
        a = self._pos
        self._pos += self._span(t)
        return self._buf[a : a + t.size * dtype.itemsize].view(dtype)


def _tensor(header, t, payload: np.ndarray, out: np.ndarray | None) -> tuple:
    """A tensor's output array and the jobs that fill it (none when it is done).

    `out` is its 1-D destination, or None for a raw tensor returned as it comes
    (a view of the payload, or a cast of it).
    """
    dtype = DTYPES[t.dtype]
    if header.scheme == "raw":
        store = DTYPES[header.store]
        flat = _section(payload, t.offset, t.size, store)
        if out is not None:
            np.copyto(out, flat, casting="unsafe")
            return out.reshape(t.shape), []
        if store == dtype:
            return flat.reshape(t.shape), []  # zero-copy: a writable view of the payload
        return flat.astype(dtype).reshape(t.shape), []
    scales = _section(payload, t.scales_offset, t.blocks, np.float32)
    if t.blocks and not (np.isfinite(scales.max()) and scales.min() >= 0):
        raise CodecError(f"tensor {'/'.join(t.path)!r} has a non-finite or negative block scale")
    if header.scheme == "topk":
        section = payload[t.offset : t.offset + t.codes_bytes]
        try:
            decode_topk(section, scales, t, header.block, header.keep, header.bits, out)
        except ValueError as e:
            raise CodecError(f"tensor {'/'.join(t.path)!r}: {e}") from None
        return out.reshape(t.shape), []
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
    levels = LEVELS[scheme]
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
