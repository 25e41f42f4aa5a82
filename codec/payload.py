"""A message's payload frames: the one frame writer, zstd, and the payload's reassembly.

Every writer of codec frames goes through `FrameWriter` (lay out the tensors,
close the payload into frames in order, add the header); `compress_frames`
closes frames (zstd, one compressor per thread, or crc32 when uncompressed)
and `gather` reassembles and verifies a payload from its frames;
`block_codes` / `block_scales` view a block-scheme tensor's sections in a
payload; `frame_views` checks a received message's frames and views them as bytes. The format itself is specified in codec/format.py's docstring.
"""

import threading
import zlib

import numpy as np
import zstandard

from .format import FRAME_BYTES, CodecError, TensorLayout, frame_ranges, layout, pack_header
from .parallel import run_all


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
        self.tensors, self.total = layout(scheme, block, store, specs, keep, bits)
        self.written = 0
        self._frames: list = []
        self._entries: list = []

    def close(self, payload: memoryview, executor=None) -> None:
        """Close the next `len(payload)` bytes of the payload into frames.

        Args:
            payload: the payload bytes [written, written + len) as a byte memoryview:
                a whole number of frames, or everything that is left. Without zstd
                the frames are views of it (it must stay unchanged until sent).
            executor: a `pool` to compress on, or None (this thread).

        Raises:
            CodecError: the bytes would cut a frame short, or run past the payload.
        """
        size = len(payload)
        end = self.written + size
        if end > self.total or (end < self.total and size % FRAME_BYTES):
            raise CodecError(
                f"payload bytes [{self.written}, {end}) do not close whole frames of "
                f"a {self.total}-byte payload"
            )
        frames, entries = compress_frames(payload, frame_ranges(size), self.zstd_level, executor)
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
        header = pack_header(
            self.scheme, self.block, self.store, self.zstd_level is not None,
            self.tensors, self.total, self._entries, self.keep, self.bits,
        )  # fmt: skip
        return [header, *self._frames]


def block_codes(payload: np.ndarray, t: TensorLayout, scheme: str) -> np.ndarray:
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


def block_scales(payload: np.ndarray, t: TensorLayout) -> np.ndarray:
    """The float32 block scales of a block-scheme (or topk) tensor in its payload.

    Args:
        payload: the uint8 payload.
        t: the tensor's layout.

    Returns:
        A float32 view of its `t.blocks` scales.
    """
    return payload[t.scales_offset : t.end].view(np.float32)


_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(
            level=level, write_checksum=True, write_content_size=True
        )
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


def _zstd_frame(buf, level: int) -> tuple:
    data = _compressor(level).compress(buf)
    return data, [len(buf), len(data), int.from_bytes(data[-4:], "little")]


def _plain_frame(buf) -> tuple:
    return buf, [len(buf), len(buf), zlib.crc32(buf)]


def compress_frames(payload, ranges, level, executor) -> tuple[list, list]:
    """Cut a finished payload into frames, compressing them in parallel.

    Args:
        payload: memoryview of the whole payload.
        ranges: (start, stop) byte range of each frame.
        level: zstd level, or None to send pieces uncompressed (crc32 checked).
        executor: parallel.Pool (one zstd compressor per thread) or None for
            the calling thread.

    Returns:
        (frames, header entries [raw_len, wire_len, check]).
    """
    if level is None:
        done = run_all(executor, _plain_frame, [(payload[a:b],) for a, b in ranges])
    else:
        done = run_all(executor, _zstd_frame, [(payload[a:b], level) for a, b in ranges])
    return [d[0] for d in done], [d[1] for d in done]


def gather(frames, entries, zstd: bool, total: int, pool=None, reuse: bool = False) -> np.ndarray:
    """Reassemble the payload from its frames, verifying every frame.

    Args:
        frames: payload frames as memoryviews of bytes.
        entries: (raw_len, wire_len, check) per frame from the header.
        zstd: whether frames are zstd frames.
        total: payload bytes (sum of raw_len, already checked).
        pool: parallel.Pool to decompress frames in parallel, or None.
        reuse: assemble into this thread's scratch buffer (valid until the
            thread's next gather) instead of fresh memory.

    Returns:
        uint8 array holding the payload (writable, so raw tensors can view it).
    """
    for i, (frame, (_, wire_len, _)) in enumerate(zip(frames, entries, strict=True)):
        if len(frame) != wire_len:
            raise CodecError(f"frame {i + 1} has {len(frame)} bytes, header says {wire_len}")
    payload = _scratch(total) if reuse else np.empty(total, np.uint8)
    starts = np.cumsum([0] + [e[0] for e in entries]).tolist()
    jobs = [
        (f, e, payload[a : a + e[0]], i + 1)
        for i, (f, e, a) in enumerate(zip(frames, entries, starts[:-1], strict=True))
    ]
    run_all(pool, _unzstd_into if zstd else _check_into, jobs)
    return payload


def _scratch(total: int) -> np.ndarray:
    buf = getattr(_local, "payload", None)
    if buf is None or buf.shape[0] < total:
        buf = _local.payload = np.empty(total, np.uint8)
    return buf[:total]


def _check_into(frame, entry, out, index: int) -> None:
    if zlib.crc32(frame) != entry[2]:
        raise CodecError(f"frame {index} fails its crc32 (corrupted or reordered)")
    out[:] = np.frombuffer(frame, np.uint8)


def _unzstd_into(frame, entry, out, index: int) -> None:
    raw_len, check = entry[0], entry[2]
    if len(frame) < 4 or int.from_bytes(frame[-4:], "little") != check:
        raise CodecError(f"frame {index} does not match the header's check (reordered or replaced)")
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError:
        raise CodecError(f"frame {index} is not a zstd frame") from None
    if params.content_size != raw_len or not params.has_checksum:
        raise CodecError(f"frame {index} declares size {params.content_size}, header {raw_len}")
    # straight into the payload: no bytes object per frame, no copy; reading one byte
    # past the end consumes the frame's epilogue (its checksum is verified) and finds
    # anything after it
    try:
        reader = _decompressor().stream_reader(frame, read_size=len(frame))
        got = reader.readinto(out)
        extra = reader.read(1)
    except zstandard.ZstdError as e:
        raise CodecError(f"frame {index} does not decompress: {e}") from None
    if got != raw_len:
        raise CodecError(f"frame {index} decompressed to {got} bytes, expected {raw_len}")
    if extra:
        raise CodecError(f"frame {index} does not decompress: data after its zstd frame")


def frame_views(frames) -> list:
    """The frames as 1-D byte memoryviews; CodecError unless a non-empty list of bytes-like."""
    if isinstance(frames, bytes | bytearray | memoryview | str) or not hasattr(frames, "__len__"):
        raise CodecError("frames must be a list of bytes-like objects")
    if len(frames) == 0:
        raise CodecError("no frames: a codec message has at least its header frame")
    views = []
    for i, f in enumerate(frames):
        try:
            v = memoryview(f)
            views.append(v if v.format == "B" and v.ndim == 1 else v.cast("B"))
        except TypeError:
            raise CodecError(f"frame {i} is not bytes-like ({type(f).__name__})") from None
    return views
