"""Single-buffer form of a frame list, for files and logs.

Owns `join` and `split` (layout in codec/format.py's docstring).
"""

import struct

from .format import CodecError

BLOB_MAGIC = b"DDCJ"
MAX_FRAMES = 1 << 24


def join(frames) -> bytes:
    """Concatenate frames into one buffer.

    Args:
        frames: list of bytes-like.

    Returns:
        bytes: magic, frame count, lengths, frames.
    """
    views = [memoryview(f).cast("B") for f in frames]
    head = BLOB_MAGIC + struct.pack(f"<I{len(views)}Q", len(views), *(len(v) for v in views))
    return b"".join([head, *views])


def split(blob) -> list:
    """Invert `join`.

    Args:
        blob: bytes-like produced by `join`.

    Returns:
        list of memoryviews into `blob` (zero-copy).
    """
    try:
        view = memoryview(blob).cast("B")
    except TypeError:
        raise CodecError(f"blob must be bytes-like, got {type(blob).__name__}") from None
    if len(view) < 8 or view[:4] != BLOB_MAGIC:
        raise CodecError("not a joined codec blob (bad magic)")
    (count,) = struct.unpack_from("<I", view, 4)
    start = 8 + 8 * count
    if count > MAX_FRAMES or start > len(view):
        raise CodecError(f"blob declares {count} frames but is only {len(view)} bytes")
    lengths = struct.unpack_from(f"<{count}Q", view, 8)
    if sum(lengths) != len(view) - start:
        raise CodecError("blob frame lengths do not add up to its size (truncated or padded)")
    out, pos = [], start
    for n in lengths:
        out.append(view[pos : pos + n])
        pos += n
    return out
