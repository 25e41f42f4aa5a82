"""Block-absmax quantization with error feedback as traceable JAX functions (for `jax.jit`).

The same float32 operations, in the same order, as the numpy codec
(`codec.quant`), so a device encodes the codes, scales and residual the host
codec would for the same input and residual:

    src      = x + residual
    m        = max |src| per block            (0 when below 2**-118)
    q        = round_half_even(src * min(L / m, L / 2**-118))
    decoded  = q * (m * float32(1 / L))
    residual = src - decoded

with L = 127 (int8) or 7 (int4, two codes per byte: element 2i in the low
nibble, each nibble q + 8). Written as one elementwise chain around one
row reduction over a (blocks, block) view, so XLA fuses the error-feedback
step into a reduce fusion and one elementwise fusion instead of materialising
every intermediate. XLA's CPU backend (and GPU backends) contract a multiply
feeding an add into one fused multiply-add, which rounds once where the codec
rounds twice: `decoded` therefore passes through an integer op on its bits
(`_rounded`), which keeps the multiply's own rounding without materialising
anything. An `optimization_barrier` does not (XLA removes it before fusion),
nor does a select (LLVM moves the add into it and contracts again).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

TINY = np.float32(2.0**-118)


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


def quantize(src: jax.Array, levels: int, block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Quantize a 1-D float32 vector (input plus residual) block by block.

    Args:
        src: 1-D float32, n elements (the delta with the old residual added).
        levels: 127 (int8) or 7 (int4).
        block: elements per block (even for int4).

    Returns:
        (codes, scales, new residual): int8 [n] or packed uint8 [ceil(n / 2)],
        float32 [ceil(n / block)], float32 [n].
    """
    n = src.shape[0]
    v = _blocks(src, block)
    m = jnp.max(jnp.abs(v), axis=1)
    m = jnp.where(m < TINY, jnp.float32(0), m)
    inv = jnp.minimum(jnp.float32(levels) / m, jnp.float32(levels / float(TINY)))
    q = jnp.round(v * inv[:, None])  # round half to even, as np.rint
    step = jnp.float32(1.0 / levels)
    decoded = _rounded(q * (m * step)[:, None], m)
    residual = (v - decoded).reshape(-1)[:n]
    return _pack(q.reshape(-1), n, levels), m, residual


def _pack(q: jax.Array, n: int, levels: int) -> jax.Array:
    if levels == 127:
        return q[:n].astype(jnp.int8)
    nibbles = (q.astype(jnp.int8) + jnp.int8(8)).astype(jnp.uint8)  # padded blocks: even length
    packed = nibbles[0::2] | (nibbles[1::2] << jnp.uint8(4))
    return packed[: (n + 1) // 2]


def dequantize(codes: jax.Array, scales: jax.Array, n: int, levels: int, block: int) -> jax.Array:
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
        q = jnp.stack([low, high], axis=1).reshape(-1)[:n] - jnp.float32(8)
    step = scales * jnp.float32(1.0 / levels)
    return _rounded(_blocks(q, block) * step[:, None], scales).reshape(-1)[:n]
