"""Codec frames: their wire format (the one place it is specified, version 1), header and layout.

The specification below is the one every module that writes or reads frames
points to. This module holds what it defines: the constants, where each
tensor's section lies in the payload (`layout`, `TensorLayout`), the header's
packing and its validation before anything is allocated (`pack_header`,
`parse_header`), and the codec's one error type (`CodecError`). The frames'
bytes (the one frame writer `FrameWriter`, zstd, reassembly) are
`codec.payload`'s; the readers are `codec.readers` (`decode`) and
`codec.coded` (`read_coded`, `read_codes`, `frame_codes`); the tree helpers
`codec.tree`'s, the thread pools `codec.parallel`'s; the quantizing
arithmetic is `codec.quant`'s, the error feedback `codec.state`'s.

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

The writer. Every writer of codec frames goes through `FrameWriter`
(`codec.payload`): `Codec.encode` (the
whole payload at once, frames compressed on the codec's pool),
`frame_codes` (codes and scales quantized on a device) and
the shard's int8 downlink (`paramserver.server.step.downlink`, which closes each
1 MiB payload frame as soon as its codes are in). The payload layout is
`layout`'s, the frames are cut every FRAME_BYTES from the start
of the payload and closed by `compress_frames` (zstd or crc32),
and the header lists them, so the same payload gives the same frames byte for
byte whichever way it was written.

The readers validate the header against everything declared
before allocating, reassemble and verify the payload, reconstruct every
tensor in its original dtype and shape. Whatever the input, `decode`
(`codec.readers`) returns a tree or raises CodecError; `read_coded` and
`read_codes` (`codec.coded`) keep a block-scheme tensor's codes instead.
"""

import math
from dataclasses import dataclass

import ml_dtypes
import msgpack
import numpy as np

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
