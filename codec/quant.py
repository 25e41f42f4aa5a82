"""The block quantizer's entry points and its numpy formulation.

The int8/int4 block-absmax rule is `codec.quant_rule`'s; it is computed three
ways, bit for bit alike (a test compares them on awkward inputs):

- numpy (`encode_numpy`, `decode_numpy`, here): 64K-element chunks with `out=`
  on every operation, no allocation in the loop.
- numba (`compiled_loops`, built on first use from `codec.quant_numba`: it
  imports numba and compiles its loops, cached on disk).
- JAX (`jax_rule`, built on first use from `codec.quant_jax`: it imports JAX),
  traceable functions for callers that quantize inside `jax.jit`.

Nothing imports numba or JAX when this module is imported: `import codec`
stays cheap and never loads JAX. Round-to-nearest encode and every decode run
the compiled loops (inputs and outputs other than contiguous float32 go
through a float32 chunk of the workspace) for pieces of at least
COMPILED_MIN_ELEMENTS. Smaller pieces, stochastic rounding (bound by its
random numbers) and everything where numba cannot be imported run the numpy
formulation. A process that only codes small tensors (tests, the tiny model,
the shard's 64K-element merge pieces) thus never pays for importing numba;
decoding gains little from it (about 10%).

Beside the rule, what its kernels run on: the scratch buffers (`Workspace`,
one set per thread and block size, so no kernel allocates in its inner loop)
and the raw schemes' kernel (`encode_raw`: the cast to float32 or bfloat16,
its residual and finiteness check).
"""

from __future__ import annotations

import functools
import threading
from types import SimpleNamespace

import ml_dtypes
import numpy as np

from .quant_jax import build_jax_rule
from .quant_numba import compile_loops
from .quant_rule import F32, NIBBLE_BIAS, TINY, max_factor, step_factor

# pieces below this run the numpy kernels: loading the compiled ones costs a process about
# 0.5 s (numba's import and cache), which only pieces of this size or more repay (it is
# also decode's piece, codec.readers.PIECE_ELEMENTS)
COMPILED_MIN_ELEMENTS = 1 << 18


@functools.cache
def _loops() -> SimpleNamespace | None:
    """`compiled_loops`, or None where numba cannot be imported (numpy then does it all)."""
    try:
        return compile_loops()  # imports numba: only once a block codec runs
    except ImportError:
        return None


def encode_blocks(x, res, new_res, codes, scales, levels, ws: Workspace, rng=None) -> None:
    """Quantize `x` (+ `res`) block by block.

    Args:
        x: 1-D float32/float16/bfloat16 input, n elements.
        res: 1-D float32 error-feedback residual (n) or None.
        new_res: 1-D float32 output for the new residual (n) or None.
        codes: int8 [n] (levels 127) or uint8 [ceil(n/2)] (levels 7) output.
        scales: float32 [ceil(n/block)] output block absmax values.
        levels: 127 or 7.
        ws: workspace of the block size.
        rng: numpy Generator for stochastic rounding, or None for nearest.
    """
    loops = _loops() if rng is None and x.shape[0] >= COMPILED_MIN_ELEMENTS else None
    if loops is None:
        encode_numpy(x, res, new_res, codes, scales, levels, ws, rng)
    else:
        encode_compiled(loops, x, res, new_res, codes, scales, levels, ws)


def encode_compiled(loops, x, res, new_res, codes, scales, levels, ws: Workspace) -> None:
    """encode_blocks (round to nearest) with the compiled loops.

    Args:
        loops: `compiled_loops`.
        x, res, new_res, codes, scales, levels, ws: as for `encode_blocks`.
    """
    quantize = loops.quantize
    consts = (ws.block, levels, TINY, max_factor(levels), step_factor(levels))
    none = ws.blk_a[:0]
    if _plain(x):
        quantize(x, _or(res, none), _or(new_res, none), codes, scales, ws.tmp, *consts)
        return
    per = 2 if levels == 7 else 1
    for a in range(0, x.shape[0], ws.chunk):
        b = min(a + ws.chunk, x.shape[0])
        src = ws.work[: b - a]
        np.copyto(src, x[a:b], casting="unsafe")
        r = none if res is None else res[a:b]
        nr = none if new_res is None else new_res[a:b]
        cd = codes[a // per : -(-b // per)]
        quantize(src, r, nr, cd, scales[a // ws.block : -(-b // ws.block)], ws.tmp, *consts)


def _plain(a: np.ndarray) -> bool:
    return a.dtype == np.float32 and a.flags.c_contiguous


def _or(a, none):
    return none if a is None else a


def encode_numpy(x, res, new_res, codes, scales, levels, ws: Workspace, rng=None) -> None:
    """encode_blocks in numpy; stochastic rounding (rng) is floor(x * L / m + U[0, 1)) in +-L.

    Args:
        x, res, new_res, codes, scales, levels, ws, rng: as for `encode_blocks`.
    """
    n, block, chunk = x.shape[0], ws.block, ws.chunk
    packed = levels == 7
    inv_max = max_factor(levels)
    step = step_factor(levels)
    direct_ok = res is None and x.dtype == np.float32
    for a in range(0, n, chunk):
        m = min(chunk, n - a)
        nbk = -(-m // block)
        mb = nbk * block
        if direct_ok and m == mb:
            src = x[a : a + m]
        else:
            src = ws.tmp[:mb]
            np.copyto(src[:m], x[a : a + m], casting="unsafe")
            if res is not None:
                np.add(src[:m], res[a : a + m], out=src[:m])
            if mb > m:
                src[m:] = 0
        v = src.reshape(nbk, block)
        sc = scales[a // block : a // block + nbk]
        inv = ws.blk_c[:nbk]
        w = ws.work[:mb].reshape(nbk, block)
        # one abs pass and one row reduction beat separate max and min reductions
        np.abs(v, out=w)
        np.maximum.reduce(w, axis=1, out=sc)
        if sc.min() < TINY:
            sc[sc < TINY] = 0
            with np.errstate(divide="ignore"):  # an all-zero block: inf, clipped just below
                np.divide(F32(levels), sc, out=inv)
        else:
            np.divide(F32(levels), sc, out=inv)
        np.minimum(inv, inv_max, out=inv)
        np.multiply(v, inv[:, None], out=w)
        if rng is None:
            np.rint(w, out=w)
        else:
            noise = ws.noise[:mb]
            rng.random(out=noise, dtype=np.float32)
            np.add(w, noise.reshape(nbk, block), out=w)
            np.floor(w, out=w)
            np.minimum(w, F32(levels), out=w)
            np.maximum(w, F32(-levels), out=w)
        if packed:
            q = ws.q[:mb]
            np.copyto(q, ws.work[:mb], casting="unsafe")
            qu = q.view(np.uint8)
            np.add(qu, np.uint8(NIBBLE_BIAS), out=qu)
            hi = qu[1::2]
            np.left_shift(hi, np.uint8(4), out=hi)
            half = (m + 1) // 2
            np.bitwise_or(qu[0::2][:half], hi[:half], out=codes[a // 2 : a // 2 + half])
        else:
            np.copyto(codes[a : a + m], ws.work[:m], casting="unsafe")
        if new_res is not None:
            np.multiply(sc, step, out=inv)
            np.multiply(w, inv[:, None], out=w)
            np.subtract(src[:m], ws.work[:m], out=new_res[a : a + m])


def decode_blocks(codes, scales, out, levels, ws: Workspace) -> None:
    """Reconstruct values from codes and block absmax values.

    Args:
        codes: int8 [n] (levels 127) or uint8 [ceil(n/2)] (levels 7).
        scales: float32 [ceil(n/block)].
        out: 1-D output of n elements (contiguous float32 written directly,
            anything else through a float32 chunk and a cast).
        levels: 127 or 7.
        ws: workspace of the block size.
    """
    loops = _loops() if out.shape[0] >= COMPILED_MIN_ELEMENTS else None
    if loops is None:
        decode_numpy(codes, scales, out, levels, ws)
        return
    dequantize = loops.dequantize
    step = step_factor(levels)
    if _plain(out):
        dequantize(codes, scales, out, ws.block, levels, step)
        return
    per = 2 if levels == 7 else 1
    for a in range(0, out.shape[0], ws.chunk):
        b = min(a + ws.chunk, out.shape[0])
        dst = ws.tmp[: b - a]
        cd = codes[a // per : -(-b // per)]
        dequantize(cd, scales[a // ws.block : -(-b // ws.block)], dst, ws.block, levels, step)
        np.copyto(out[a:b], dst, casting="unsafe")


def decode_numpy(codes, scales, out, levels, ws: Workspace) -> None:
    """decode_blocks in numpy.

    Args:
        codes, scales, out, levels, ws: as for `decode_blocks`.
    """
    n, block, chunk = out.shape[0], ws.block, ws.chunk
    packed = levels == 7
    direct = out.dtype == np.float32
    step = step_factor(levels)
    for a in range(0, n, chunk):
        m = min(chunk, n - a)
        k = m // block
        nbk = -(-m // block)
        if packed:
            w = ws.work[:m]
            half = (m + 1) // 2
            b = codes[a // 2 : a // 2 + half]
            qu = ws.q[: 2 * half].view(np.uint8)
            np.bitwise_and(b, np.uint8(15), out=qu[0::2])
            np.right_shift(b, np.uint8(4), out=qu[1::2])
            np.subtract(qu[:m], F32(NIBBLE_BIAS), out=w)
        st = ws.blk_a[:nbk]
        np.multiply(scales[a // block : a // block + nbk], step, out=st)
        dst = out[a : a + m] if direct else ws.tmp[:m]
        if not packed:
            # int8 -> float32 is exact; a plain cast then a float32 multiply in
            # place runs ~2x faster than numpy's mixed-type broadcast multiply
            np.copyto(dst, codes[a : a + m], casting="unsafe")
            w = dst
        kb = k * block
        if k:
            np.multiply(w[:kb].reshape(k, block), st[:k, None], out=dst[:kb].reshape(k, block))
        if kb < m:
            np.multiply(w[kb:], st[k], out=dst[kb:])
        if not direct:
            np.copyto(out[a : a + m], dst, casting="unsafe")


def sum_squares_int8(codes, scales, lo: int, hi: int, block: int) -> float:
    """Sum of the squares of the decoded elements [lo, hi) of an int8 tensor, without decoding it.

    Per block b, ``st_b**2 * sum_i q_i**2`` in float64, st_b = ``m_b *
    step_factor(127)`` in float32 (the decoder's step) and the squared codes
    summed exactly as integers; the blocks' terms are added in block order.
    A decoded value is ``q * st_b`` rounded to float32, so the result differs
    from the sum over decoded values by at most 2**-23 relative. The compiled
    loop (`compiled_loops.sum_squares_int8`) and the numpy formulation give the
    same bits on any host (no reassociated float sum).

    Args:
        codes: int8 codes of the whole tensor.
        scales: its float32 block absmax values.
        lo, hi: the range, 0 <= lo <= hi <= len(codes).
        block: elements per block.

    Returns:
        The float64 sum (inf for a huge finite tensor).
    """
    step = step_factor(127)
    loops = _loops() if hi - lo >= COMPILED_MIN_ELEMENTS else None
    with np.errstate(over="ignore"):
        if loops is None:
            return sum_squares_int8_numpy(codes, scales, lo, hi, block, step)
        return float(loops.sum_squares_int8(codes, scales, lo, hi, block, step))


def sum_squares_float32(values: np.ndarray) -> float:
    """Sum of the squares of 1-D float32 values in float64 (a raw tensor's L2 norm squared).

    The compiled loop (`compiled_loops.sum_squares_f32`, a fixed order of
    additions) for at least COMPILED_MIN_ELEMENTS contiguous values; else
    float64 dot products of 64K-element pieces.

    Args:
        values: float32 [n].

    Returns:
        The float64 sum.
    """
    loops = _loops() if values.shape[0] >= COMPILED_MIN_ELEMENTS else None
    if loops is not None and values.flags.c_contiguous:
        return float(loops.sum_squares_f32(values))
    piece = 1 << 16
    wide = np.empty(min(piece, values.shape[0]), np.float64)
    total = 0.0
    for a in range(0, values.shape[0], piece):
        w = wide[: min(piece, values.shape[0] - a)]
        np.copyto(w, values[a : a + piece])
        total += float(np.dot(w, w))
    return total


def sum_squares_int8_numpy(codes, scales, lo: int, hi: int, block: int, step) -> float:
    """sum_squares_int8 in numpy (chunks of whole blocks; integer sums per block).

    Args:
        codes, scales, lo, hi, block: as for `sum_squares_int8`.
        step: float32 ``1 / 127``.

    Returns:
        The float64 sum.
    """
    if hi <= lo:
        return 0.0
    first, last = lo // block, (hi - 1) // block + 1
    whole = np.zeros(last - first, np.int64)
    chunk = max(block, (CHUNK_TARGET // block) * block)
    squares = np.empty(min(chunk, hi - lo), np.int32)
    a = lo
    while a < hi:
        e = min(hi, (a // chunk + 1) * chunk)  # chunks of whole blocks: none spans two
        sq = squares[: e - a]
        np.multiply(codes[a:e], codes[a:e], out=sq, dtype=np.int32)
        cuts = np.arange((a // block + 1) * block, e, block) - a
        sums = np.add.reduceat(sq, np.concatenate(([0], cuts)), dtype=np.int64)
        j = a // block - first
        whole[j : j + sums.shape[0]] += sums
        a = e
    st = (scales[first:last] * step).astype(np.float64)  # float32 product, as the decoder's
    terms = whole.astype(np.float64) * (st * st)
    return float(np.add.accumulate(terms)[-1])  # in block order, as the compiled loop


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


BF16_MAX = np.float32(ml_dtypes.finfo(ml_dtypes.bfloat16).max)


def encode_raw(x, res, new_res, out, ws: Workspace) -> bool:
    """Copy `x` (+ `res`) into `out`, casting to its dtype.

    Args:
        x: 1-D float32/float16/bfloat16 input.
        res: 1-D float32 residual or None.
        new_res: 1-D float32 output residual or None.
        out: 1-D output in the stored dtype (float32 or bfloat16).
        ws: workspace (block size 1).

    Returns:
        True when every value written is finite.
    """
    n, chunk = x.shape[0], ws.chunk
    exact = out.dtype == np.float32
    finite = True
    for a in range(0, n, chunk):
        m = min(chunk, n - a)
        if res is None and x.dtype == np.float32:
            src = x[a : a + m]
        else:
            src = ws.tmp[:m]
            np.copyto(src, x[a : a + m], casting="unsafe")
            if res is not None:
                np.add(src, res[a : a + m], out=src)
        hi, lo = src.max(), src.min()
        finite = finite and bool(np.isfinite(hi) and np.isfinite(lo))
        stored = src
        if not exact and (hi > BF16_MAX or lo < -BF16_MAX):
            # would round to +-inf in bfloat16: saturate; the residual keeps the rest
            stored = ws.noise[:m]
            np.clip(src, -BF16_MAX, BF16_MAX, out=stored)
        np.copyto(out[a : a + m], stored, casting="unsafe")
        if new_res is not None:
            if exact:
                new_res[a : a + m] = 0
            else:
                back = ws.work[:m]
                np.copyto(back, out[a : a + m], casting="unsafe")
                np.subtract(src, back, out=new_res[a : a + m])
    return finite


def __getattr__(name: str) -> SimpleNamespace:
    """The formulations built on first use: `compiled_loops` (numba) and `jax_rule` (JAX).

    `from codec.quant import compiled_loops` imports numba and `from codec.quant
    import jax_rule` imports JAX; importing this module imports neither.

    Raises:
        ImportError: numba (for `compiled_loops`) or JAX (for `jax_rule`) cannot be imported.
        AttributeError: any other name.
    """
    if name == "compiled_loops":
        return compile_loops()
    if name == "jax_rule":
        return build_jax_rule()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
