"""The traceable formulation of the block rule (JAX), for quantizing inside `jax.jit`.

`build_jax_rule` (`codec.quant.jax_rule`, built on first use: it imports JAX):
traceable functions for callers that quantize inside `jax.jit` on the values'
own devices: the island's device exchange (`worker.device_quant`) and the
shard's downlink (`paramserver.server.step.downlink`). Importing this module
does not import JAX. The rule itself is `codec.quant_rule`'s.

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
from types import SimpleNamespace

from .quant_rule import NIBBLE_BIAS, TINY, max_factor, step_factor


@functools.cache
def build_jax_rule() -> SimpleNamespace:
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
