"""An island's outbox file: every delta is written there before it leaves, until its fate is known.

One concept, the outbox, in one module: its bytes (records in, deltas out:
pure functions, no file handles) and the file an island keeps of them. Its
length (past 700 lines) is the file format's specification and its two
readers (version 1 and 2) beside the writer that appends, compacts and
rewrites: a reader changes with the format it reads.

The file (``<data_dir>/outbox.bin``) while an island runs (process 0, the
one with a client): `Outbox.open` reads what a previous run left (either
format; a torn last record, from a kill -9 in the middle of an append, is
ignored), sets aside a file it cannot use (another island or plan,
unreadable: renamed, never deleted) and rewrites the rest compactly. Before
each batch of pushes (`worker.push_thread.deliver`: one round's fragments, or
one streamed fragment) `Outbox.record` appends a "resolved" record for the
deltas the island's ledger of deltas (`worker.deltas`) saw acked or refused
since the last batch, then a record per new delta, with one fsync for the
batch; only then are the deltas handed to the client. A batch is written with
`os.writev` (in runs of at most IOV_MAX buffers) straight from the deltas'
frames: no record is ever joined in memory (issue 37). The outbox keeps no
fate of its own: its index (`live`) maps each live delta to its bytes in the
file. When the resolved records dominate the file (it is over twice its live
records and over `COMPACT_MIN_BYTES`), the batch is written as a fresh file
instead: the live records (copied file to file by the kernel,
`os.copy_file_range`) and the new ones, fsynced, renamed over the old,
directory fsynced. So the file stays within about twice the unacked deltas
(at most `max_unacked` plus a batch) however long the island runs.

After a kill -9 the next start with the same island id and data dir pushes
the live deltas again (`Outbox.resend`), with their round ids and base
versions, before any new round: the shards' (island, round, fragment) dedup
answers `duplicate` for those they had accepted (only the ack was lost), so
each counts exactly once; only the round being computed is lost. At a
graceful stop `Outbox.keep` rewrites the file with exactly what the client
left unacked after its flush, and removes it when that is nothing.

The bytes. Format version 2 (written since issue 23) is an append-only log:

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

import contextlib
import errno
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import msgpack

from paramserver.client import Client, PushRequest

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


logger = logging.getLogger(__name__)

OUTBOX_FILE = "outbox.bin"
COMPACT_MIN_BYTES = 1 << 20  # below this size the file is never rewritten to drop resolved deltas
COMPACT_FACTOR = 2  # rewrite once the file is over this many times its live records
COPY_CHUNK_BYTES = 64 << 20  # a record copied without copy_file_range goes in reads of this size
# errors of copy_file_range that mean "not here" (old kernel, file system): copy by reading
_NO_COPY_RANGE = {errno.ENOSYS, errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP}


def iov_max() -> int:
    """The most buffers one `os.writev` takes here (IOV_MAX: 1024 on Linux; 16 if unknown)."""
    try:
        limit = os.sysconf("SC_IOV_MAX")
    except (ValueError, OSError):
        limit = -1
    return limit if limit > 0 else 16


IOV_MAX = iov_max()

__all__ = ["OUTBOX_FILE", "Outbox", "OutboxFileError", "Saved", "load", "set_aside"]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, buffers: Iterable[Buffer]) -> int:
    """Write the buffers back to back at the file position: `os.writev`, IOV_MAX at a time.

    Nothing is joined: a delta's frames go from where they lie. A short write
    (a signal, a nearly full disk) goes on with the rest.

    Args:
        fd: the file, at the position to write.
        buffers: bytes-like pieces, in order (empty ones are skipped).

    Returns:
        The bytes written (the buffers' total size).

    Raises:
        OSError: a write failed, or made no progress (ENOSPC); part may be written.
    """
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
    total, first = 0, 0
    while first < len(views):
        batch = views[first : first + IOV_MAX]
        written = os.writev(fd, batch)
        if written <= 0:
            raise OSError(errno.ENOSPC, "writev wrote nothing")
        total += written
        for view in batch:  # skip what went out; a buffer cut short keeps its rest
            if written < view.nbytes:
                views[first] = view[written:]
                break
            written -= view.nbytes
            first += 1
    return total


def copy_range(src: int, dst: int, offset: int, length: int) -> None:
    """Copy `length` bytes at `offset` of `src` to the file position of `dst`.

    `os.copy_file_range` where the kernel and file system have it (no bytes
    through this process), else reads of `COPY_CHUNK_BYTES`.

    Raises:
        OSError: a read or write failed, or `src` ends before `offset + length`.
    """
    while length:
        try:
            moved = os.copy_file_range(src, dst, length, offset)
        except (AttributeError, OSError) as exc:
            if isinstance(exc, OSError) and exc.errno not in _NO_COPY_RANGE:
                raise
            chunk = os.pread(src, min(length, COPY_CHUNK_BYTES), offset)
            moved = write_all(dst, [chunk]) if chunk else 0
        if moved <= 0:
            raise OSError(errno.EIO, f"outbox file ends {length} bytes before a live record does")
        offset, length = offset + moved, length - moved


@dataclass(frozen=True)
class _Kept:
    """A record already in the open file, at `offset` for `length` bytes (copied, not read)."""

    offset: int
    length: int

    def __len__(self) -> int:
        return self.length


def load(path: Path) -> Saved | None:
    """Read an outbox file of either format (for tools and tests).

    Args:
        path: the file.

    Returns:
        Its live deltas (a torn tail left out), or None when there is no file.

    Raises:
        OutboxFileError: it is not an outbox file, or unusable.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    return parse(data, str(path))


def set_aside(path: Path, why: str) -> Path:
    """Rename an outbox file this island cannot use, so that it is kept but not re-read.

    Args:
        path: the outbox file.
        why: what is wrong with it (logged).

    Returns:
        The new name.
    """
    aside = path.with_name(f"{path.name}.unused-{time.time_ns()}")
    os.replace(path, aside)
    logger.warning("outbox file %s not used (%s); kept as %s", path, why, aside)
    return aside


def should_compact(size: int, live: int) -> bool:
    """Whether a file of `size` bytes holding `live` bytes of live records is rewritten.

    Args:
        size: the file's size after the pending write.
        live: its live records' bytes after it (header excluded).

    Returns:
        True when resolved records dominate: over `COMPACT_FACTOR` x live and
        over `COMPACT_MIN_BYTES`.
    """
    return size > max(COMPACT_FACTOR * live, COMPACT_MIN_BYTES)


class Outbox:
    """The open outbox file of a running island; every method is thread-safe."""

    def __init__(self, path: Path, island: str, plan_hash: str) -> None:
        """An outbox of `island` at `path`, not open yet: use `open`, which reads what is there."""
        self.path, self.island, self.plan_hash = path, island, plan_hash
        self.to_resend: list[PushRequest] = []  # live deltas of a previous run (until resent)
        self.newest_round = -1  # the newest round id the file held at open
        self.persist_s = 0.0  # seconds spent writing and fsyncing
        self.bytes_written = 0
        self.compactions = 0
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._live: dict[Key, tuple[int, int]] = {}  # key -> (offset, length) in the file
        self._size = 0  # the file's size
        self._live_bytes = 0
        self._broken = False  # the last write failed: the next one rewrites the file

    @classmethod
    def open(cls, path: Path, island: str, plan_hash: str) -> Outbox:
        """Take over the outbox file: read what a previous run left, rewrite it compactly.

        Args:
            path: the file (``<data_dir>/outbox.bin``).
            island: this island's id.
            plan_hash: the joined cluster's plan hash.

        Returns:
            The open Outbox; `to_resend` holds the previous run's live deltas.

        Raises:
            OSError: the file cannot be written.
        """
        box = cls(path, island, plan_hash)
        saved = box._read_previous()
        if saved is not None:
            box.to_resend = list(saved.deltas)
            box.newest_round = max((d.round for d in saved.deltas), default=-1)
        with box._lock:
            box._rewrite([(key_of(d), delta_record(d)) for d in box.to_resend])
        return box

    def _read_previous(self) -> Saved | None:
        try:
            saved = load(self.path)
        except OutboxFileError as exc:
            set_aside(self.path, str(exc))
            return None
        if saved is None:
            return None
        if saved.island != self.island or saved.plan_hash != self.plan_hash:
            set_aside(
                self.path,
                f"it holds deltas of island {saved.island!r} for plan {saved.plan_hash}; "
                f"this is island {self.island!r} with plan {self.plan_hash}",
            )
            return None
        if saved.torn:
            logger.warning(
                "outbox file %s: %d bytes after its last intact record ignored (a write cut short)",
                self.path,
                saved.torn,
            )
        if saved.version != FORMAT_VERSION:
            logger.info("outbox file %s: format %d read, rewritten as format 2", self.path,
                        saved.version)  # fmt: skip
        return saved

    # -- what the file holds --------------------------------------------------------

    @property
    def live(self) -> list[Key]:
        """Keys of the deltas in the file whose fate is not known yet, oldest first."""
        with self._lock:
            return list(self._live)

    @property
    def size(self) -> int:
        """The file's size in bytes (0 once closed and removed)."""
        return self._size

    # -- writes -----------------------------------------------------------------------

    def resend(self, client: Client, stop: threading.Event) -> int:
        """Push the deltas a previous run left (`to_resend`), with their round ids.

        Call it right after `Client.join`, before pushing new rounds (a delta far
        older than the newest round a shard saw from the island is refused there
        as `replayed_round`).

        Args:
            client: the joined client.
            stop: the island's stop event (a push never blocks once it is set).

        Returns:
            How many deltas were pushed again.
        """
        deltas, self.to_resend = self.to_resend, []
        for d in deltas:
            client.push_request(d, stop=stop)  # the kept request, whole
        if deltas:
            logger.info("island %s: re-sent %d deltas kept in %s", self.island, len(deltas),
                        self.path)  # fmt: skip
        return len(deltas)

    def record(self, resolved: Iterable[Key], deltas: Sequence[PushRequest]) -> None:
        """Mark `resolved` deltas done and append `deltas`, durably (one fsync), in one write.

        A failed write is logged (the deltas are pushed unpersisted: a kill -9
        would lose them); the next write rewrites the file whole.

        Args:
            resolved: keys of live deltas that need no further push.
            deltas: new deltas, in push order.
        """
        t0 = time.perf_counter()
        with self._lock:
            if self._fd is None:
                return  # closed (an abandoned session): the client is closed too
            gone = [k for k in resolved if k in self._live]
            for k in gone:
                self._live_bytes -= self._live.pop(k)[1]
            new: list[tuple[Key, Record]] = [(key_of(d), delta_record(d)) for d in deltas]
            if not new and not gone:
                return
            head = resolved_record(gone) if gone else b""
            added = len(head) + sum(len(r) for _, r in new)
            live = self._live_bytes + sum(len(r) for _, r in new)
            try:
                if self._broken or should_compact(self._size + added, live):
                    self._rewrite(new)
                else:
                    self._append(head, new)
                self._broken = False
            except OSError as exc:
                self._broken = True
                logger.error(
                    "island %s: cannot persist %d deltas to %s (%s): pushed unpersisted, a "
                    "kill -9 now loses them",
                    self.island,
                    len(new),
                    self.path,
                    exc,
                )
        self.persist_s += time.perf_counter() - t0

    def _append(self, head: bytes, new: list[tuple[Key, Record]]) -> None:
        assert self._fd is not None
        offset = self._size + len(head)
        written = write_all(self._fd, [head, *(p for _, rec in new for p in rec.pieces)])
        os.fdatasync(self._fd)
        self._size += written
        self.bytes_written += written
        for key, rec in new:
            self._live[key] = (offset, len(rec))
            self._live_bytes += len(rec)
            offset += len(rec)

    def _rewrite(self, new: list[tuple[Key, Record]]) -> None:
        """Write a fresh file of the live records and `new` ones; rename it over the old one."""
        kept = [(k, _Kept(at, n)) for k, (at, n) in self._live.items()]
        self._replace([*kept, *new])

    def _replace(self, records: Sequence[tuple[Key, Record | _Kept]]) -> None:
        """Write a fresh file: header, then `records` (new ones written, kept ones copied)."""
        head = header(self.island, self.plan_hash)
        tmp = self.path.with_name(self.path.name + ".tmp")
        # no O_APPEND: copy_file_range refuses such a target; the position only moves forward
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            pending: list[Buffer] = [head]
            for _, rec in records:
                if isinstance(rec, _Kept):
                    assert self._fd is not None
                    write_all(fd, pending)
                    pending = []
                    copy_range(self._fd, fd, rec.offset, rec.length)
                else:
                    pending += rec.pieces
            write_all(fd, pending)
            os.fsync(fd)
            os.replace(tmp, self.path)
        except BaseException:
            os.close(fd)
            raise
        size = len(head) + sum(len(rec) for _, rec in records)
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._size = fd, size
        self.bytes_written += size
        self.compactions += 1
        self._live, offset = {}, len(head)
        for key, rec in records:
            self._live[key] = (offset, len(rec))
            offset += len(rec)
        self._live_bytes = offset - len(head)
        _fsync_dir(self.path.parent)

    # -- the end ----------------------------------------------------------------------

    def close(self) -> None:
        """Close the file as it is (a session that failed to open: nothing is lost)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def keep(self, unacked: list[PushRequest]) -> bool:
        """At the island's stop: leave exactly `unacked` in the file (none: remove it), close.

        Args:
            unacked: `Client.unacked()` after `close`, in push order.

        Returns:
            Whether the file now holds exactly `unacked` (False: the write failed, logged).
        """
        with self._lock:
            if self._fd is None:
                return True
            try:
                if unacked:
                    records: list[tuple[Key, Record | _Kept]] = []
                    for d in unacked:
                        at = self._live.get(key_of(d))
                        rec = _Kept(*at) if at else delta_record(d)
                        records.append((key_of(d), rec))
                    self._replace(records)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        self.path.unlink()
                    _fsync_dir(self.path.parent)
                    self._size = 0
            except OSError as exc:
                logger.error(
                    "island %s: %d unacked deltas may be lost: cannot write %s: %s",
                    self.island,
                    len(unacked),
                    self.path,
                    exc,
                )
                return False
            finally:
                os.close(self._fd)
                self._fd = None
        if unacked:
            logger.warning(
                "island %s stopped with %d unacked deltas: kept in %s, sent again at the next "
                "start with this data dir",
                self.island,
                len(unacked),
                self.path,
            )
        return True
