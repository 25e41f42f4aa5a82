"""The compiled formulation of the block rule (numba): the `_nb_*` loops and their compile.

`compile_loops` (`codec.quant.compiled_loops`, built on first use: it imports
numba and compiles the loops of this module, cached on disk): one pass over each
cache-resident block for absmax, scale, rounding and error feedback, and one
for dequantizing, operation for operation in float32 (``inv = min(L / m, L /
TINY)``, ``q = rint(v * inv)``, residual ``v - q * (m * 1/L)``; no fused
multiply-add: numba leaves LLVM's contraction off unless fastmath asks for
it). The block absmax is the maximum of the float bits with the sign masked
off, an integer reduction that vectorizes and that orders non-negative
floats as the floats do (NaN above Inf, so a NaN still yields a non-finite
scale). Also the norm of a delta from its codes (`sum_squares_int8`) and
the shard's weighted dequantize (`dequantize_weighted`).

The rule itself is `codec.quant_rule`'s; `codec.quant` picks these loops or its
numpy kernels. Importing this module does not import numba.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np

from .quant_rule import NIBBLE_BIAS

# The `_nb_*` loops are plain Python until `compiled_loops` compiles them: it imports numba,
# so that importing the codec does not. They call each other through this module's globals,
# which the compile replaces with numba's dispatchers (numba freezes the constants below).

_LOOPS: list[str] = []  # the names of the `_nb_*` loops, in definition order
_compile_lock = threading.Lock()
_compiled: SimpleNamespace | None = None


def _loop(fn):
    """Mark `fn` as one of the compiled loops (`compile_loops` compiles it)."""
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


def compile_loops() -> SimpleNamespace:
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
