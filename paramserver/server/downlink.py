"""The compressed downlink: what a shard publishes for each outer step, and what it keeps.

This module owns the rule that keeps every replica equal to the shard bit for
bit while the shard publishes int8 instead of float32, applied chunk by chunk
(`Int8Publication`, fed by `paramserver.server.chunked_step`):

    target    = outer update + residual          (float32, per chunk)
    codes     = int8 block quantization of target (codec.quant, round to nearest,
                                                  no codec error feedback: the
                                                  residual here IS the feedback)
    decoded   = codes * block step                (codec.quant.decode_blocks: what
                                                  codec.decode(frames) gives)
    params   += decoded                           (float32 add, numpy, as a replica does)
    residual  = bfloat16(target - decoded)        (carried into the next update)

The update is quantized once; the shard applies exactly the decoded values and
never decodes its own frames. The frames are those `codec.int8().encode` writes
for {"values": target}, byte for byte, but built as the chunks come: each
1 MiB payload frame of codes is compressed as soon as it is full, so only one
frame of codes, the block scales and the compressed frames are held. The
residual is kept in bfloat16 (2 B/param instead of 4; it is at most half a
quantization step, so its own rounding is ~2^-9 of that). Everything is a pure
function of its inputs, so replaying the log reproduces the same frames and
parameters.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import codec
from codec import format as fmt
from codec.compress import compress_frames
from codec.quant import decode_blocks, encode_blocks
from codec.workspace import workspace
from paramserver.server.chunked_step import JaxViews
from paramserver.server.config import DOWNLINKS
from paramserver.server.outer import aligned_float32

RESIDUAL_DTYPE = np.dtype(ml_dtypes.bfloat16)


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


@jax.jit
def _residual_bits(target: jax.Array, decoded: jax.Array) -> jax.Array:
    """bfloat16(target - decoded) as uint16 bits (round to nearest even; no FMA: two inputs)."""
    return jax.lax.bitcast_convert_type((target - decoded).astype(jnp.bfloat16), jnp.uint16)


class Downlink:
    """Publishes outer updates as int8 increments ("int8"), or not at all ("float32": full values)."""

    def __init__(self, scheme: str = "float32") -> None:
        """Pick the scheme.

        Args:
            scheme: "float32" (publish the new values, mode "full") or "int8"
                (publish the quantized update, mode "increment").
        """
        if scheme not in DOWNLINKS:
            raise DownlinkError(f"downlink {scheme!r} is unknown; choose one of {DOWNLINKS}")
        self.scheme = scheme
        self._codec = codec.int8() if scheme == "int8" else None
        self._decoded = _Scratch()  # one chunk of decoded values, reused by every publication

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
        block, zstd = self._codec.block_size, self._codec.zstd_level
        return Int8Publication(params, residual, block, zstd, self._decoded)


class _Scratch:
    """A reused float32 buffer and its zero-copy JAX views, one per length asked for."""

    def __init__(self) -> None:
        self.buffer = aligned_float32(0)
        self.views = JaxViews()

    def take(self, size: int) -> tuple[np.ndarray, jax.Array]:
        """The first `size` elements, as numpy and as the JAX array sharing them."""
        if size > self.buffer.shape[0]:
            self.buffer, self.views = aligned_float32(size), JaxViews()
        head = self.buffer[:size]
        return head, self.views.of(head)


class Int8Publication:
    """One int8 increment of a fragment, quantized and applied chunk by chunk, framed as it goes.

    Feed `apply` the chunks [lo, hi) in order (lo a multiple of 1 MiB / 4 = 2^18
    divided by a power of two; block-aligned), then take `frames()`.
    """

    def __init__(
        self, params: np.ndarray, residual: np.ndarray, block: int, zstd: int, decoded: _Scratch
    ) -> None:
        """Lay out the message of `params.shape[0]` elements.

        Args:
            params: the fragment's values (aligned float32, updated in place).
            residual: its bfloat16 residual (updated in place).
            block: int8 block size.
            zstd: zstd level of the payload frames.
            decoded: scratch for one chunk's decoded values.
        """
        n = params.shape[0]
        self.params, self.residual_bits = params, residual.view(np.uint16)
        self.block, self.zstd = block, zstd
        (self.tensor,), self.total = fmt.layout(
            "int8", block, None, [(("values",), (n,), "float32")]
        )
        self.full = n // fmt.FRAME_BYTES  # payload frames that hold nothing but codes
        self.window = np.empty(fmt.FRAME_BYTES, np.int8)
        self.tail = np.zeros(self.total - self.full * fmt.FRAME_BYTES, np.uint8)
        start = self.tensor.scales_offset - self.full * fmt.FRAME_BYTES
        self.scales = self.tail[start:].view(np.float32)
        self.decoded = decoded
        self.frames_out: list[Any] = []
        self.entries: list[Any] = []
        self._ws = workspace(block)

    def apply(self, lo: int, hi: int, update: jax.Array) -> None:
        """Quantize one chunk of target = update + residual, apply its decoded values.

        Args:
            lo, hi: the chunk [lo, hi) (lo a multiple of the block size).
            update: the target of [lo, hi) (outer update plus residual, float32).

        Raises:
            DownlinkError: the target is not finite (the chunks before stay applied).
        """
        target = np.asarray(update)
        first = self.full * fmt.FRAME_BYTES
        if lo < first:
            if (lo // fmt.FRAME_BYTES) != ((hi - 1) // fmt.FRAME_BYTES):
                raise DownlinkError(f"chunk [{lo}, {hi}) straddles a payload frame")
            base = lo - lo % fmt.FRAME_BYTES
            codes = self.window[lo - base : hi - base]
        else:
            codes = self.tail[lo - first : hi - first].view(np.int8)
        scales = self.scales[lo // self.block : -(-hi // self.block)]
        with np.errstate(all="ignore"):
            encode_blocks(target, None, None, codes, scales, 127, self._ws)
        if scales.shape[0] and not np.isfinite(scales.max()):
            raise DownlinkError(f"outer update of elements [{lo}, {hi}) is not finite")
        decoded, decoded_j = self.decoded.take(hi - lo)
        decode_blocks(codes, scales, decoded, 127, self._ws)
        np.add(self.params[lo:hi], decoded, out=self.params[lo:hi])
        bits = _residual_bits(update, decoded_j)
        np.copyto(self.residual_bits[lo:hi], np.asarray(bits))
        if hi <= first and hi % fmt.FRAME_BYTES == 0:
            self._compress(memoryview(self.window).cast("B"))

    def _compress(self, payload: memoryview) -> None:
        ranges = [(a, min(a + fmt.FRAME_BYTES, len(payload))) for a in range(0, len(payload), fmt.FRAME_BYTES)]
        frames, entries = compress_frames(payload, ranges, self.zstd, None)
        self.frames_out += frames
        self.entries += entries

    def frames(self) -> list[Any]:
        """The message's frames (header first), once every chunk was applied.

        Returns:
            What `codec.int8().encode({"values": target})` writes for the whole target.
        """
        self._compress(memoryview(self.tail))
        header = fmt.pack_header(
            "int8", self.block, None, self.zstd is not None, [self.tensor], self.total, self.entries
        )
        return [header, *self.frames_out]
