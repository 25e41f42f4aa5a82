"""Payload frames: zstd compression, checks, and decompression with bounds.

Owns how the payload becomes frames and back: one zstd frame per payload
piece (content size and checksum always written), one ZstdCompressor per
thread (sharing one across threads crashes), an optional thread pool that
compresses pieces while the next ones are quantized, and decompression that
checks every declared size before it allocates.
"""

import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import zstandard

from .errors import CodecError

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


class FrameSink:
    """Turns a payload, written front to back, into frames as pieces complete.

    Args:
        payload: memoryview of the whole payload.
        ranges: (start, stop) byte range of each frame.
        level: zstd level, or None to send pieces uncompressed.
        pool: ThreadPoolExecutor for compression, or None for inline.
    """

    def __init__(self, payload, ranges, level, pool):
        self._payload, self._ranges, self._level, self._pool = payload, ranges, level, pool
        self._next = 0
        self._results = []

    def ready(self, upto: int) -> None:
        """Hand every frame that lies entirely below byte `upto` to compression.

        Args:
            upto: payload bytes written so far (all earlier bytes final).
        """
        while self._next < len(self._ranges) and self._ranges[self._next][1] <= upto:
            a, b = self._ranges[self._next]
            piece = self._payload[a:b]
            if self._level is None:
                self._results.append(_plain_frame(piece))
            elif self._pool is None:
                self._results.append(_zstd_frame(piece, self._level))
            else:
                self._results.append(self._pool.submit(_zstd_frame, piece, self._level))
            self._next += 1

    def finish(self) -> tuple[list, list]:
        """Wait for all frames.

        Returns:
            (frames, header entries [raw_len, wire_len, check]).
        """
        self.ready(len(self._payload))
        done = [r.result() if hasattr(r, "result") else r for r in self._results]
        return [d[0] for d in done], [d[1] for d in done]

    def cancel(self) -> None:
        """Drop pending work after a failed encode (waits for running tasks)."""
        for r in self._results:
            if hasattr(r, "cancel") and not r.cancel():
                r.exception()


def make_pool(threads: int) -> ThreadPoolExecutor | None:
    """A compression pool, or None for compression in the calling thread.

    Args:
        threads: worker threads; 0 for none.

    Returns:
        ThreadPoolExecutor or None.
    """
    return ThreadPoolExecutor(threads, thread_name_prefix="codec-zstd") if threads > 0 else None


def gather(frames, entries, zstd: bool, total: int, pool=None, reuse: bool = False) -> np.ndarray:
    """Reassemble the payload from its frames, verifying every frame.

    Args:
        frames: payload frames as memoryviews of bytes.
        entries: (raw_len, wire_len, check) per frame from the header.
        zstd: whether frames are zstd frames.
        total: payload bytes (sum of raw_len, already checked).
        pool: ThreadPoolExecutor to decompress frames in parallel, or None.
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
    unpack = _unzstd_into if zstd else _check_into
    if pool is None or len(jobs) < 2:
        for job in jobs:
            unpack(*job)
    else:
        for future in [pool.submit(unpack, *job) for job in jobs]:
            future.result()
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
    out[:] = np.frombuffer(_unzstd(frame, entry[0], entry[2], index), np.uint8)


def _unzstd(frame, raw_len: int, check: int, index: int):
    if len(frame) < 4 or int.from_bytes(frame[-4:], "little") != check:
        raise CodecError(f"frame {index} does not match the header's check (reordered or replaced)")
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError:
        raise CodecError(f"frame {index} is not a zstd frame") from None
    if params.content_size != raw_len or not params.has_checksum:
        raise CodecError(f"frame {index} declares size {params.content_size}, header {raw_len}")
    try:
        data = _decompressor().decompress(frame, max_output_size=raw_len, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise CodecError(f"frame {index} does not decompress: {e}") from None
    if len(data) != raw_len:
        raise CodecError(f"frame {index} decompressed to {len(data)} bytes, expected {raw_len}")
    return data
