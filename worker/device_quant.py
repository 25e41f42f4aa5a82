"""The island's device quantizer: the codec's JAX formulation of the int8/int4 block rule.

`worker.device_exchange` quantizes deltas with error feedback and dequantizes
published increments inside its jitted push and fold with these functions.
They are `codec.jax_quant`'s (the rule is defined once, in `codec.quant`, and
its numpy, numba and JAX formulations give the same bits), so the frames an
island writes from device codes (`codec.format.frame_codes`) are those
`Codec.encode` writes for the same delta and residual.
"""

from codec.jax_quant import dequantize, quantize

__all__ = ["dequantize", "quantize"]
