"""The island's device quantizer: the codec's JAX formulation of the int8/int4 block rule.

`worker.device_exchange` quantizes deltas with error feedback and dequantizes
published increments inside its jitted push and fold with these functions.
They are `codec.quant.jax_rule`'s (the rule is defined once, in `codec.quant_rule`,
and its numpy, numba and JAX formulations give the same bits), so the frames an
island writes from device codes (`codec.coded.frame_codes`) are those
`Codec.encode` writes for the same delta and residual.
"""

from codec.quant import jax_rule

dequantize = jax_rule.dequantize
quantize = jax_rule.quantize

__all__ = ["dequantize", "quantize"]
