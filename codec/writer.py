"""The one frame writer: a message's payload layout, its payload frames, its header.

Every writer of codec frames goes through `FrameWriter`: `Codec.encode` (the
whole payload at once, frames compressed on the codec's pool),
`codec.prequantized.frame_codes` (codes and scales quantized on a device) and
the shard's int8 downlink (`paramserver.server.downlink`, which closes each
1 MiB payload frame as soon as its codes are in). The payload layout is
`codec.format.layout`'s, the frames are cut every FRAME_BYTES from the start
of the payload and closed by `codec.compress.compress_frames` (zstd or crc32),
and the header lists them, so the same payload gives the same frames byte for
byte whichever way it was written.
"""

import numpy as np

from . import format as fmt
from .compress import compress_frames
from .errors import CodecError


class FrameWriter:
    """One codec message: lay out its tensors, close its payload frames in order, add the header.

    Attributes:
        tensors: the tensors' `codec.format.TensorLayout`s, in tree order.
        total: payload bytes.
        written: payload bytes closed into frames so far.
    """

    def __init__(
        self,
        scheme: str,
        block: int,
        specs: list,
        zstd_level: int | None,
        store: str | None = None,
        keep: int = 0,
        bits: int = 0,
    ) -> None:
        """Lay out the payload.

        Args:
            scheme: "int8", "int4", "raw" or "topk".
            block: block size, or chunk size for topk (0 for raw).
            specs: (path, shape, dtype name) per tensor, in tree order.
            zstd_level: zstd level of the payload frames, None for none (crc32).
            store: stored dtype name (raw).
            keep, bits: topk settings (ignored otherwise).
        """
        self.scheme, self.block, self.store = scheme, block, store
        self.zstd_level, self.keep, self.bits = zstd_level, keep, bits
        self.tensors, self.total = fmt.layout(scheme, block, store, specs, keep, bits)
        self.written = 0
        self._frames: list = []
        self._entries: list = []

    def close(self, payload: memoryview, executor=None) -> None:
        """Close the next `len(payload)` bytes of the payload into frames.

        Args:
            payload: the payload bytes [written, written + len) as a byte memoryview:
                a whole number of frames, or everything that is left. Without zstd
                the frames are views of it (it must stay unchanged until sent).
            executor: `codec.parallel` pool to compress on, or None (this thread).

        Raises:
            CodecError: the bytes would cut a frame short, or run past the payload.
        """
        size = len(payload)
        end = self.written + size
        if end > self.total or (end < self.total and size % fmt.FRAME_BYTES):
            raise CodecError(
                f"payload bytes [{self.written}, {end}) do not close whole frames of "
                f"a {self.total}-byte payload"
            )
        frames, entries = compress_frames(
            payload, fmt.frame_ranges(size), self.zstd_level, executor
        )
        self._frames += frames
        self._entries += entries
        self.written = end

    def frames(self) -> list:
        """The message: header, then the payload frames.

        Returns:
            Frames ready for `send_multipart`.

        Raises:
            CodecError: part of the payload was not closed.
        """
        if self.written != self.total:
            raise CodecError(f"{self.written} of {self.total} payload bytes were closed")
        header = fmt.pack_header(
            self.scheme, self.block, self.store, self.zstd_level is not None,
            self.tensors, self.total, self._entries, self.keep, self.bits,
        )  # fmt: skip
        return [header, *self._frames]


def block_codes(payload: np.ndarray, t: fmt.TensorLayout, scheme: str) -> np.ndarray:
    """The codes section of a block-scheme tensor in its payload.

    Args:
        payload: the uint8 payload (or any buffer laid out from offset 0 like it).
        t: the tensor's layout.
        scheme: "int8" (int8 codes) or "int4" (packed uint8 bytes).

    Returns:
        A view of the codes.
    """
    codes = payload[t.offset : t.offset + t.codes_bytes]
    return codes.view(np.int8) if scheme == "int8" else codes


def block_scales(payload: np.ndarray, t: fmt.TensorLayout) -> np.ndarray:
    """The float32 block scales of a block-scheme (or topk) tensor in its payload.

    Args:
        payload: the uint8 payload.
        t: the tensor's layout.

    Returns:
        A float32 view of its `t.blocks` scales.
    """
    return payload[t.scales_offset : t.end].view(np.float32)
