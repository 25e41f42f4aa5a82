"""Compiled (numba) loops of the fused outer step: Nesterov, the downlink's int8 quantize, the apply.

One pass per block of a chunk the merge has just written (cache-resident):
read the merged delta g, the momentum m, the downlink residual r (bfloat16)
and the params p; write m, the int8 codes and block scale of the published
update, p and r. The arithmetic is `outer.round_nesterov` followed by
`downlink.quantize_chunk` and `Int8Publication.apply`, in float32, in the
order XLA's CPU build computes the jitted chunk step (`fragment_step.ChunkedStep`)::

    m  <- fresh ? fma(beta, m, g) : m + g     (the round's first step: m = g + beta m)
    y  =  due ? fma(beta, m, g) : g           (the round is complete: Nesterov's look-ahead)
    v  =  fma(-lr, y, float32(r))             (the update plus the residual carried in)
    s  =  max |v| over the block (0 below TINY);  inv = min(127 / s, 127 / TINY)
    q  =  rint(v * inv);  codes = int8(q)
    p  <- p + float32(int8(q)) * (s * (1/127))   (the decoded update, as a replica adds it)
    r  <- bfloat16(v - q * (s * (1/127)))        (round to nearest even)

and without the int8 downlink p <- fma(-lr, y, p). A momentum kept in
bfloat16 (`ShardConfig.momentum_dtype`; the kernels take its bits as uint16)
is read as float32 (exact), the lines above run in float32 with that m, and
the new m is stored as bfloat16(m) (round to nearest even, as the residual);
the update uses the float32 m, before its rounding. XLA contracts a multiply
feeding an add into one fused multiply-add (FMA) where the host has one; the
`fma` above are exactly where it does so in the jitted chunk step, and the
kernels write them as the fused instruction (`llvm.fma`, rounded once on any
host); every other product is rounded on its own, as in the codec's rule.
tests/test_fused_step.py checks the bits against the jitted step and against
a numpy reference. On a host without FMA, XLA would round twice and the two
paths would differ in the last bit of some elements.
Imports numba: `fragment_step.FusedNesterov` imports this module only when numba is there.
"""

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

ABS_MASK = np.uint32(0x7FFFFFFF)

jit = numba.njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")


@intrinsic
def _fma(typingctx, a, b, c):
    # a * b + c rounded once (llvm.fma.f32: the instruction where the host has it)
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(f32, [f32, f32, f32]), "llvm.fma.f32"
        )
        return builder.call(fn, args)

    return sig, codegen


@intrinsic
def _float_of_bits(typingctx, bits):
    # the float32 whose bits are the uint32 `bits`
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def _bits_of_float(typingctx, value):
    # the uint32 bits of the float32 `value`
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@jit
def _nesterov(g, m, beta, fresh, due):
    # (new momentum, the update over -lr) of one element: round_nesterov as XLA contracts it
    m = _fma(beta, m, g) if fresh else m + g
    if due:
        return m, _fma(beta, m, g)
    return m, g


@jit
def _bf16_bits(value):
    # float32 -> bfloat16 bits, round to nearest even (a NaN stays a quiet NaN); branch-free
    bits = _bits_of_float(value)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    quiet = (bits >> np.uint32(16)) | np.uint32(0x40)
    nan = (bits & ABS_MASK) > np.uint32(0x7F800000)
    return np.uint16(quiet if nan else rounded)


def _load_momentum(mom, i):
    """Element i of a kept momentum as float32 (float32 as is; uint16: bfloat16 bits)."""
    raise NotImplementedError("compiled only: numba chooses the form by mom's dtype")


@overload(_load_momentum, jit_options={"nogil": True})
def _load_momentum_of(mom, i):
    if mom.dtype == types.uint16:
        return lambda mom, i: _float_of_bits(np.uint32(mom[i]) << np.uint32(16))
    return lambda mom, i: mom[i]


def _store_momentum(mom, i, value):
    """Keep the float32 `value` as element i of a momentum (uint16: bfloat16, nearest even)."""
    raise NotImplementedError("compiled only: numba chooses the form by mom's dtype")


@overload(_store_momentum, jit_options={"nogil": True})
def _store_momentum_of(mom, i, value):
    if mom.dtype == types.uint16:

        def store_bfloat16(mom, i, value):
            mom[i] = _bf16_bits(value)

        return store_bfloat16

    def store_float32(mom, i, value):
        mom[i] = value

    return store_float32


@jit
def nesterov_int8(
    merged, lo, params, mom, res_bits, codes, scales, buf,
    neg_lr, beta, fresh, due, block, tiny, inv_max, step,
):  # fmt: skip
    """One chunk of the fused step with the int8 downlink.

    Args:
        merged: float32 merged delta of the chunk [lo, lo + len(merged)).
        lo: the chunk's first element (a multiple of `block`).
        params: the fragment's float32 values (updated in place).
        mom: its momentum (updated in place): float32, or bfloat16 as its
            uint16 bits (computed in float32, stored rounded to nearest even).
        res_bits: its bfloat16 residual as uint16 (updated in place).
        codes: int8 output, len(merged) codes of the chunk.
        scales: float32 output, the chunk's block scales.
        buf: float32 scratch of at least `block` elements.
        neg_lr: float32 -lr.
        beta: float32 momentum.
        fresh: the round's first step (momentum decays).
        due: the round is complete (Nesterov's look-ahead).
        block: int8 block size.
        tiny: float32 absmax below which a block is 0.
        inv_max: float32 127 / tiny.
        step: float32 1 / 127.

    Returns:
        The index of the first block whose scale is not finite, or -1.
    """
    n = merged.shape[0]
    bad = -1
    lv = np.float32(127.0)
    for j in range((n + block - 1) // block):
        a = j * block
        e = min(a + block, n)
        size = e - a
        # views of the block: loops over range(size) index without wraparound, so they vectorize
        g_b, v_b, c_b = merged[a:e], buf[:size], codes[a:e]
        p_b, m_b, r_b = params[lo + a : lo + e], mom[lo + a : lo + e], res_bits[lo + a : lo + e]
        top = np.uint32(0)
        for i in range(size):
            m, y = _nesterov(g_b[i], _load_momentum(m_b, i), beta, fresh, due)
            _store_momentum(m_b, i, m)
            v = _fma(neg_lr, y, _float_of_bits(np.uint32(r_b[i]) << np.uint32(16)))
            v_b[i] = v
            top = max(top, _bits_of_float(v) & ABS_MASK)  # NaN above Inf, as the codec's absmax
        s = _float_of_bits(top)
        if s < tiny:
            s = np.float32(0.0)
        scales[j] = s
        if bad < 0 and not np.isfinite(s):
            bad = j
        inv = lv / s
        if inv > inv_max:  # a NaN stays NaN
            inv = inv_max
        st = s * step
        for i in range(size):
            v = v_b[i]
            q = np.rint(v * inv)
            c = np.int8(q)
            c_b[i] = c
            p_b[i] = p_b[i] + np.float32(c) * st
            r_b[i] = _bf16_bits(v - q * st)
    return bad


@jit
def nesterov_apply(merged, lo, params, mom, neg_lr, beta, fresh, due):
    """One chunk of the fused step without a downlink residual: p <- p + u (float32 downlink).

    Args:
        merged: float32 merged delta of the chunk [lo, lo + len(merged)).
        lo: the chunk's first element.
        params: the fragment's float32 values (updated in place).
        mom: its momentum (updated in place): float32, or bfloat16 as uint16 bits.
        neg_lr: float32 -lr.
        beta: float32 momentum.
        fresh: the round's first step.
        due: the round is complete.
    """
    n = merged.shape[0]
    p_c, m_c = params[lo : lo + n], mom[lo : lo + n]
    for i in range(n):
        m, y = _nesterov(merged[i], _load_momentum(m_c, i), beta, fresh, due)
        _store_momentum(m_c, i, m)
        p_c[i] = _fma(neg_lr, y, p_c[i])
