"""codec: tensors <-> bytes for low-communication training.

Quantizes trees of float arrays (raw float32/bfloat16, block-absmax int8 and
int4 with optional stochastic rounding, sparse top-k at 2 or 4 bits), carries
error-feedback residuals,
compresses with zstd and frames the result for ZeroMQ. The wire format is
specified in `codec.format`.

    c = codec.int8()
    state = c.init(tree)
    frames, state = c.encode(tree, state)
    tree2 = codec.decode(frames)
"""

from .decode import decode
from .errors import CodecError
from .format import DEFAULT_MAX_ELEMENTS, FORMAT_VERSION
from .framing import join, split
from .schemes import Codec, int4, int8, raw, topk
from .state import ErrorFeedbackState
from .tree import flatten, unflatten

__all__ = [
    "DEFAULT_MAX_ELEMENTS",
    "FORMAT_VERSION",
    "Codec",
    "CodecError",
    "ErrorFeedbackState",
    "decode",
    "flatten",
    "int4",
    "int8",
    "join",
    "raw",
    "split",
    "topk",
    "unflatten",
]
