"""The compressed downlink: what a shard publishes for each outer step, and what it keeps.

This module owns the rule that keeps every replica equal to the shard bit for
bit while the shard publishes int8 instead of float32, applied chunk by chunk
(`quantize_chunk` inside the step's jit, `Int8Publication` on the host; fed by
`paramserver.server.step.fragment_step`):

    target    = outer update + residual          (float32, per chunk)
    codes     = int8 block quantization of target (the codec's float32 operations,
                                                  round to nearest, no codec error
                                                  feedback: the residual IS the feedback)
    decoded   = codes * block step                (what codec.decode(frames) gives)
    params   += decoded                           (float32 add, numpy, as a replica does)
    residual  = bfloat16(target - decoded)        (carried into the next update)

The update is quantized once, by the codec's int8 rule in its JAX form
(`codec.quant.jax_rule`); the shard applies exactly the decoded values and never
decodes its own frames. The frames are those
`codec.int8(zstd_level=PUBLISH_ZSTD_LEVEL).encode` writes for {"values":
target}, byte for byte (the codec's frame writer, `codec.payload`), but built
as the chunks come: each 1 MiB payload frame of codes is written into its own
buffer and closed (crc32, or zstd with a level) as soon as it is full.
Without zstd the frames are those buffers
(codes, block scales: about 1.02 B/param held until sent, no copy); zstd level
1 on int8 codes of an outer update saved ~7% of the bytes for ~3x the time of
crc32 (19 vs 6.5 ms per 16M codes here), so the downlink publishes without it
by default; replicas decode either (the header says which). The
residual is kept in bfloat16 (2 B/param instead of 4; it is at most half a
quantization step, so its own rounding is ~2^-9 of that). Everything is a pure
function of its inputs and the backend's compiled code, so replaying the log
reproduces the same frames and parameters.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import codec
from codec import format as fmt
from codec.payload import FrameWriter
from codec.quant import jax_rule as jax_quant
from paramserver.server.config import DOWNLINKS
from paramserver.server.step.outer import aligned_float32

RESIDUAL_DTYPE = np.dtype(ml_dtypes.bfloat16)
PUBLISH_ZSTD_LEVEL: int | None = None  # the published frames' zstd level (None: crc32 only)


class DownlinkError(ValueError):
    """An unknown downlink scheme, or an update that cannot be published."""


def new_residual(size: int) -> np.ndarray:
    """A zero downlink residual for a fragment of `size` elements (aligned bfloat16).

    Args:
        size: the fragment's element count.

    Returns:
        The residual buffer (its uint16 view is what JAX reads).
    """
    out = aligned_float32(-(-size // 2)).view(np.uint16)[:size]
    out[...] = 0
    return out.view(RESIDUAL_DTYPE)


def restore_residual(saved: np.ndarray) -> np.ndarray:
    """A residual buffer from its checkpoint form.

    Args:
        saved: the bfloat16 bits (uint16), or float32 values (checkpoints
            written before the residual was kept in bfloat16; rounded to it).

    Returns:
        An aligned bfloat16 residual.
    """
    saved = np.asarray(saved).reshape(-1)
    out = new_residual(saved.shape[0])
    if saved.dtype == np.uint16:
        out.view(np.uint16)[...] = saved
    else:
        out[...] = saved.astype(np.float32)
    return out


def quantize_chunk(target: jax.Array, block: int) -> tuple[jax.Array, ...]:
    """The int8 encoding of one chunk, inside the step's jit: codes, scales, decoded, residual.

    The codec's int8 rule in its JAX formulation (`codec.quant.jax_rule.encode`), so
    codes and scales are the codec's bit for bit, `decoded` is what
    `codec.decode` gives for them and the residual is ``target - decoded`` of
    that rounded `decoded` (never a fused multiply-add, on any backend), rounded
    to bfloat16.

    Args:
        target: the chunk's update plus residual (float32); a chunk that is not
            a multiple of `block` is padded with zeros, as the codec pads.
        block: the block size.

    Returns:
        (int8 codes, float32 block absmax, float32 decoded, the new residual
        target - decoded as bfloat16 bits in uint16).
    """
    codes, scales, decoded, residual = jax_quant.encode(target, 127, block)
    residual = residual.astype(jnp.bfloat16)
    return codes, scales, decoded, jax.lax.bitcast_convert_type(residual, jnp.uint16)


class Downlink:
    """Publishes outer updates as int8 increments ("int8"), or none ("float32": full values)."""

    def __init__(
        self, scheme: str = "float32", zstd_level: int | None = PUBLISH_ZSTD_LEVEL
    ) -> None:
        """Pick the scheme.

        Args:
            scheme: "float32" (publish the new values, mode "full") or "int8"
                (publish the quantized update, mode "increment").
            zstd_level: zstd level of the int8 frames, None for none (crc32).
        """
        if scheme not in DOWNLINKS:
            raise DownlinkError(f"downlink {scheme!r} is unknown; choose one of {DOWNLINKS}")
        self.scheme = scheme
        self._codec = codec.int8(zstd_level=zstd_level) if scheme == "int8" else None
        block = self._codec.block_size if self._codec else 0
        self.finish = lambda target: quantize_chunk(target, block)  # in the step's jit

    @property
    def block_size(self) -> int:
        """The int8 block size (0 for the float32 downlink)."""
        return self._codec.block_size if self._codec else 0

    @property
    def compressed(self) -> bool:
        """Whether updates are published as quantized deltas."""
        return self._codec is not None

    def begin(self, params: np.ndarray, residual: np.ndarray) -> Int8Publication:
        """Start publishing one outer update of a fragment.

        Args:
            params: the fragment's values (aligned float32; updated in place).
            residual: its downlink residual (`new_residual`; updated in place).

        Returns:
            The publication to feed chunk by chunk.
        """
        if self._codec is None:
            raise DownlinkError("the float32 downlink publishes full values, not deltas")
        return Int8Publication(params, residual, self._codec.block_size, self._codec.zstd_level)


class Int8Publication:
    """One int8 increment of a fragment, quantized and applied chunk by chunk, framed as it goes.

    Feed `apply` the chunks [lo, hi) in order (lo a multiple of 1 MiB / 4 = 2^18
    divided by a power of two; block-aligned), then take `frames()`.
    """

    def __init__(
        self, params: np.ndarray, residual: np.ndarray, block: int, zstd: int | None
    ) -> None:
        """Lay out the message of `params.shape[0]` elements.

        Args:
            params: the fragment's values (aligned float32, updated in place).
            residual: its bfloat16 residual (updated in place).
            block: int8 block size.
            zstd: zstd level of the payload frames, None for none (each full
                frame of codes is then sent from its own buffer).
        """
        n = params.shape[0]
        self.params, self.residual_bits = params, residual.view(np.uint16)
        self.block, self.zstd = block, zstd
        self.writer = FrameWriter("int8", block, [(("values",), (n,), "float32")], zstd)
        (self.tensor,), self.total = self.writer.tensors, self.writer.total
        self.full = n // fmt.FRAME_BYTES  # payload frames that hold nothing but codes
        self.window = np.empty(fmt.FRAME_BYTES, np.int8)
        self.tail = np.zeros(self.total - self.full * fmt.FRAME_BYTES, np.uint8)
        start = self.tensor.scales_offset - self.full * fmt.FRAME_BYTES
        self.scales = self.tail[start:].view(np.float32)

    def apply(self, lo: int, hi: int, quantized: tuple[jax.Array, ...]) -> None:
        """Take one chunk's encoding (`quantize_chunk`): frame its codes, apply its decoded values.

        Args:
            lo, hi: the chunk [lo, hi) (lo a multiple of the block size).
            quantized: (codes, scales, decoded, residual bits) of [lo, hi).

        Raises:
            DownlinkError: the target is not finite (the chunks before stay applied).
        """
        codes, scales, decoded, residual = (np.asarray(x) for x in quantized)
        if scales.shape[0] and not np.isfinite(scales.max()):
            raise DownlinkError(f"outer update of elements [{lo}, {hi}) is not finite")
        np.copyto(self.codes_out(lo, hi), codes)
        np.copyto(self.scales_out(lo, hi), scales)
        np.add(self.params[lo:hi], decoded, out=self.params[lo:hi])
        np.copyto(self.residual_bits[lo:hi], residual)
        self.written(lo, hi)

    def codes_out(self, lo: int, hi: int) -> np.ndarray:
        """Where the int8 codes of the chunk [lo, hi) go (a view of the message's buffers).

        Args:
            lo, hi: the chunk (within one payload frame).

        Returns:
            An int8 array of hi - lo elements.

        Raises:
            DownlinkError: the chunk straddles a payload frame.
        """
        first = self.full * fmt.FRAME_BYTES
        if lo >= first:
            return self.tail[lo - first : hi - first].view(np.int8)
        if (lo // fmt.FRAME_BYTES) != ((hi - 1) // fmt.FRAME_BYTES):
            raise DownlinkError(f"chunk [{lo}, {hi}) straddles a payload frame")
        base = lo - lo % fmt.FRAME_BYTES
        return self.window[lo - base : hi - base]

    def scales_out(self, lo: int, hi: int) -> np.ndarray:
        """Where the block scales of the chunk [lo, hi) go (lo a multiple of the block size).

        Args:
            lo, hi: the chunk.

        Returns:
            A float32 view of the message's scales.
        """
        return self.scales[lo // self.block : -(-hi // self.block)]

    def written(self, lo: int, hi: int) -> None:
        """The chunk [lo, hi)'s codes and scales are in place: close a payload frame it fills.

        Args:
            lo, hi: the chunk, fed in order.
        """
        if hi <= self.full * fmt.FRAME_BYTES and hi % fmt.FRAME_BYTES == 0:
            self.writer.close(memoryview(self.window).cast("B"))
            if self.zstd is None:  # the frame is the window itself: the next one gets its own
                self.window = np.empty(fmt.FRAME_BYTES, np.int8)

    def frames(self) -> list[Any]:
        """The message's frames (header first), once every chunk was applied.

        Returns:
            What `codec.int8(zstd_level=...).encode({"values": target})` writes
            for the whole target, with this publication's zstd level.
        """
        self.writer.close(memoryview(self.tail))
        return self.writer.frames()
