"""Sparse top-k kernels: per chunk, the entries of largest magnitude at 2 or 4 bits.

Owns the arithmetic of the ``topk`` scheme (layout in codec/format.py): per
chunk of ``chunk`` elements keep the ``k`` of largest magnitude, store their
chunk-local offsets as gaps (two byte planes, which zstd squeezes well) and
their values as sign + level codes against the chunk absmax ``m``:
``j = min(floor(|x| * L / m), L - 1)``, decoded ``(2j + 1) * (m / 2L)``. Encode
and decode use the same float32 operations, so the error-feedback residual
(everything not sent, including the quantization error of what was sent) is
exact with respect to what any decoder reconstructs.

Selection is vectorised over a 2-D (chunks, chunk) view: an in-place
``np.partition`` of the magnitudes finds each chunk's k-th largest value, a
mask picks the entries at or above it, and only chunks with ties at that value
(e.g. all-zero chunks) take a second, still vectorised, pass.
"""

import numpy as np

from .quant import scratch
from .quant_rule import TINY

F32 = np.float32
ENCODE_PIECE = 1 << 18  # elements per parallel piece (whole chunks)


def piece_elements(chunk: int) -> int:
    """Elements per encode piece: whole chunks, a multiple of 4 chunks.

    A multiple of 4 chunks keeps each piece's packed value codes byte-aligned
    (4 x keep codes of 2 bits fill whole bytes).

    Args:
        chunk: chunk size.

    Returns:
        piece length in elements.
    """
    chunks = max(4, (ENCODE_PIECE // chunk) // 4 * 4)
    return chunks * chunk


def _groups(n: int, chunk: int, keep: int) -> list:
    """(start, rows, width, k) of the full chunks and of a short last chunk."""
    full, rem = divmod(n, chunk)
    out = []
    if full:
        out.append((0, full, chunk, keep))
    if rem:
        out.append((full * chunk, 1, rem, -(-keep * rem // chunk)))
    return out


def _select(mag: np.ndarray, work: np.ndarray, k: int):
    """Sorted positions of the k largest entries of each row, and row maxima.

    Args:
        mag: (rows, width) float32 magnitudes (not modified).
        work: (rows, width) float32 scratch (overwritten).
        k: entries per row, 1 <= k <= width.

    Returns:
        (flat positions into mag, sorted, k per row; row maxima), or None when
        a row maximum is not finite.
    """
    rows, width = mag.shape
    np.copyto(work, mag)
    work.partition(width - k, axis=1)
    top = work[:, width - k :]
    scale = top.max(axis=1)
    if not np.isfinite(scale.max()):
        return None
    scale[scale < TINY] = 0
    thr = work[:, width - k].copy()
    mask = scratch("topk_mask", rows * width, np.bool_).reshape(rows, width)
    np.greater_equal(mag, thr[:, None], out=mask)
    counts = np.count_nonzero(mask, axis=1)
    bad = np.flatnonzero(counts != k)
    if bad.shape[0]:  # ties at the threshold: keep those above it, then the first ties
        sub, t = mag[bad], thr[bad][:, None]
        above = sub > t
        ties = sub == t
        need = k - np.count_nonzero(above, axis=1)
        rank = np.cumsum(ties, axis=1)
        mask[bad] = above | (ties & (rank <= need[:, None]))
    return np.flatnonzero(mask), scale


def _levels(bits: int) -> int:
    return 1 << (bits - 1)


def _values(j: np.ndarray, neg: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Decoded float32 values of level codes; step[i] is entry i's m / 2L."""
    val = j.astype(F32)
    np.multiply(val, F32(2), out=val)
    np.add(val, F32(1), out=val)
    np.multiply(val, step, out=val)
    np.negative(val, out=val, where=neg)
    return val


def encode_topk(x, res, new_res, lo, hi, codes, scales, chunk, keep, bits, ef_decay=1.0) -> bool:
    """Select, quantize and write one piece (whole chunks from a chunk boundary).

    Args:
        x: 1-D float32/float16/bfloat16 input of the piece.
        res: float32 residual of the piece, or None; the piece encodes
            ``x + ef_decay * res`` (float32; with ef_decay 1 no multiply).
        new_res: float32 output residual of the piece, or None.
        lo, hi: uint8 outputs, the offset-gap byte planes of the piece's entries.
        codes: uint8 output, the piece's packed value codes.
        scales: float32 output, one absmax per chunk of the piece.
        chunk, keep, bits: scheme settings.
        ef_decay: factor on the old residual before it joins the input, in (0, 1].

    Returns:
        True when every chunk absmax is finite (nothing is usable otherwise).
    """
    n = x.shape[0]
    if res is None and x.dtype == np.float32:
        src = x
    else:
        src = scratch("topk_src", n, F32)
        np.copyto(src, x, casting="unsafe")
        if res is not None and ef_decay != 1.0:
            kept = scratch("topk_mag", n, F32)  # free until the magnitudes below
            np.multiply(res, F32(ef_decay), out=kept)
            np.add(src, kept, out=src)
        elif res is not None:
            np.add(src, res, out=src)
    mag = scratch("topk_mag", n, F32)
    np.abs(src, out=mag)
    work = scratch("topk_work", n, F32)
    picks, gaps, row_scale = [], [], []
    for start, rows, width, k in _groups(n, chunk, keep):
        span = slice(start, start + rows * width)
        got = _select(mag[span].reshape(rows, width), work[span].reshape(rows, width), k)
        if got is None:
            return False
        flat, scale = got
        cols = flat.reshape(rows, k) - (np.arange(rows) * width)[:, None]
        gap = np.empty_like(cols)
        gap[:, 0] = cols[:, 0]
        np.subtract(cols[:, 1:], cols[:, :-1], out=gap[:, 1:])
        gap[:, 1:] -= 1
        picks.append(flat + start)
        gaps.append(gap.ravel())
        row_scale.append(np.repeat(scale, k))
        scales[start // chunk : start // chunk + rows] = scale
    if not picks:
        return True
    pos = np.concatenate(picks)
    gap = np.concatenate(gaps)
    np.copyto(lo, gap, casting="unsafe")
    np.right_shift(gap, 8, out=gap)
    np.copyto(hi, gap, casting="unsafe")
    m = np.concatenate(row_scale)
    levels = _levels(bits)
    v = src[pos]
    a = np.abs(v)
    inv = np.divide(F32(levels), m, out=np.full_like(m, F32(levels / float(TINY))), where=m > 0)
    np.multiply(a, inv, out=a)
    np.floor(a, out=a)
    np.minimum(a, F32(levels - 1), out=a)
    j = a.astype(np.uint8)
    neg = np.signbit(v)
    code = j | (neg.astype(np.uint8) << np.uint8(bits - 1))
    _pack(code, bits, codes)
    if new_res is not None:
        np.copyto(new_res, src)
        new_res[pos] = v - _values(j, neg, m * F32(1 / (2 * levels)))
    return True


def _pack(code: np.ndarray, bits: int, out: np.ndarray) -> None:
    per = 8 // bits
    pad = np.zeros(-(-code.shape[0] // per) * per, np.uint8)
    pad[: code.shape[0]] = code
    grid = pad.reshape(-1, per)
    packed = grid[:, 0].copy()
    for i in range(1, per):
        packed |= grid[:, i] << np.uint8(bits * i)
    out[:] = packed


def _unpack(data: np.ndarray, bits: int, count: int) -> np.ndarray:
    per = 8 // bits
    grid = np.empty((data.shape[0], per), np.uint8)
    mask = np.uint8((1 << bits) - 1)
    for i in range(per):
        np.bitwise_and(data >> np.uint8(bits * i), mask, out=grid[:, i])
    return grid.ravel()[:count]


def decode_topk(section: np.ndarray, scales: np.ndarray, t, chunk, keep, bits, out) -> None:
    """Dense values of one topk tensor section.

    Args:
        section: uint8 codes part of the section (2K offset bytes, then codes).
        scales: float32 chunk absmax values (already checked finite, >= 0).
        t: the TensorLayout (size, kept).
        chunk, keep, bits: scheme settings from the header.
        out: 1-D output of t.size elements (float32 written directly, other
            dtypes get the float32 values cast); raises ValueError on an
            offset outside its chunk.
    """
    out[:] = 0
    if not t.kept:
        return
    pos, values = topk_entries(section, scales, t, chunk, keep, bits)
    out[pos] = values


def topk_entries(section: np.ndarray, scales: np.ndarray, t, chunk, keep, bits) -> tuple:
    """The listed entries of one topk tensor section: positions and float32 values.

    Args:
        section: uint8 codes part of the section (2K offset bytes, then codes).
        scales: float32 chunk absmax values (already checked finite, >= 0).
        t: the TensorLayout (size, kept).
        chunk, keep, bits: scheme settings from the header.

    Returns:
        (int64 positions in the tensor, ascending; their float32 values); raises
        ValueError on an offset outside its chunk. Every other element is 0.
    """
    n, kept = t.size, t.kept
    gap = section[kept : 2 * kept].astype(np.int64)
    np.left_shift(gap, 8, out=gap)
    np.bitwise_or(gap, section[:kept], out=gap)
    gap += 1
    code = _unpack(section[2 * kept :], bits, kept)
    levels = _levels(bits)
    step = np.empty(kept, F32)
    pos = np.empty(kept, np.int64)
    at = 0
    for start, rows, width, k in _groups(n, chunk, keep):
        g = gap[at : at + rows * k].reshape(rows, k)
        off = np.cumsum(g, axis=1)
        if off[:, -1].max() > width:
            raise ValueError(f"a topk offset lies outside its chunk of {width} elements")
        off += (np.arange(rows) * width + start - 1)[:, None]
        pos[at : at + rows * k] = off.ravel()
        sc = scales[start // chunk : start // chunk + rows] * F32(1 / (2 * levels))
        step[at : at + rows * k] = np.repeat(sc, k)
        at += rows * k
    j = code & np.uint8(levels - 1)
    neg = (code >> np.uint8(bits - 1)).astype(np.bool_)
    return pos, _values(j, neg, step)
