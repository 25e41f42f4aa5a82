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

`codec.decode(frames, out=tree)` decodes into the caller's arrays (same names,
shapes and dtypes as encoded), which saves writing fresh memory each message.

The int8/int4 block kernels are compiled with numba when it is installed (the
`fast` extra, which `./dev` installs; imported on the first
encode or decode of a block scheme, compiled once and cached on disk): one
pass per block for absmax, scale, rounding and error feedback, and one for
dequantizing; at 16M elements on one core, int8 encode with error feedback
and zstd runs at about 0.2x memcpy and decode at about 0.3x, most of it zstd
(`diloco-bench codec`, `single_core`). Without numba the same numpy kernels
as before compute the same bits, at about half the encode speed.

The int8/int4 block rule is defined once (`codec.quant_rule`) and computed three
ways that give the same bits: numpy (`codec.quant`, which picks the formulation),
the compiled numba loops (`codec.quant.compiled_loops`, from `codec.quant_numba`),
and JAX (`codec.quant.jax_rule`, from `codec.quant_jax`, for quantizing
inside `jax.jit` on the values' own devices: the island's device exchange and
the shard's downlink). Every message, whoever
quantized it, is written by one frame writer (`codec.payload.FrameWriter`,
to the format `codec.format` specifies; `codec.coded.frame_codes` for codes
and scales computed elsewhere).
Dependencies: numpy, zstandard, msgpack and ml_dtypes. numba and JAX are
optional and imported only where used: numba by the first large block encode
or decode, JAX only by a caller that asks for `codec.quant.jax_rule` itself
(nothing in `codec` does, so `import codec` never loads JAX).

Speed: `zstd_threads=N` (encode) and `decode(frames, threads=N)` spread the
quantize/dequantize pieces and the 1 MiB zstd frames over N threads (the
caller plus N - 1 pool threads, one zstd object per thread). zstd buys 3-20%
fewer int8 bytes (4.05x -> 3.92x of fp32 on real deltas without it) at the
cost of compressing and decompressing (level 1 runs at ~0.75 GB/s of int8
codes per core on a 2-core test machine); `zstd_level=None` skips it, which
is faster end to end on links above the break-even ``bytes saved / (extra
encode + decode seconds)``: measured 0.5-0.65 Gbit/s for int8 on real deltas
there (0.7-1.0 Gbit/s counting the encoder alone; 0.9 end to end on
synthetic data). `diloco-bench codec` measures it in every run
(`zstd_break_even`). For topk, zstd halves the bytes (the offset planes
compress well) and its timings there were too small to separate from noise:
keep zstd for topk on WAN links.
"""

from .format import DEFAULT_MAX_ELEMENTS, FORMAT_VERSION, CodecError
from .framing import join, split
from .readers import decode
from .schemes import Codec, int4, int8, raw, topk
from .state import ErrorFeedbackState, refund
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
    "refund",
    "split",
    "topk",
    "unflatten",
]
