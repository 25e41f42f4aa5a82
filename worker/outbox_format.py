"""The bytes of an island's outbox file (``<data_dir>/outbox.bin``): records in, deltas out.

Pure functions, no file handles: `worker.outbox` writes and reads the file with them.

Format version 2 (written since issue 23) is an append-only log:

    MAGIC (b"DILOCO-OUTBOX-2\\n")
    record*   each: body length (8 bytes, big-endian), crc32 of the body (4 bytes,
              big-endian), body (a msgpack map with "kind")

The first record is the header (kind "header": version, island, plan_hash,
created_at). A "delta" record holds one pushed delta (fragment, round,
base_version, tokens, steps, frames: list of bytes); a "resolved" record lists
the (round, fragment) keys of deltas whose fate is known (acked, duplicate or
refused), so they are not pushed again. The live deltas are the delta records
not named by a later resolved record, in file order. A last record cut short
or failing its crc is ignored (a kill -9 in the middle of an append tears
only the last record); a corrupt record with bytes after it makes the file
unusable (`OutboxFileError`: the island sets it aside).

A delta record is built as pieces, never joined (`Record`, issue 37): the
prefix and the msgpack body's head, then per frame its msgpack bin header and
the frame itself where it lies; the crc32 runs over the pieces in order
(`zlib.crc32` chained). The bytes are exactly those `msgpack.packb` makes of
the same map, so files written before and after read the same way.

Format version 1 (written by earlier versions at a graceful stop) is one
snapshot: b"DILOCO-OUTBOX\\n", crc32 of the body (4 bytes, big-endian), body
(msgpack map: version 1, island, plan_hash, saved_at, deltas: list of maps
with fragment, round, base_version, tokens, steps, frames). It is still read.
"""

from __future__ import annotations

import struct
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import msgpack

from paramserver.client import PushRequest

MAGIC = b"DILOCO-OUTBOX-2\n"
MAGIC_V1 = b"DILOCO-OUTBOX\n"
FORMAT_VERSION = 2
_PREFIX = struct.Struct(">QI")  # body length, crc32 of the body
_FIELDS = ("fragment", "round", "base_version", "tokens", "steps")

Key = tuple[int, int]  # (round, fragment): with the island id, the shards' idempotency key
Buffer: TypeAlias = bytes | memoryview
_DELTA_MAP_SIZE = len(_FIELDS) + 2  # the fields, "kind" and "frames"
_MAX_BIN = (1 << 32) - 1  # msgpack's largest bin object


class OutboxFileError(RuntimeError):
    """An outbox file cannot be used; the message names the file and the fault."""


@dataclass
class Scan:
    """What a version-2 outbox file holds.

    `live` maps each live delta's key to (offset, length) of its record in the
    file and the delta itself, in file order; `end` is where the valid records
    end, `torn` how many bytes after it were ignored.
    """

    island: str
    plan_hash: str
    live: dict[Key, tuple[int, int, PushRequest]] = field(default_factory=dict)
    end: int = 0
    torn: int = 0
    records: int = 0


def key_of(delta: PushRequest) -> Key:
    """The (round, fragment) key of a delta."""
    return (int(delta.round), int(delta.fragment))


def _raw(frame: Any) -> Buffer:
    return frame if isinstance(frame, bytes) else memoryview(frame).cast("B")


def _bin_header(size: int) -> bytes:
    """The msgpack header of a bin object of `size` bytes (as `msgpack.packb` writes it)."""
    if size < 1 << 8:
        return b"\xc4" + size.to_bytes(1, "big")
    if size < 1 << 16:
        return b"\xc5" + size.to_bytes(2, "big")
    if size <= _MAX_BIN:
        return b"\xc6" + size.to_bytes(4, "big")
    raise ValueError(f"a frame of {size} bytes is over msgpack's {_MAX_BIN}-byte bin limit")


@dataclass(frozen=True)
class Record:
    """One framed record as the buffers that make it, back to back (written with writev).

    `size` is the record's length in bytes (prefix included); `bytes(record)`
    joins the pieces (a copy: for tests and small records only).
    """

    pieces: tuple[Buffer, ...]
    size: int

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        return b"".join(self.pieces)


def record(body: dict[str, Any]) -> bytes:
    """One framed record: length, crc32, msgpack body.

    Args:
        body: the record's map (with "kind").

    Returns:
        The bytes to append.
    """
    packed = msgpack.packb(body, use_bin_type=True)
    return _PREFIX.pack(len(packed), zlib.crc32(packed)) + packed


def header(island: str, plan_hash: str) -> bytes:
    """MAGIC and the header record of a new file.

    Args:
        island: the island whose deltas the file keeps.
        plan_hash: the plan they are computed for.

    Returns:
        The file's first bytes.
    """
    return MAGIC + record(
        {
            "kind": "header",
            "version": FORMAT_VERSION,
            "island": island,
            "plan_hash": plan_hash,
            "created_at": time.time(),
        }
    )


def delta_record(delta: PushRequest) -> Record:
    """The record of one delta, its frames not copied: pieces and a running crc32.

    The pieces are the bytes `record` would make of the map (fields, "kind":
    "delta", "frames": list of bin), in order: the prefix with the msgpack
    head, then each frame's bin header and the frame itself.

    Args:
        delta: the pushed delta (frames: bytes or any buffer).

    Returns:
        The Record; its pieces reference the delta's frames, so they must stay
        unchanged until it is written.

    Raises:
        ValueError: a frame is over msgpack's bin limit (4 GiB).
    """
    packer = msgpack.Packer(use_bin_type=True)
    frames = [_raw(f) for f in delta.frames]
    head = [packer.pack_map_header(_DELTA_MAP_SIZE)]
    head += [packer.pack(k) + packer.pack(int(getattr(delta, k))) for k in _FIELDS]
    head += [packer.pack("kind"), packer.pack("delta"), packer.pack("frames")]
    head.append(packer.pack_array_header(len(frames)))
    first = b"".join(head)
    body: list[Buffer] = []
    for frame in frames:
        header = _bin_header(memoryview(frame).nbytes)
        if body:
            body += [header, frame]
        else:
            first += header
            body.append(frame)
    length, crc = len(first), zlib.crc32(first)
    for piece in body:
        length += memoryview(piece).nbytes
        crc = zlib.crc32(piece, crc)
    return Record((_PREFIX.pack(length, crc) + first, *body), _PREFIX.size + length)


def resolved_record(keys: Iterable[Key]) -> bytes:
    """The record saying that these deltas need no further push."""
    return record({"kind": "resolved", "keys": [[int(r), int(f)] for r, f in keys]})


def _delta(body: dict[str, Any]) -> PushRequest:
    values = [body[k] for k in _FIELDS]
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ValueError(f"a delta field is not an int: {values}")
    frames = body["frames"]
    if not isinstance(frames, list) or not all(isinstance(f, bytes) for f in frames):
        raise ValueError("frames is not a list of bytes")
    return PushRequest(*values, frames)


def _records(
    data: bytes | memoryview, start: int, name: str
) -> Iterable[tuple[int, int, dict[str, Any]]]:
    """(offset, length, body) of each record from `start`, until a torn last one.

    Raises:
        OutboxFileError: a record that fails its crc or does not parse has bytes
            after it (corruption, not a write cut short).
    """
    offset = start
    view = memoryview(data)
    while offset + _PREFIX.size <= len(view):
        length, crc = _PREFIX.unpack_from(view, offset)
        end = offset + _PREFIX.size + length
        if end > len(view):
            return
        packed = view[offset + _PREFIX.size : end]
        try:
            if zlib.crc32(packed) != crc:
                raise ValueError("checksum mismatch")
            body = msgpack.unpackb(packed, raw=False)
            if not isinstance(body, dict):
                raise ValueError("not a map")
        except (ValueError, msgpack.UnpackException) as exc:
            if end == len(view):
                return  # the last record: a write cut short
            raise OutboxFileError(
                f"{name} is corrupt at byte {offset} ({exc}) with {len(view) - end} bytes after it"
            ) from None
        yield offset, end - offset, body
        offset = end


def scan(data: bytes | memoryview, name: str) -> Scan:
    """Read a version-2 outbox file's bytes: its header and live deltas.

    Args:
        data: the whole file.
        name: the file's name, for messages.

    Returns:
        The Scan; a torn or corrupt tail is left out (`torn` says how many bytes).

    Raises:
        OutboxFileError: not a version-2 file, its header record is unusable, or a
            record before the last is corrupt or malformed.
    """
    if not bytes(data[: len(MAGIC)]) == MAGIC:
        raise OutboxFileError(f"{name} is not an outbox file of format 2 (bad magic)")
    records = iter(_records(data, len(MAGIC), name))
    first = next(records, None)
    if first is None or first[2].get("kind") != "header":
        raise OutboxFileError(f"{name} has no readable header record")
    head = first[2]
    if head.get("version") != FORMAT_VERSION:
        raise OutboxFileError(f"{name} has format version {head.get('version')!r}, not 2")
    out = Scan(str(head.get("island")), str(head.get("plan_hash")))
    out.end, out.records = first[0] + first[1], 1
    for offset, length, body in records:
        try:
            if body.get("kind") == "delta":
                delta = _delta(body)
                out.live[key_of(delta)] = (offset, length, delta)
            elif body.get("kind") == "resolved":
                for r, f in body["keys"]:
                    out.live.pop((int(r), int(f)), None)
            else:
                raise ValueError(f"unknown record kind {body.get('kind')!r}")
        except (KeyError, TypeError, ValueError) as exc:
            raise OutboxFileError(
                f"{name} has a malformed record at byte {offset}: {exc}"
            ) from None
        out.end, out.records = offset + length, out.records + 1
    out.torn = len(data) - out.end
    return out


@dataclass(frozen=True)
class Saved:
    """The live content of an outbox file of either format."""

    island: str
    plan_hash: str
    deltas: list[PushRequest]
    version: int = FORMAT_VERSION
    torn: int = 0


def parse_v1(data: bytes, name: str) -> Saved:
    """Read a version-1 outbox file (one snapshot, written at a graceful stop).

    Args:
        data: the whole file.
        name: its name, for messages.

    Returns:
        Its content.

    Raises:
        OutboxFileError: truncated, corrupt or malformed.
    """
    head = len(MAGIC_V1) + 4
    if not data.startswith(MAGIC_V1) or len(data) < head:
        raise OutboxFileError(f"{name} is not an outbox file (bad magic)")
    body = data[head:]
    if zlib.crc32(body) != int.from_bytes(data[len(MAGIC_V1) : head], "big"):
        raise OutboxFileError(f"{name} is corrupt (checksum mismatch)")
    try:
        obj = msgpack.unpackb(body, raw=False)
        if obj["version"] != 1:
            raise OutboxFileError(f"{name} has format version {obj['version']!r}, not 1")
        deltas = [_delta(d) for d in obj["deltas"]]
        return Saved(str(obj["island"]), str(obj["plan_hash"]), deltas, version=1)
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        raise OutboxFileError(f"{name} is malformed: {exc}") from None


def parse(data: bytes, name: str) -> Saved:
    """Read an outbox file of either format.

    Args:
        data: the whole file.
        name: its name, for messages.

    Returns:
        Its live deltas, in push order.

    Raises:
        OutboxFileError: neither format, or unusable.
    """
    if data.startswith(MAGIC):
        found = scan(data, name)
        deltas = [delta for _, _, delta in found.live.values()]
        return Saved(found.island, found.plan_hash, deltas, torn=found.torn)
    return parse_v1(data, name)


def snapshot(island: str, plan_hash: str, deltas: Sequence[PushRequest]) -> bytes:
    """A whole version-2 file holding exactly `deltas` (a compaction's content).

    Args:
        island: the island id.
        plan_hash: the plan hash.
        deltas: the live deltas, in push order.

    Returns:
        The file's bytes.
    """
    return header(island, plan_hash) + b"".join(bytes(delta_record(d)) for d in deltas)
