"""Codec frames: their wire format (the one place it is specified, version 1), writer and readers.

One concept, the frame format, in one module: the layout and header below,
the one frame writer (`FrameWriter`) and the readers (`decode`, `read_coded`,
`read_codes`). It is longer than 700 lines because a reader and the writer
change with the format they share, and keeping them beside its specification
is what lets one review see all three; the quantizing arithmetic they call is
`codec.quant`'s, the error feedback `codec.state`'s.

Revision history (all version 1; a reader rejects a scheme it does not know,
so adding one never changes how existing frames read): int8/int4/raw first;
then ``topk`` (sparse top-k, keys ``keep`` and ``bits``).

A codec message is a list of frames, ready for ZeroMQ ``send_multipart``:

``frames[0]``: the header, one msgpack map (string keys; unknown keys are
ignored by readers)::

    magic     "ddcodec"
    version   1                         (FORMAT_VERSION; readers reject others)
    scheme    "int8" | "int4" | "raw" | "topk"
    block     elements per quantization block (int8, int4) or per chunk
              (topk, at most 65536); 0 for raw
    keep      topk only: entries kept per full chunk, 1 <= keep <= block
    bits      topk only: bits per kept value, 2 or 4
    store     "float32" | "bfloat16": the stored element type (raw); nil otherwise
    zstd      true when each payload frame is one zstd frame (writers skip
              zstd with zstd_level=None, for links faster than the
              compressor: see the codec package docstring)
    payload   total length in bytes of the (uncompressed) payload
    tensors   list of [path, shape, dtype, offset]:
                path   list of str, the keys from the tree root to the leaf
                shape  list of int
                dtype  "float32" | "float16" | "bfloat16": what decode returns
                offset byte offset of the tensor's section in the payload
    frames    list of [raw_len, wire_len, check], one per payload frame:
                raw_len   bytes of payload this frame carries
                wire_len  len(frame) as sent
                check     zstd: the frame's 4-byte content checksum (its last 4
                          bytes, little endian); no zstd: crc32 of the frame

``frames[1:]``: the payload, cut in order into pieces of FRAME_BYTES (1 MiB;
the last one shorter) regardless of tensor boundaries, every piece
zstd-compressed on its own (content size and content checksum written) or
sent as is. Concatenated (after decompression) they give the payload. An empty
tree has no payload frames.

Payload: one section per tensor, in tree order (keys sorted at each level),
each section starting at a multiple of 8 bytes (zero padding between). With
``n`` elements and ``b = ceil(n / block)`` blocks:

- int8: ``n`` int8 codes ``q`` in [-127, 127], then (from the next multiple of
  4 bytes) ``b`` float32 block absmax values ``m`` (little endian).
  Value = ``q * (m * float32(1/127))`` in float32.
- int4: ``ceil(n / 2)`` bytes, element ``2i`` in the low nibble and ``2i+1`` in
  the high nibble, each nibble ``q + 8`` with ``q`` in [-7, 7] (an odd count
  pads the last high nibble with 8); then, 4-aligned, ``b`` float32 absmax
  values.
  Value = ``q * (m * float32(1/7))`` in float32.
- raw: ``n`` elements of ``store`` (little endian).
- topk: the tensor is cut into ``c = ceil(n / block)`` chunks; chunk ``i``
  holds ``w_i = min(block, n - i * block)`` elements and keeps
  ``k_i = ceil(keep * w_i / block)`` of them (integer arithmetic: ``keep`` for
  a full chunk), ``K = sum k_i`` in all. The section holds, back to back:
  ``K`` bytes, the low bytes of the offset codes, then ``K`` bytes, their high
  bytes (uint16 ``d = lo | hi << 8``); then ``ceil(K * bits / 8)`` bytes of
  value codes; then (from the next multiple of 4 bytes) ``c`` float32 chunk
  scales ``m``. Entries are listed chunk by chunk, offsets ascending within a
  chunk; offset codes are gaps: a chunk's first entry sits at chunk-local
  offset ``d``, each next one ``d + 1`` after the previous (so the offsets are
  ``cumsum(d + 1) - 1``; readers reject an offset ``>= w_i``). Value codes are
  packed little end first (bits 2: entry ``4i + r`` in bits ``2r..2r+1`` of
  byte ``i``; bits 4: entry ``2i`` in the low nibble), unused high bits zero;
  each is ``s << (bits - 1) | j`` with sign ``s`` and level ``j`` in
  ``[0, L)``, ``L = 2**(bits - 1)``. Value = ``float32(2j + 1) * (m *
  float32(1 / (2L)))``, negated when ``s`` is 1; every element not listed is
  0. Writers keep the ``k_i`` entries of largest magnitude, set ``m`` to the
  chunk's absmax (0 below 2**-118) and ``j = min(floor(|x| * L / m), L - 1)``.

Decoded values are cast to the tensor's dtype. The last block of a tensor may
be short. Blocks never span tensors. Writers round ``x * (L / m)`` to the
nearest integer (or stochastically), write ``m = 0`` for blocks whose absmax is
below 2**-118, and saturate raw bfloat16 values at the largest finite
bfloat16; readers reject negative or non-finite ``m``. Error feedback is the
writer's business and leaves no trace in the format.

A single-buffer form for files and logs (`codec.join` / `codec.split`):
``b"DDCJ"``, uint32 frame count, then one uint64 length per frame (all little
endian), then the frames back to back.

The writer. Every writer of codec frames goes through `FrameWriter`: `Codec.encode` (the
whole payload at once, frames compressed on the codec's pool),
`frame_codes` (codes and scales quantized on a device) and
the shard's int8 downlink (`paramserver.server.step.downlink`, which closes each
1 MiB payload frame as soon as its codes are in). The payload layout is
`layout`'s, the frames are cut every FRAME_BYTES from the start
of the payload and closed by `compress_frames` (zstd or crc32),
and the header lists them, so the same payload gives the same frames byte for
byte whichever way it was written.

Beside the writer, because writing and reading frames share them: zstd compression of
payload frames and their reassembly (`compress_frames`, `gather`: one zstd
object per thread, crc32 when uncompressed), and the codec's thread pools
(`pool`, `run_all`: one shared pool per thread count, and a fork handler, since
a child process starts without its parent's threads).

The readers validate the header against everything declared
before allocating, reassemble and verify the payload, reconstruct every
tensor in its original dtype and shape. Whatever the input, `decode` returns
a tree or raises CodecError.

Two readers keep a block-scheme tensor's codes instead of decoding it:
`read_coded` gives `CodedTensor`s (the shard keeps each pending delta so, about
1 B/param, and dequantizes a range at a time at the merge: `decode_into`), and
`read_codes` gives a `Coded` (an island dequantizes an increment's codes on its
devices). `frame_codes` goes the other way for codes quantized elsewhere (on an
accelerator, `codec.quant.jax_rule`): it frames them with the one frame writer, byte
for byte as `Codec.encode` would.

Also here: the codec's one error type (`CodecError`) and the tree helpers that
name a tensor by its path (`flatten`, `unflatten`, `leaf_items`, `build_tree`).
"""

import math
import os
import threading
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import ml_dtypes
import msgpack
import numpy as np
import zstandard

from .quant import decode_blocks, scratch, sum_squares_int8, workspace
from .quant_rule import step_factor
from .sparse import decode_topk, topk_entries

MAGIC = "ddcodec"
FORMAT_VERSION = 1
FRAME_BYTES = 1 << 20
MAX_FRAME_RAW = 1 << 26
DEFAULT_MAX_ELEMENTS = 1 << 31
MAX_NDIM = 32
ALIGN = 8
SCHEMES = ("int8", "int4", "raw", "topk")
MAX_CHUNK = 1 << 16  # topk offsets are uint16
TOPK_BITS = (2, 4)
LEVELS = {"int8": 127, "int4": 7}
DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}
STORES = ("float32", "bfloat16")


@dataclass(frozen=True)
class TensorLayout:
    """Where one tensor lives in the payload.

    Attributes:
        path: keys from the root to the leaf.
        shape: array shape.
        dtype: dtype name the tensor decodes to.
        size: element count.
        offset: byte offset of the section.
        codes_bytes: bytes of codes (quantized) or of stored values (raw).
        blocks: number of blocks (0 for raw), chunks for topk.
        kept: entries a topk section lists (0 for other schemes).
    """

    path: tuple
    shape: tuple
    dtype: str
    size: int
    offset: int
    codes_bytes: int
    blocks: int
    kept: int = 0

    @property
    def scales_offset(self) -> int:
        """Byte offset of the block absmax values (quantized schemes)."""
        return self.offset + -(-self.codes_bytes // 4) * 4

    @property
    def end(self) -> int:
        """Byte offset just after the section."""
        return self.scales_offset + 4 * self.blocks


def topk_kept(size: int, chunk: int, keep: int) -> int:
    """Entries a topk section of `size` elements lists.

    Args:
        size: element count.
        chunk: elements per chunk.
        keep: entries kept per full chunk.

    Returns:
        sum over chunks of ceil(keep * chunk_length / chunk).
    """
    full, rem = divmod(size, chunk)
    return full * keep + -(-keep * rem // chunk)


def layout(
    scheme: str, block: int, store: str | None, specs: list, keep: int = 0, bits: int = 0
) -> tuple[list, int]:
    """Place tensors in the payload.

    Args:
        scheme: "int8", "int4", "raw" or "topk".
        block: block size, or chunk size for topk (ignored for raw).
        store: stored dtype name for raw.
        specs: (path, shape, dtype name) per tensor, in tree order.
        keep, bits: topk settings (ignored otherwise).

    Returns:
        (list of TensorLayout, total payload bytes).
    """
    out = []
    pos = 0
    for path, shape, dtype in specs:
        size = math.prod(shape)
        pos = -(-pos // ALIGN) * ALIGN
        kept = 0
        if scheme == "raw":
            codes, blocks = size * DTYPES[store].itemsize, 0
        elif scheme == "topk":
            kept = topk_kept(size, block, keep)
            codes, blocks = 2 * kept + -(-kept * bits // 8), -(-size // block)
        else:
            codes = size if scheme == "int8" else (size + 1) // 2
            blocks = -(-size // block)
        t = TensorLayout(tuple(path), tuple(shape), dtype, size, pos, codes, blocks, kept)
        out.append(t)
        pos = t.end
    return out, pos


def frame_ranges(total: int) -> list[tuple[int, int]]:
    """Cut the payload into frame byte ranges.

    Args:
        total: payload bytes.

    Returns:
        (start, stop) per payload frame, FRAME_BYTES each but the last.
    """
    return [(a, min(a + FRAME_BYTES, total)) for a in range(0, total, FRAME_BYTES)]


def pack_header(
    scheme: str,
    block: int,
    store: str | None,
    zstd: bool,
    tensors: list,
    total: int,
    frames: list,
    keep: int = 0,
    bits: int = 0,
) -> bytes:
    """Serialize a header (frame 0).

    Args:
        scheme, block, store, zstd: codec settings, as in the module docstring.
        tensors: TensorLayout list.
        total: payload bytes.
        frames: [raw_len, wire_len, check] per payload frame.
        keep, bits: topk settings (written for topk only).

    Returns:
        msgpack bytes.
    """
    extra = {"keep": keep, "bits": bits} if scheme == "topk" else {}
    return msgpack.packb(
        {
            **extra,
            "magic": MAGIC,
            "version": FORMAT_VERSION,
            "scheme": scheme,
            "block": block,
            "store": store,
            "zstd": zstd,
            "payload": total,
            "tensors": [[list(t.path), list(t.shape), t.dtype, t.offset] for t in tensors],
            "frames": frames,
        }
    )


@dataclass(frozen=True)
class Header:
    """A parsed, validated header.

    Attributes:
        scheme, block, store, zstd: codec settings.
        tensors: TensorLayout list (recomputed and checked against the offsets).
        total: payload bytes.
        frames: (raw_len, wire_len, check) per payload frame.
        keep, bits: topk settings (0 otherwise).
    """

    scheme: str
    block: int
    store: str | None
    zstd: bool
    tensors: list
    total: int
    frames: list
    keep: int = 0
    bits: int = 0


def _need(cond: bool, reason: str) -> None:
    if not cond:
        raise CodecError(f"bad header: {reason}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_header(buf, num_payload_frames: int, max_elements: int) -> Header:
    """Parse and validate frame 0 before anything is allocated.

    Args:
        buf: the header frame (bytes-like).
        num_payload_frames: how many frames follow the header.
        max_elements: upper bound on the total declared element count.

    Returns:
        Header.
    """
    try:
        obj = msgpack.unpackb(buf, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises many types on garbage
        raise CodecError(f"header is not valid msgpack ({type(e).__name__})") from None
    _need(isinstance(obj, dict) and obj.get("magic") == MAGIC, "not a codec header")
    version = obj.get("version")
    if version != FORMAT_VERSION:
        raise CodecError(
            f"unsupported format version {version!r} (this build reads {FORMAT_VERSION})"
        )
    scheme, block, store = obj.get("scheme"), obj.get("block"), obj.get("store")
    _need(scheme in SCHEMES, f"unknown scheme {scheme!r}")
    keep = bits = 0
    if scheme == "raw":
        _need(store in STORES, f"unknown raw store dtype {store!r}")
        block = 0
    elif scheme == "topk":
        _need(_is_int(block) and 1 <= block <= MAX_CHUNK, f"topk chunk size {block!r}")
        keep, bits = obj.get("keep"), obj.get("bits")
        _need(_is_int(keep) and 1 <= keep <= block, f"topk keep {keep!r}")
        _need(_is_int(bits) and bits in TOPK_BITS, f"topk bits {bits!r}")
        store = None
    else:
        _need(_is_int(block) and 1 <= block <= 1 << 24, f"block size {block!r}")
        _need(scheme != "int4" or block % 2 == 0, "int4 block size must be even")
        store = None
    zstd = obj.get("zstd")
    _need(isinstance(zstd, bool), "zstd flag")
    specs = _parse_tensors(obj.get("tensors"), max_elements)
    tensors, total = layout(scheme, block, store, specs, keep, bits)
    _need(obj.get("payload") == total, "payload size does not match the tensor shapes")
    for t, entry in zip(tensors, obj["tensors"], strict=True):
        _need(entry[3] == t.offset, f"offset of {'/'.join(t.path)!r} does not match its shape")
    frames = _parse_frames(obj.get("frames"), num_payload_frames, total)
    return Header(scheme, block, store, zstd, tensors, total, frames, keep, bits)


def _parse_tensors(entries, max_elements: int) -> list:
    _need(isinstance(entries, list), "tensors must be a list")
    specs, paths, elements = [], set(), 0
    for e in entries:
        _need(
            isinstance(e, list) and len(e) >= 4, "tensor entry must be [path, shape, dtype, offset]"
        )
        path, shape, dtype, offset = e[:4]
        _need(
            isinstance(path, list) and path and all(isinstance(k, str) for k in path),
            "tensor path must be a non-empty list of str",
        )
        name = "/".join(path)
        _need(tuple(path) not in paths, f"tensor {name!r} appears twice")
        paths.add(tuple(path))
        _need(
            isinstance(shape, list)
            and len(shape) <= MAX_NDIM
            and all(_is_int(d) and d >= 0 for d in shape),
            f"shape of {name!r}",
        )
        _need(dtype in DTYPES, f"dtype {dtype!r} of {name!r}")
        _need(_is_int(offset), f"offset of {name!r}")
        elements += math.prod(shape)
        if elements > max_elements:
            raise CodecError(
                f"header declares more than max_elements={max_elements} elements; "
                "refusing to allocate (raise max_elements if this is expected)"
            )
        specs.append((path, shape, dtype))
    return specs


def _parse_frames(entries, count: int, total: int) -> list:
    _need(isinstance(entries, list), "frames must be a list")
    if len(entries) != count:
        raise CodecError(f"header lists {len(entries)} payload frames, {count} arrived")
    frames, pos = [], 0
    for e in entries:
        _need(isinstance(e, list) and len(e) >= 3, "frame entry must be [raw_len, wire_len, check]")
        raw_len, wire_len, check = e[:3]
        _need(_is_int(raw_len) and 1 <= raw_len <= MAX_FRAME_RAW, f"frame raw length {raw_len!r}")
        _need(_is_int(wire_len) and wire_len >= 0, f"frame wire length {wire_len!r}")
        _need(_is_int(check) and 0 <= check < 1 << 32, "frame check")
        frames.append((raw_len, wire_len, check))
        pos += raw_len
    _need(pos == total, "frame lengths do not add up to the payload size")
    return frames


class CodecError(ValueError):
    """Bad input to the codec: malformed frames, non-finite tensors, misuse."""


Path = tuple[str, ...]


def leaf_items(tree: Mapping) -> list[tuple[Path, object]]:
    """Walk a tree in sorted key order.

    Args:
        tree: mapping name -> leaf, nested mappings allowed.

    Returns:
        list of (path, leaf), path being the tuple of keys down to the leaf.
        Empty sub-mappings contribute nothing.
    """
    if not isinstance(tree, Mapping):
        raise CodecError(f"a tree must be a mapping of name -> array, got {type(tree).__name__}")
    out: list[tuple[Path, object]] = []
    _walk(tree, (), out)
    return out


def _walk(node: Mapping, prefix: Path, out: list) -> None:
    for key in node:
        if not isinstance(key, str):
            raise CodecError(f"tree keys must be str, got {key!r} under {'/'.join(prefix)!r}")
    for key in sorted(node):
        value = node[key]
        if isinstance(value, Mapping):
            _walk(value, (*prefix, key), out)
        else:
            out.append(((*prefix, key), value))


def build_tree(items: list[tuple[Path, object]]) -> dict:
    """Inverse of `leaf_items`: nest leaves under their paths.

    Args:
        items: (path, leaf) pairs; paths must be distinct and no path may be a
            prefix of another.

    Returns:
        nested dict.
    """
    root: dict = {}
    for path, leaf in items:
        node = root
        for key in path[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise CodecError(f"name {'/'.join(path)!r} nests under a leaf")
            node = child
        if path[-1] in node:
            raise CodecError(f"name {'/'.join(path)!r} appears twice or is also a subtree")
        node[path[-1]] = leaf
    return root


def flatten(tree: Mapping) -> dict:
    """Flatten nested mappings to one level with "/"-joined names.

    Args:
        tree: mapping name -> array, nested mappings allowed; keys may not
            contain "/".

    Returns:
        dict "a/b" -> array in sorted name order.
    """
    flat = {}
    for path, leaf in leaf_items(tree):
        for key in path:
            if "/" in key or not key:
                raise CodecError(f"key {key!r} in {'/'.join(path)!r} is empty or contains '/'")
        flat["/".join(path)] = leaf
    return flat


def unflatten(flat: Mapping) -> dict:
    """Invert `flatten`: split "/"-joined names into nested dicts.

    Args:
        flat: mapping "a/b" -> array.

    Returns:
        nested dict.
    """
    items = []
    for name, leaf in flat.items():
        if not isinstance(name, str) or not name or "" in name.split("/"):
            raise CodecError(f"flat name {name!r} must be a non-empty str without empty parts")
        items.append((tuple(name.split("/")), leaf))
    return build_tree(items)


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


PIECE_ELEMENTS = 1 << 18  # elements per parallel dequantize job
SQUARES_PIECE = 1 << 16  # elements decoded at a time by CodedTensor.sum_squares (not int8)


def _views(frames) -> list:
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


def decode(frames, max_elements: int = DEFAULT_MAX_ELEMENTS, threads: int = 0, out=None) -> dict:
    """Decode frames written by any codec scheme.

    Args:
        frames: list of bytes-like (bytes, memoryview, zmq.Frame), header first.
        max_elements: refuse headers declaring more elements than this
            (checked before anything is allocated or decompressed).
        threads: decompress payload frames and dequantize on this many
            threads (0 or 1: the calling thread only).
        out: None, or a tree of the message's names holding writable
            C-contiguous arrays of each tensor's shape and encoded dtype, to
            decode into (reusing them saves writing fresh memory, the largest
            cost of decoding a big message after zstd). Checked against the
            header before anything is decompressed; on a CodecError raised
            later its arrays may hold part of the message.

    Returns:
        nested dict of arrays in their encoded dtype and shape (writable,
        C-contiguous): the arrays of `out`, or else views into one fresh
        buffer per message (one allocation, whose fresh pages cost far less
        than one per tensor), which lives as long as any of them does.
    """
    try:
        workers = pool(check_threads(threads))
        views = _views(frames)
        header = parse_header(views[0], len(views) - 1, max_elements)
        given = None if out is None else _given(header, out)
        # raw tensors are returned as views of the payload (without `out`); others only read it
        reuse = header.scheme != "raw" or given is not None
        payload = gather(views[1:], header.frames, header.zstd, header.total, workers, reuse)
        if given is not None:
            targets = [a.reshape(-1) for a in given]
        else:
            arena = None if header.scheme == "raw" else _Arena(header)
            targets = [None if arena is None else arena.take(t) for t in header.tensors]
        with np.errstate(all="ignore"):
            outs, jobs = [], []
            for t, dst in zip(header.tensors, targets, strict=True):
                leaf, more = _tensor(header, t, payload, dst)
                outs.append(leaf)
                jobs += more
            run_all(workers, run_job, jobs)
        outs = outs if given is None else given
        return build_tree([(t.path, o) for t, o in zip(header.tensors, outs, strict=True)])
    except CodecError:
        raise
    except Exception as e:  # safety net: decode must only ever raise CodecError
        raise CodecError(f"malformed frames ({type(e).__name__}: {e})") from None


def _section(payload: np.ndarray, offset: int, count: int, dtype) -> np.ndarray:
    return payload[offset : offset + count * np.dtype(dtype).itemsize].view(dtype)


def run_job(fn, *args) -> None:
    """Run one decode job (numpy warnings off: the checks raise CodecError instead)."""
    with np.errstate(all="ignore"):  # thread-local: set in the thread that computes
        fn(*args)


def _given(header, out) -> list:
    """`out`'s arrays in header order, once each fits its tensor."""
    have = dict(leaf_items(out))
    want = [t.path for t in header.tensors]
    if set(have) != set(want):
        names = sorted("/".join(p) for p in set(have) ^ set(want))
        raise CodecError(
            f"out does not hold the message's tensors (differs at {', '.join(names[:5])}); "
            "pass a tree of the same names as the encoded one"
        )
    arrays = []
    for t in header.tensors:
        a, name, dtype = have[t.path], "/".join(t.path), DTYPES[t.dtype]
        if not isinstance(a, np.ndarray) or a.shape != t.shape or a.dtype != dtype:
            got = f"{getattr(a, 'shape', '?')} {getattr(a, 'dtype', type(a).__name__)}"
            raise CodecError(f"out {name!r} is {got}; the message holds {t.shape} {dtype}")
        if not (a.flags.writeable and a.flags.c_contiguous):
            raise CodecError(f"out {name!r} must be a writable C-contiguous array")
        arrays.append(a)
    return arrays


class _Arena:
    """One output buffer for every decoded (non-raw) tensor of a message."""

    ALIGN = 64

    def __init__(self, header):
        self._buf = np.empty(sum(self._span(t) for t in header.tensors), np.uint8)
        self._pos = 0

    def _span(self, t) -> int:
        return -(-t.size * DTYPES[t.dtype].itemsize // self.ALIGN) * self.ALIGN

    def take(self, t) -> np.ndarray:
        """The next tensor's 1-D output array (contents undefined)."""
        dtype = DTYPES[t.dtype]
        a = self._pos
        self._pos += self._span(t)
        return self._buf[a : a + t.size * dtype.itemsize].view(dtype)


def _tensor(header, t, payload: np.ndarray, out: np.ndarray | None) -> tuple:
    """A tensor's output array and the jobs that fill it (none when it is done).

    `out` is its 1-D destination, or None for a raw tensor returned as it comes
    (a view of the payload, or a cast of it).
    """
    dtype = DTYPES[t.dtype]
    if header.scheme == "raw":
        store = DTYPES[header.store]
        flat = _section(payload, t.offset, t.size, store)
        if out is not None:
            np.copyto(out, flat, casting="unsafe")
            return out.reshape(t.shape), []
        if store == dtype:
            return flat.reshape(t.shape), []  # zero-copy: a writable view of the payload
        return flat.astype(dtype).reshape(t.shape), []
    scales = _section(payload, t.scales_offset, t.blocks, np.float32)
    if t.blocks and not (np.isfinite(scales.max()) and scales.min() >= 0):
        raise CodecError(f"tensor {'/'.join(t.path)!r} has a non-finite or negative block scale")
    if header.scheme == "topk":
        section = payload[t.offset : t.offset + t.codes_bytes]
        try:
            decode_topk(section, scales, t, header.block, header.keep, header.bits, out)
        except ValueError as e:
            raise CodecError(f"tensor {'/'.join(t.path)!r}: {e}") from None
        return out.reshape(t.shape), []
    return out.reshape(t.shape), block_jobs(t, payload, scales, out, header.scheme, header.block)


def block_jobs(t, payload: np.ndarray, scales: np.ndarray, out: np.ndarray, scheme: str, bs: int):
    """The jobs that dequantize one block-scheme tensor of an uncompressed payload into `out`.

    Args:
        t: the tensor's layout (`codec.format`).
        payload: the message's uncompressed payload (uint8).
        scales: the tensor's block scales (float32).
        out: its 1-D output array.
        scheme: "int8" or "int4".
        bs: the block size.

    Returns:
        (function, *args) jobs, each filling one piece of `out` (run them with `run_job`).
    """
    levels = LEVELS[scheme]
    code_type = np.uint8 if levels == 7 else np.int8
    codes = _section(payload, t.offset, t.codes_bytes, code_type)
    step = 2 if levels == 7 else 1
    piece = max(bs, (PIECE_ELEMENTS // bs) * bs)
    return [
        (_dequantize, codes[a // step : -(-b // step)], scales[a // bs : -(-b // bs)], out[a:b],
         levels, bs)
        for a in range(0, t.size, piece)
        for b in [min(a + piece, t.size)]
    ]  # fmt: skip


def _dequantize(codes, scales, out, levels, block) -> None:
    decode_blocks(codes, scales, out, levels, workspace(block))


F32 = np.float32


@dataclass(frozen=True)
class CodedTensor:
    """One tensor of a message, kept coded (see the module docstring).

    Attributes:
        path: keys from the tree root to the leaf.
        shape: the decoded array's shape.
        dtype: dtype name the tensor decodes to.
        scheme: "int8", "int4", "raw" or "topk".
        block: elements per quantization block (int8, int4; 0 otherwise).
        codes: int8 codes (int8), packed uint8 nibbles (int4), stored values
            (raw), or int32 positions (topk).
        scales: float32 block absmax values (int8, int4), topk values, or an
            empty array (raw).
    """

    path: tuple
    shape: tuple
    dtype: str
    scheme: str
    block: int
    codes: np.ndarray
    scales: np.ndarray

    @property
    def size(self) -> int:
        """Element count."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        """Bytes this tensor keeps (codes and scales)."""
        return int(self.codes.nbytes + self.scales.nbytes)

    def all_finite(self) -> bool:
        """Whether every decoded element is finite (what `codec.decode` would return).

        Returns:
            For int8/int4: whether a full-scale code of the largest block scale
            decodes to a finite float32 (decoding is monotone in the scale, so
            then every element does); for raw and topk: whether the kept
            values are finite.
        """
        if self.scheme in ("int8", "int4"):
            if not self.scales.size:
                return True
            levels = LEVELS[self.scheme]
            with np.errstate(over="ignore"):
                top = F32(levels) * (F32(self.scales.max()) * step_factor(levels))
            return bool(np.isfinite(top))
        values = self.scales if self.scheme == "topk" else self.codes
        # max/min propagate NaN and expose +-inf without a temporary array
        return not values.size or bool(np.isfinite(values.max()) and np.isfinite(values.min()))

    def decode_into(self, lo: int, hi: int, out: np.ndarray) -> None:
        """Write decoded elements [lo, hi) of the flattened tensor into `out`.

        For a float32 tensor these are exactly `codec.decode`'s values (for
        other dtypes, the float32 values decode casts from).

        Args:
            lo, hi: 0 <= lo <= hi <= size.
            out: float32 array of hi - lo elements.

        Raises:
            CodecError: a bad range or output.
        """
        if not 0 <= lo <= hi <= self.size or out.shape != (hi - lo,) or out.dtype != F32:
            raise CodecError(
                f"decode_into({lo}, {hi}) of {self.size} elements needs a float32 "
                f"array of {hi - lo}, got {out.dtype} {out.shape}"
            )
        if self.scheme == "raw":
            np.copyto(out, self.codes[lo:hi], casting="unsafe")
        elif self.scheme == "topk":
            out[:] = 0
            a, b = np.searchsorted(self.codes, (lo, hi))
            out[self.codes[a:b] - lo] = self.scales[a:b]
        else:
            self._dequantize(lo, hi, out)

    def sum_squares(self, lo: int = 0, hi: int | None = None) -> float:
        """Sum of the squares of decoded elements [lo, hi), in float64 (an L2 norm's square).

        int8: from the codes and block scales in one pass (`quant.sum_squares_int8`,
        within 2**-23 relative of the sum over the decoded values). Other
        schemes: decoded SQUARES_PIECE elements at a time, each piece's squares
        summed by a float64 dot product.

        Args:
            lo, hi: the range (hi None: to the end).

        Returns:
            The sum.
        """
        hi = self.size if hi is None else hi
        if self.scheme == "int8":
            return sum_squares_int8(self.codes, self.scales, lo, hi, self.block)
        buf = np.empty(min(SQUARES_PIECE, max(hi - lo, 0)), F32)
        wide = np.empty(buf.shape[0], np.float64)
        total = 0.0
        for a in range(lo, hi, SQUARES_PIECE):
            b = min(a + SQUARES_PIECE, hi)
            self.decode_into(a, b, buf[: b - a])
            np.copyto(wide[: b - a], buf[: b - a])
            total += float(np.dot(wide[: b - a], wide[: b - a]))
        return total

    def _dequantize(self, lo: int, hi: int, out: np.ndarray) -> None:
        bs = self.block
        a, b = lo - lo % bs, min(self.size, -(-hi // bs) * bs)  # whole blocks
        dst = out if (a, b) == (lo, hi) else scratch("coded_blocks", b - a, F32)
        levels = LEVELS[self.scheme]
        per = 2 if levels == 7 else 1
        codes = self.codes[a // per : -(-b // per)]
        decode_blocks(codes, self.scales[a // bs : -(-b // bs)], dst, levels, workspace(bs))
        if dst is not out:
            out[:] = dst[lo - a : hi - a]


def read_coded(frames, max_elements: int = DEFAULT_MAX_ELEMENTS) -> list[CodedTensor]:
    """The tensors of a codec message, validated and kept coded.

    Args:
        frames: list of bytes-like (bytes, memoryview, zmq.Frame), header first.
        max_elements: refuse headers declaring more elements than this
            (checked before anything is allocated or decompressed).

    Returns:
        One CodedTensor per tensor, in tree order. They keep no reference to
        `frames`: the tensors of one int8/int4/raw message share one buffer
        holding its decompressed payload.

    Raises:
        CodecError: anything `codec.decode` refuses.
    """
    try:
        views = _views(frames)
        header = parse_header(views[0], len(views) - 1, max_elements)
        # topk keeps its decoded entries, not the payload: assemble it in scratch memory
        reuse = header.scheme == "topk"
        payload = gather(views[1:], header.frames, header.zstd, header.total, reuse=reuse)
        with np.errstate(all="ignore"):
            return [_coded_tensor(header, t, payload) for t in header.tensors]
    except CodecError:
        raise
    except Exception as e:  # safety net: like decode, read_coded only ever raises CodecError
        raise CodecError(f"malformed frames ({type(e).__name__}: {e})") from None


def _coded_section(payload: np.ndarray, offset: int, nbytes: int, dtype) -> np.ndarray:
    return payload[offset : offset + nbytes].view(dtype)


def _coded_tensor(header: Header, t: TensorLayout, payload: np.ndarray) -> CodedTensor:
    name = "/".join(t.path)
    if header.scheme == "raw":
        store = DTYPES[header.store]
        codes = _coded_section(payload, t.offset, t.codes_bytes, store)
        return CodedTensor(t.path, t.shape, t.dtype, "raw", 0, codes, np.empty(0, F32))
    scales = _coded_section(payload, t.scales_offset, 4 * t.blocks, F32)
    if t.blocks and not (np.isfinite(scales.max()) and scales.min() >= 0):
        raise CodecError(f"tensor {name!r} has a non-finite or negative block scale")
    if header.scheme == "topk":
        section = payload[t.offset : t.offset + t.codes_bytes]
        if not t.kept:
            empty = np.empty(0, np.int32), np.empty(0, F32)
            return CodedTensor(t.path, t.shape, t.dtype, "topk", 0, *empty)
        try:
            pos, values = topk_entries(section, scales, t, header.block, header.keep, header.bits)
        except ValueError as e:
            raise CodecError(f"tensor {name!r}: {e}") from None
        index = np.int32 if t.size < 1 << 31 else np.int64
        return CodedTensor(t.path, t.shape, t.dtype, "topk", 0, pos.astype(index), values)
    code_type = np.int8 if header.scheme == "int8" else np.uint8
    codes = _coded_section(payload, t.offset, t.codes_bytes, code_type)
    return CodedTensor(t.path, t.shape, t.dtype, header.scheme, header.block, codes, scales)


def from_array(values, path: tuple = ("delta",)) -> CodedTensor:
    """A raw float32 CodedTensor holding a 1-D array (no copy when it is float32 already).

    Args:
        values: a 1-D float array.
        path: the tensor's path.

    Returns:
        The CodedTensor (scheme raw).
    """
    flat = np.ascontiguousarray(values, dtype=F32)
    if flat.ndim != 1:
        raise CodecError(f"from_array takes a 1-D array, got shape {flat.shape}")
    return CodedTensor(tuple(path), flat.shape, "float32", "raw", 0, flat, np.empty(0, F32))


def code_dtype(scheme: str) -> np.dtype:
    """The dtype of a block scheme's codes: int8 (one per element) or uint8 (two int4 per byte).

    Args:
        scheme: "int8" or "int4".

    Returns:
        np.int8 or np.uint8.
    """
    _check_scheme(scheme)
    return np.dtype(np.int8 if scheme == "int8" else np.uint8)


def _check_scheme(scheme: str) -> None:
    if scheme not in LEVELS:
        raise CodecError(f"pre-quantized codes are int8 or int4, not {scheme!r}")


def frame_codes(
    scheme: str,
    block: int,
    zstd_level: int | None,
    codes: np.ndarray,
    scales: np.ndarray,
    size: int,
    name: str = "delta",
) -> list:
    """The frames of one 1-D float32 tensor given as its codes and block scales.

    Args:
        scheme: "int8" or "int4".
        block: elements per quantization block.
        zstd_level: zstd level of the payload frames, None for none (as the codec's).
        codes: int8 [size] (int8) or uint8 [ceil(size / 2)] (int4, packed as the format says).
        scales: float32 [ceil(size / block)] block absmax values (0 for flushed blocks).
        size: the tensor's element count.
        name: the tensor's name in the tree (a decoder returns {name: values}).

    Returns:
        Frames (header first), equal to `Codec.encode({name: x}, state)`'s for the
        input whose quantization gave these codes and scales.

    Raises:
        CodecError: bad scheme, codes or scales of the wrong dtype or length, or a
            non-finite or negative scale (the input held NaN or Inf).
    """
    _check_scheme(scheme)
    codes, scales = np.asarray(codes), np.asarray(scales)
    writer = FrameWriter(scheme, block, [((name,), (size,), "float32")], zstd_level)
    (t,) = writer.tensors
    if codes.dtype != code_dtype(scheme) or codes.shape != (t.codes_bytes,):
        raise CodecError(
            f"{scheme} codes of {size} elements must be {code_dtype(scheme)}[{t.codes_bytes}], "
            f"got {codes.dtype}{list(codes.shape)}"
        )
    if scales.dtype != np.float32 or scales.shape != (t.blocks,):
        raise CodecError(
            f"scales of {size} elements in blocks of {block} must be float32[{t.blocks}], "
            f"got {scales.dtype}{list(scales.shape)}"
        )
    if t.blocks and not (np.isfinite(scales.max()) and scales.min() >= 0):
        raise CodecError(f"tensor {name!r} contains NaN or Inf; nothing was encoded")
    payload = np.zeros(writer.total, np.uint8)
    block_codes(payload, t, scheme)[...] = codes
    block_scales(payload, t)[...] = scales
    writer.close(memoryview(payload).cast("B"))
    return writer.frames()


@dataclass(frozen=True)
class Coded:
    """One block-quantized 1-D tensor as it travels: codes and scales, not yet dequantized.

    Attributes:
        scheme: "int8" or "int4".
        block: elements per block.
        size: element count.
        codes: int8 [size] or packed uint8 [ceil(size / 2)].
        scales: float32 [ceil(size / block)], finite and >= 0.
        dtype: the dtype name the tensor decodes to.
    """

    scheme: str
    block: int
    size: int
    codes: np.ndarray
    scales: np.ndarray
    dtype: str = "float32"

    @property
    def levels(self) -> int:
        """127 (int8) or 7 (int4)."""
        return LEVELS[self.scheme]

    @property
    def nbytes(self) -> int:
        """Bytes of codes and scales."""
        return self.codes.nbytes + self.scales.nbytes

    def values(self) -> np.ndarray:
        """The dequantized tensor, bit for bit what `codec.decode` gives for its frames.

        Returns:
            A fresh 1-D float32 array of `size` elements.
        """
        (t,), _ = layout(self.scheme, self.block, None, [(("x",), (self.size,), "float32")])
        codes = self.codes.view(np.uint8)  # a lone tensor's section starts at offset 0
        out = np.empty(self.size, DTYPES[self.dtype])
        for job in block_jobs(t, codes, self.scales, out, self.scheme, self.block):
            run_job(*job)
        return out.astype(np.float32, copy=False)


def read_codes(frames, name: str, max_elements: int = DEFAULT_MAX_ELEMENTS) -> Coded | None:
    """The codes and scales of frames holding one 1-D int8 or int4 tensor.

    Args:
        frames: codec frames (bytes-like), header first.
        name: the tensor's expected name (a top-level key of the tree).
        max_elements: refuse headers declaring more elements (as `codec.decode`).

    Returns:
        The tensor as codes and scales, or None when the frames hold another
        scheme (raw, topk) or anything but one 1-D tensor named `name`.

    Raises:
        CodecError: malformed frames, or a non-finite or negative scale.
    """
    try:
        views = [memoryview(f).cast("B") for f in frames]
    except TypeError:
        raise CodecError("frames must be a list of bytes-like objects") from None
    if not views:
        raise CodecError("no frames: a codec message has at least its header frame")
    header = parse_header(views[0], len(views) - 1, max_elements)
    if header.scheme not in LEVELS or len(header.tensors) != 1:
        return None
    (t,) = header.tensors
    if len(t.shape) != 1 or t.path != (name,):
        return None
    payload = gather(views[1:], header.frames, header.zstd, header.total)
    codes = block_codes(payload, t, header.scheme)
    scales = block_scales(payload, t)
    if t.blocks and not (np.isfinite(scales.max()) and scales.min() >= 0):
        raise CodecError(f"tensor {'/'.join(t.path)!r} has a non-finite or negative block scale")
    return Coded(header.scheme, header.block, t.size, codes, scales, t.dtype)
