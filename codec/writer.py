"""The one frame writer: a message's payload layout, its payload frames, its header.

Every writer of codec frames goes through `FrameWriter`: `Codec.encode` (the
whole payload at once, frames compressed on the codec's pool),
`codec.decode.frame_codes` (codes and scales quantized on a device) and
the shard's int8 downlink (`paramserver.server.downlink`, which closes each
1 MiB payload frame as soon as its codes are in). The payload layout is
`codec.format.layout`'s, the frames are cut every FRAME_BYTES from the start
of the payload and closed by `codec.writer.compress_frames` (zstd or crc32),
and the header lists them, so the same payload gives the same frames byte for
byte whichever way it was written.

Also here, because writing and reading frames share them: zstd compression of
payload frames and their reassembly (`compress_frames`, `gather`: one zstd
object per thread, crc32 when uncompressed), and the codec's thread pools
(`pool`, `run_all`: one shared pool per thread count, and a fork handler, since
a child process starts without its parent's threads).
"""

import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import zstandard

from . import format as fmt
from .format import CodecError


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
            executor: `codec.writer` pool to compress on, or None (this thread).

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


MAX_THREADS = 64
_pools: dict = {}
_lock = threading.Lock()


def check_threads(threads, what: str = "threads") -> int:
    """Validate a thread count.

    Args:
        threads: int in [0, MAX_THREADS] (0: the calling thread only).
        what: the argument's name, for the message.

    Returns:
        threads.
    """
    if not isinstance(threads, int) or isinstance(threads, bool) or not 0 <= threads <= 64:
        raise CodecError(f"{what} must be an int in [0, {MAX_THREADS}], got {threads!r}")
    return threads


class Pool:
    """`threads` workers: the calling thread plus threads - 1 pool threads.

    Attributes:
        executor: ThreadPoolExecutor of the helper threads.
        helpers: threads - 1.
    """

    def __init__(self, threads: int):
        self.helpers = threads - 1
        self.executor = ThreadPoolExecutor(self.helpers, thread_name_prefix="codec")


def pool(threads: int) -> Pool | None:
    """The shared pool of `threads` workers, or None for 0 or 1 thread.

    Args:
        threads: worker count, the calling thread included.

    Returns:
        Pool or None (work runs in the calling thread).
    """
    if threads <= 1:
        return None
    with _lock:
        p = _pools.get(threads)
        if p is None:
            p = _pools[threads] = Pool(threads)
        return p


def run_all(workers: Pool | None, fn, jobs: list) -> list:
    """fn(*job) for every job, spread over the pool's threads; results in order.

    The calling thread works too, and every thread takes the next job from a
    shared counter (one wake-up per helper per call, not one per job). Every
    job has run when this returns or raises, so none still writes into
    buffers the caller reuses; the failure of the first failing job (in job
    order) is re-raised.

    Args:
        workers: Pool or None.
        fn: the work.
        jobs: argument tuples.

    Returns:
        list of results.
    """
    if workers is None or len(jobs) < 2:
        return [fn(*job) for job in jobs]
    results: list = [None] * len(jobs)
    errors: list = []
    order = iter(range(len(jobs)))
    take = threading.Lock()

    def loop() -> None:
        while True:
            with take:
                i = next(order, None)
            if i is None:
                return
            try:
                results[i] = fn(*jobs[i])
            except BaseException as e:  # re-raised in the caller below
                errors.append((i, e))

    helpers = [workers.executor.submit(loop) for _ in range(min(workers.helpers, len(jobs) - 1))]
    loop()
    for h in helpers:
        h.result()
    if errors:
        raise min(errors, key=lambda pair: pair[0])[1]
    return results


def _after_fork() -> None:
    global _lock
    _pools.clear()  # the parent's helper threads do not exist in the child
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)
