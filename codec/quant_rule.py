"""The int8/int4 block-absmax rule, defined once: its constants and factors.

Per block of `block` elements, ``m = max(|x|)``, ``q = round(x * min(L / m,
L / TINY))`` (half to even) with L = 127 (int8) or 7 (int4; two codes a byte,
element 2i in the low nibble, each nibble ``q + NIBBLE_BIAS``, an odd count's
last high nibble coding 0), decoded ``q * (m * float32(1/L))``. Encode and
decode use the very same float32 operations, never a fused multiply-add, so an
encoder's error-feedback residual ``x - decoded`` is exact with respect to what
any decoder reconstructs. Blocks with ``m`` below TINY are flushed to 0 (their
step would be subnormal).

The three formulations that compute the rule, bit for bit alike, build on
these constants: numpy (`codec.quant`, which also dispatches), numba
(`codec.quant_numba`) and JAX (`codec.quant_jax`).
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
TINY = F32(2.0**-118)
NIBBLE_BIAS = 8  # an int4 nibble holds q + 8 (0..14); a padding nibble 8 codes 0


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
