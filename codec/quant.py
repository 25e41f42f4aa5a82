"""The int8/int4 block-absmax rule (its one definition) and its three formulations: numpy, numba, JAX.

Owns the arithmetic of the quantized schemes: per block of `block` elements,
``m = max(|x|)``, ``q = round(x * min(L / m, L / TINY))`` (half to even) with
L = 127 (int8) or 7 (int4; two codes a byte, element 2i in the low nibble,
each nibble ``q + NIBBLE_BIAS``, an odd count's last high nibble coding 0),
decoded ``q * (m * float32(1/L))``. Encode and decode use the very same float32
operations, never a fused multiply-add, so an encoder's error-feedback residual
``x - decoded`` is exact with respect to what any decoder reconstructs. Blocks
with ``m`` below TINY are flushed to 0 (their step would be subnormal).

One concept, the block quantizer, in one module: the constants of the rule
(`TINY`, `step_factor`, `max_factor`, `NIBBLE_BIAS`) and three formulations
that compute it, bit for bit alike (a test compares them on awkward inputs).
It is longer than 700 lines because the three change together whenever the
rule does, and side by side a reader checks them operation by operation.

- numpy (`encode_numpy`, `decode_numpy`): 64K-element chunks with `out=` on
  every operation, no allocation in the loop.
- numba (`compiled_loops`, built on first use: it imports numba and compiles
  the `_nb_*` loops below, cached on disk): one pass over each cache-resident
  block for absmax, scale, rounding and error feedback, and one for
  dequantizing, operation for operation in float32 (``inv = min(L / m, L /
  TINY)``, ``q = rint(v * inv)``, residual ``v - q * (m * 1/L)``; no fused
  multiply-add: numba leaves LLVM's contraction off unless fastmath asks for
  it). The block absmax is the maximum of the float bits with the sign masked
  off, an integer reduction that vectorizes and that orders non-negative
  floats as the floats do (NaN above Inf, so a NaN still yields a non-finite
  scale). Also the norm of a delta from its codes (`sum_squares_int8`) and
  the shard's weighted dequantize (`dequantize_weighted`).
- JAX (`jax_rule`, built on first use: it imports JAX), traceable functions
  for callers that quantize inside `jax.jit` on the values' own devices: the
  island's device exchange (`worker.device_quant`) and the shard's downlink
  (`paramserver.server.step.downlink`); see "The JAX formulation" below.

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

The JAX formulation. Same float32 operations in the same order, so the codes,
scales, decoded values and residual are the numpy codec's bit for bit:

    src      = x + residual                   (the caller adds it)
    m        = max |src| per block            (0 when below TINY = 2**-118)
    q        = round_half_even(src * min(L / m, L / TINY))
    decoded  = q * (m * float32(1 / L))
    residual = src - decoded

Where q rounds to -0.0, the residual subtracts -0.0 as the numpy and numba
encoders do, while `decoded` is +0.0, as every decoder computes it from the
integer code. Written as one elementwise chain around one row reduction over a
(blocks, block) view, so XLA fuses it into a reduce fusion and one elementwise
fusion instead of materialising every intermediate.

Fused multiply-add: XLA's CPU and GPU backends contract a multiply feeding an
add into one FMA, which rounds once where the codec rounds twice. `decoded`
therefore passes through an integer op on its bits (`_rounded`), which keeps
the multiply's own rounding without materialising anything, so the residual is
the codec's on every backend. An `optimization_barrier` does not do it (XLA
removes it before fusion), nor does a select (LLVM moves the add into it and
contracts again).

Subnormals: XLA may flush them to zero where numpy keeps them. Codes and scales
cannot differ (a block whose absmax is subnormal is below TINY and flushed; a
subnormal value in a block of absmax >= TINY quantizes to 0); a residual may hold
0 where numpy holds a subnormal.
"""

from __future__ import annotations

import functools
import threading
from types import SimpleNamespace

import ml_dtypes
import numpy as np

F32 = np.float32
TINY = F32(2.0**-118)
NIBBLE_BIAS = 8  # an int4 nibble holds q + 8 (0..14); a padding nibble 8 codes 0
# pieces below this run the numpy kernels: loading the compiled ones costs a process about
# 0.5 s (numba's import and cache), which only pieces of this size or more repay (it is
# also decode's piece, codec.readers.PIECE_ELEMENTS)
COMPILED_MIN_ELEMENTS = 1 << 18


def step_factor(levels: int) -> np.float32:
    """The float32 factor turning a block absmax into a quantization step.

    Args:
        levels: 127 (int8) or 7 (int4).

    Returns:
        float32(1 / levels).
    """
    return F32(1.0 / levels)


def max_factor(levels: int) -> np.float32:
    """The largest factor a block's values are multiplied by: the one of a flushed block.

    Args:
        levels: 127 (int8) or 7 (int4).

    Returns:
        float32(levels / TINY), which ``levels / m`` is clipped to (m = 0 gives inf).
    """
    return F32(levels / float(TINY))


@functools.cache
def _loops() -> SimpleNamespace | None:
    """`compiled_loops`, or None where numba cannot be imported (numpy then does it all)."""
    try:
        return _compile_loops()  # imports numba: only once a block codec runs
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


# -- the compiled formulation (numba) ---------------------------------------------------
# The `_nb_*` loops are plain Python until `compiled_loops` compiles them: it imports numba,
# so that importing the codec does not. They call each other through this module's globals,
# which the compile replaces with numba's dispatchers (numba freezes the constants below).

_LOOPS: list[str] = []  # the names of the `_nb_*` loops, in definition order
_compile_lock = threading.Lock()
_compiled: SimpleNamespace | None = None


def _loop(fn):
    """Mark `fn` as one of the compiled loops (`_compile_loops` compiles it)."""
    _LOOPS.append(fn.__name__)
    return fn


ABS_MASK = np.int32(0x7FFFFFFF)
BIAS = np.int8(NIBBLE_BIAS)
BIAS_F = np.float32(NIBBLE_BIAS)
PAD_HIGH = np.uint8(NIBBLE_BIAS << 4)  # the high nibble of an odd count's last byte: q = 0


@_loop
def _nb_absmax(bits, one_i, one_f):
    # bits: the int32 view of one block; one_f: the float32 view of one_i
    mx = np.int32(0)
    for i in range(bits.shape[0]):
        mx = max(mx, bits[i] & ABS_MASK)
    one_i[0] = mx
    return one_f[0]


@_loop
def _nb_quantize(src, res, new_res, codes, scales, buf, block, levels, tiny, inv_max, step):
    """Round-to-nearest block quantize of `src` (+ `res`), one block at a time.

    Args:
        src: float32 [n] input (contiguous).
        res: float32 [n] error-feedback residual added to `src`, or [0] for none.
        new_res: float32 [n] output ``v - q * step * m``, or [0] for none.
        codes: int8 [n] (levels 127), or uint8 [ceil(n/2)] (levels 7: low
            nibble first, q + 8; a missing odd last element counts as q = 0).
        scales: float32 [ceil(n/block)] output block absmax (0 below `tiny`).
        buf: float32 scratch of at least `block` elements.
        block: elements per block.
        levels: 127 or 7.
        tiny: float32 absmax below which a block is flushed to 0.
        inv_max: float32 ``levels / tiny``, the largest inverse step.
        step: float32 ``1 / levels``.
    """
    n = src.shape[0]
    add_res = res.shape[0] > 0
    write_res = new_res.shape[0] > 0
    packed = levels == 7
    one_i = np.zeros(1, np.int32)
    one_f = one_i.view(np.float32)
    lv = np.float32(levels)
    for j in range((n + block - 1) // block):
        a = j * block
        e = min(a + block, n)
        size = e - a
        s = src[a:e]
        if add_res:
            v = buf[:size]
            r = res[a:e]
            for i in range(size):
                v[i] = s[i] + r[i]
        else:
            v = s
        m = _nb_absmax(v.view(np.int32), one_i, one_f)
        if m < tiny:
            m = np.float32(0.0)
        scales[j] = m
        inv = lv / m
        if inv > inv_max:  # a NaN stays NaN, as with np.minimum
            inv = inv_max
        st = m * step
        if packed:
            _nb_pack4(v, codes[a // 2 : (e + 1) // 2], inv)
            if write_res:
                _nb_residual(v, new_res[a:e], inv, st)
        elif write_res:
            c = codes[a:e]
            nr = new_res[a:e]
            for i in range(size):
                q = np.rint(v[i] * inv)
                c[i] = np.int8(q)
                nr[i] = v[i] - q * st
        else:
            c = codes[a:e]
            for i in range(size):
                c[i] = np.int8(np.rint(v[i] * inv))


@_loop
def _nb_pack4(v, c, inv):
    size = v.shape[0]
    half = size // 2
    for i in range(half):
        lo = np.int8(np.rint(v[2 * i] * inv)) + BIAS
        hi = np.int8(np.rint(v[2 * i + 1] * inv)) + BIAS
        c[i] = np.uint8(lo) | np.uint8(np.uint8(hi) << np.uint8(4))
    if size % 2:  # the missing odd element is coded as 0 (nibble 8)
        lo = np.int8(np.rint(v[size - 1] * inv)) + BIAS
        c[half] = np.uint8(lo) | PAD_HIGH


@_loop
def _nb_residual(v, nr, inv, st):
    for i in range(v.shape[0]):
        nr[i] = v[i] - np.rint(v[i] * inv) * st


@_loop
def _nb_dequantize(codes, scales, out, block, levels, step):
    """Values ``q * (m * step)`` of the codes written by `quantize`.

    Args:
        codes: int8 [n] (levels 127) or packed uint8 [ceil(n/2)] (levels 7).
        scales: float32 [ceil(n/block)] block absmax values.
        out: float32 [n] output (contiguous).
        block: elements per block.
        levels: 127 or 7.
        step: float32 ``1 / levels``.
    """
    n = out.shape[0]
    for j in range((n + block - 1) // block):
        a = j * block
        e = min(a + block, n)
        st = scales[j] * step
        o = out[a:e]
        if levels == 7:
            _nb_unpack4(codes[a // 2 : (e + 1) // 2], o, st)
        else:
            c = codes[a:e]
            for i in range(e - a):
                o[i] = np.float32(c[i]) * st


@_loop
def _nb_unpack4(c, o, st):
    size = o.shape[0]
    half = size // 2
    eight = BIAS_F
    for i in range(half):
        b = c[i]
        o[2 * i] = (np.float32(b & np.uint8(15)) - eight) * st
        o[2 * i + 1] = (np.float32(b >> np.uint8(4)) - eight) * st
    if size % 2:
        o[size - 1] = (np.float32(c[half] & np.uint8(15)) - eight) * st


@_loop
def _nb_dequantize_weighted(codes, scales, out, first, block, step, factor, weight, add):
    """``out (+)= ((q * (m * step)) * factor) * weight`` over int8 codes, in float32.

    The weighted sum of a merge (`paramserver.server.step.merge`) without a
    decoded copy: each element is the decoder's value (`dequantize`), times a
    clip factor, times the delta's weight, each product rounded on its own,
    then stored (``add`` false) or added to `out` (no fused multiply-add).

    Args:
        codes: int8 codes of the whole tensor (levels 127).
        scales: its float32 block absmax values.
        out: float32 output, the elements [first, first + len(out)).
        first: the tensor index of out[0].
        block: elements per block.
        step: float32 ``1 / 127``.
        factor: float32 clip factor (1: none, skipped).
        weight: float32 weight.
        add: True to add to `out`, False to overwrite it.
    """
    n = out.shape[0]
    scaled = factor != np.float32(1.0)
    pos = 0
    while pos < n:
        j = (first + pos) // block
        end = min((j + 1) * block - first, n)
        st = scales[j] * step
        c = codes[first + pos : first + end]
        o = out[pos:end]
        for i in range(end - pos):
            t = np.float32(c[i]) * st
            if scaled:
                t = t * factor
            t = t * weight
            if add:
                o[i] = o[i] + t
            else:
                o[i] = t
        pos = end


# elements whose squared int8 codes an int32 sums exactly: 65536 * 128**2 = 2**30 < 2**31
SQUARES_RUN = 1 << 16


@_loop
def _nb_sum_squares_int8(codes, scales, lo, hi, block, step):
    """Sum of the squares of elements [lo, hi) of an int8 tensor, from its codes and block scales.

    Per block b, ``st_b**2 * sum_i q_i**2`` with st_b = float32(m_b * step)
    (the decoder's step) widened to float64, and the integer sum of the
    squared codes exact (int32 runs of SQUARES_RUN elements, which
    vectorize); the blocks' terms are added in block order, in float64
    (`codec.quant.sum_squares_int8_numpy` gives the same bits).

    Args:
        codes: int8 codes of the whole tensor.
        scales: its float32 block absmax values.
        lo, hi: the range, 0 <= lo <= hi <= len(codes).
        block: elements per block.
        step: float32 ``1 / 127``.

    Returns:
        The float64 sum.
    """
    total = 0.0
    if hi <= lo:
        return total
    for j in range(lo // block, (hi - 1) // block + 1):
        a = max(lo, j * block)
        e = min(hi, (j + 1) * block)
        whole = np.int64(0)
        for r in range(a, e, SQUARES_RUN):
            c = codes[r : min(r + SQUARES_RUN, e)]
            run = np.int32(0)
            for i in range(c.shape[0]):
                q = np.int32(c[i])
                run += q * q
            whole += np.int64(run)
        st = np.float64(scales[j] * step)
        total += np.float64(whole) * (st * st)
    return total


@_loop
def _nb_sum_squares_f32(values):
    """Sum of the squares of float32 values, in float64 (eight running sums, added at the end).

    Args:
        values: float32 [n] (contiguous).

    Returns:
        The float64 sum (the same bits on any host: a fixed order of additions).
    """
    n = values.shape[0]
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    m = n - n % 8
    for i in range(0, m, 8):
        x0, x1 = np.float64(values[i]), np.float64(values[i + 1])
        x2, x3 = np.float64(values[i + 2]), np.float64(values[i + 3])
        x4, x5 = np.float64(values[i + 4]), np.float64(values[i + 5])
        x6, x7 = np.float64(values[i + 6]), np.float64(values[i + 7])
        s0 += x0 * x0
        s1 += x1 * x1
        s2 += x2 * x2
        s3 += x3 * x3
        s4 += x4 * x4
        s5 += x5 * x5
        s6 += x6 * x6
        s7 += x7 * x7
    for i in range(m, n):
        x = np.float64(values[i])
        s0 += x * x
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


def _compile_loops() -> SimpleNamespace:
    """The compiled loops, compiled on first use (each on its first call) and cached on disk.

    Returns:
        A namespace of `quantize`, `dequantize`, `dequantize_weighted`,
        `sum_squares_int8` and `sum_squares_f32` (numba dispatchers).

    Raises:
        ImportError: numba cannot be imported.
    """
    global _compiled
    with _compile_lock:
        if _compiled is None:
            import numba

            jit = numba.njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
            module = globals()
            for name in _LOOPS:  # the loops find each other compiled under their own names
                module[name] = jit(module[name])
            _compiled = SimpleNamespace(
                quantize=module["_nb_quantize"],
                dequantize=module["_nb_dequantize"],
                dequantize_weighted=module["_nb_dequantize_weighted"],
                sum_squares_int8=module["_nb_sum_squares_int8"],
                sum_squares_f32=module["_nb_sum_squares_f32"],
            )
    return _compiled


# -- the traceable formulation (JAX) ----------------------------------------------------


@functools.cache
def _jax_rule() -> SimpleNamespace:
    """The rule as traceable JAX functions (see "The JAX formulation" above); imports JAX.

    Returns:
        A namespace of `encode`, `quantize` and `dequantize`.

    Raises:
        ImportError: JAX cannot be imported.
    """
    import jax
    import jax.numpy as jnp

    def _rounded(product: jax.Array, scale: jax.Array) -> jax.Array:
        """A (blocks, block) product rounded on its own: never contracted into a later add.

        The product's bits pass through an integer xor with the block scale's sign bit
        (0 for the scales the codec writes and reads, which are >= 0): an integer op the
        compiler cannot fold away, so no multiply-add can span it. Costs two integer ops.

        Args:
            product: q * step per block.
            scale: the blocks' scales (their sign bit is 0).
        """
        sign = jax.lax.bitcast_convert_type(scale, jnp.uint32) & jnp.uint32(0x80000000)
        bits = jax.lax.bitcast_convert_type(product, jnp.uint32) ^ sign[:, None]
        return jax.lax.bitcast_convert_type(bits, jnp.float32)

    def _blocks(x: jax.Array, block: int) -> jax.Array:
        n = x.shape[0]
        nb = -(-n // block)
        return jnp.pad(x, (0, nb * block - n)).reshape(nb, block)

    def encode(src: jax.Array, levels: int, block: int) -> tuple[jax.Array, ...]:
        """Quantize a 1-D float32 vector block by block; also what decoding gives and misses.

        Args:
            src: 1-D float32, n elements (the values with any old residual added).
            levels: 127 (int8) or 7 (int4).
            block: elements per block (even for int4).

        Returns:
            (codes, scales, decoded, residual): int8 [n] or packed uint8 [ceil(n / 2)],
            float32 [ceil(n / block)] block absmax values, float32 [n] what
            `codec.decode` gives for them, float32 [n] ``src - decoded``. Under jit,
            the outputs a caller drops are never computed.
        """
        n = src.shape[0]
        v = _blocks(src, block)
        m = jnp.max(jnp.abs(v), axis=1)
        m = jnp.where(m < TINY, jnp.float32(0), m)
        inv = jnp.minimum(jnp.float32(levels) / m, max_factor(levels))
        q = jnp.round(v * inv[:, None])  # round half to even, as np.rint
        step = (m * step_factor(levels))[:, None]
        # the residual subtracts q * step as the encoders do (q may be -0.0 there) ...
        residual = (v - _rounded(q * step, m)).reshape(-1)[:n]
        # ... and the decoded values are a decoder's, from the integer codes (+0.0 for a 0)
        codes = q.astype(jnp.int8)
        decoded = _rounded(codes.astype(jnp.float32) * step, m).reshape(-1)[:n]
        return _pack(codes.reshape(-1), n, levels), m, decoded, residual

    def quantize(src: jax.Array, levels: int, block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Quantize with error feedback: `encode` without the decoded values.

        Args:
            src: 1-D float32, n elements (the delta with the old residual added).
            levels: 127 (int8) or 7 (int4).
            block: elements per block (even for int4).

        Returns:
            (codes, scales, new residual): int8 [n] or packed uint8 [ceil(n / 2)],
            float32 [ceil(n / block)], float32 [n].
        """
        codes, scales, _, residual = encode(src, levels, block)
        return codes, scales, residual

    def _pack(codes: jax.Array, n: int, levels: int) -> jax.Array:
        if levels == 127:
            return codes[:n]
        # padded blocks have an even length, and their padding codes 0 (a high nibble of 8)
        nibbles = (codes + jnp.int8(NIBBLE_BIAS)).astype(jnp.uint8)
        packed = nibbles[0::2] | (nibbles[1::2] << jnp.uint8(4))
        return packed[: (n + 1) // 2]

    def dequantize(
        codes: jax.Array, scales: jax.Array, n: int, levels: int, block: int
    ) -> jax.Array:
        """The values of int8 or int4 codes, as `codec.decode` computes them.

        Args:
            codes: int8 [n] or packed uint8 [ceil(n / 2)].
            scales: float32 [ceil(n / block)].
            n: element count.
            levels: 127 or 7.
            block: elements per block.

        Returns:
            1-D float32 [n]: ``q * (m * float32(1 / L))``, rounded before any add that
            consumes it (a replica adds it to its values as numpy does).
        """
        if levels == 127:
            q = codes.astype(jnp.float32)
        else:
            low = (codes & jnp.uint8(15)).astype(jnp.float32)
            high = (codes >> jnp.uint8(4)).astype(jnp.float32)
            q = jnp.stack([low, high], axis=1).reshape(-1)[:n] - jnp.float32(NIBBLE_BIAS)
        step = scales * step_factor(levels)
        return _rounded(_blocks(q, block) * step[:, None], scales).reshape(-1)[:n]

    return SimpleNamespace(encode=encode, quantize=quantize, dequantize=dequantize)


def __getattr__(name: str) -> SimpleNamespace:
    """The formulations built on first use: `compiled_loops` (numba) and `jax_rule` (JAX).

    `from codec.quant import compiled_loops` imports numba and `from codec.quant
    import jax_rule` imports JAX; importing this module imports neither.

    Raises:
        ImportError: numba (for `compiled_loops`) or JAX (for `jax_rule`) cannot be imported.
        AttributeError: any other name.
    """
    if name == "compiled_loops":
        return _compile_loops()
    if name == "jax_rule":
        return _jax_rule()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
