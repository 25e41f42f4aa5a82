"""The write-ahead log: its records (what an event is on disk) and its files (append, fsync, read back).

Records (`event_to_record`, `record_to_event`): what the records of a shard's
log mean (the events are `paramserver.server.fragment`').

Log records (msgpack header + raw payload):

    init    {"t": "init", "plan": wire plan, "fragments": [[index, size], ...]}
            payload: the fragments' float32 values back to back (a whole `init`)
    init_begin {"t": "init_begin", "plan": wire plan, "island": id}
    init_piece {"t": "init_piece", "fragment": index, "offset": first element}
            payload: the piece's float32 values (one record per piece, so no
            record grows with the model)
    accept  {"t": "accept", island, round, fragment, base_version, tokens,
            steps, arrived, codec: [frame lengths] or nil, floor?: the push's
            `floor`, absent when it had none}; payload: the codec
            frames as received, back to back (read again on replay into the
            same coded pending delta: `codec.coded.read_coded` is deterministic), or
            the float32 delta when codec is nil (an event built without frames)
    step    {"t": "step", fragment, keys: [[island, round], ...], at, expected,
            momentum?, outside?: [[path, fragment, [[island, round], ...], [float64 row-major]], ...]}
            (expected: the islands the step's round expected; absent in older
            logs, read as 0: a whole round; outside: an RDA step's PieceGrams;
            absent when none; momentum?: "bfloat16" when the step kept the
            outer momentum in it, absent for float32)

Files (`WriteAheadLog`, `LogReader`): one append-only log segment of framed,
checksummed records, and replay that stops at a torn tail. A segment is
created whole (`write_whole`: its header written to a temporary file renamed
into place), so one that exists always has its header.

File format (all integers little endian):

    file header   8 bytes magic b"DDWAL\x00\x00\x00", uint32 format version
                  (WAL_FORMAT_VERSION), uint32 crc32 of the previous 12 bytes
    record*       uint32 body length N, uint32 crc32 of the body, body (N bytes)
    body          uint32 header length H, H bytes msgpack map (the record
                  header), then the raw payload (N - 4 - H bytes)

An accepted delta's record is its codec frames as received, written as they
are (`writev` of the received buffers). Its checksum is not computed over
them again: a frame sent without zstd carries the CRC-32 of its bytes in the
codec header, checked on receipt, and the record's CRC-32 is combined from
those (`crc32_combine`, a few microseconds per frame) with the CRC-32 of the
rest; frames sent with zstd (whose check is the zstd content checksum) are
checksummed as before. The file is the same either way.

Appends go straight to the file descriptor (`writev`, in batches of at most
IOV_MAX buffers: a record may hold any number of frames), so a
record survives the death of the process as soon as `append` returns; `sync`
(fsync) makes it survive the machine. A failed write (disk full, file-size
limit, read-only or I/O error) raises `OSError` and leaves the file as it was
before the record (the partial record is cut off); a failed `sync` raises and
cuts the file back to what the last good `sync` covered, so the log never
holds a record that was not durable when it was acknowledged. Replay yields
records in order and:

- stops at a torn tail, the unfinished last record of a crash (too few bytes
  for its prefix or body, or a bad checksum on a record that ends the file):
  it logs a warning with the byte offset and byte count dropped, and exposes
  `torn_at` / `end_offset` so the caller can truncate before appending again;
- raises `WalError` on a bad checksum of a record followed by more data
  (corruption in the middle is never skipped silently), a bad file header or
  an unknown format version.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from codec.coded import CodedTensor, from_array, read_coded
from paramserver.plumbing.private import open_private
from paramserver.server.fragment import (
    AcceptEvent,
    Contribution,
    Event,
    InitBeginEvent,
    InitEvent,
    InitPieceEvent,
    PieceGram,
    StepEvent,
)


def _piece_gram(item: Any) -> PieceGram:
    path, fragment, keys, flat = item
    keys = tuple((str(island), int(rnd)) for island, rnd in keys)
    gram = np.asarray(flat, dtype=np.float64).reshape(len(keys), len(keys))
    return PieceGram(str(path), int(fragment), keys, gram)


_CRC_POLY = 0xEDB88320  # zlib's CRC-32, reflected


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC-32 polynomial (reflected bit order), as zlib computes it."""
    m, product = 1 << 31, 0
    while True:
        if a & m:
            product ^= b
            if (a & (m - 1)) == 0:
                return product
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..31
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))
_SHIFTS: dict[int, int] = {}  # bytes -> x^(8 * bytes) modulo the polynomial


def _shift(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial (cached: most frames are 1 MiB)."""
    op = _SHIFTS.get(nbytes)
    if op is None:
        op, n, k = 1 << 31, nbytes, 3
        while n:
            if n & 1:
                op = _multmodp(_X2N[k & 31], op)
            n >>= 1
            k += 1
        if len(_SHIFTS) < 64:
            _SHIFTS[nbytes] = op
    return op


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 (zlib's) of A + B from crc32(A), crc32(B) and len(B), without reading them.

    Args:
        crc1: zlib.crc32 of the first part.
        crc2: zlib.crc32 of the second part.
        len2: bytes of the second part.

    Returns:
        zlib.crc32 of the two back to back.
    """
    return _multmodp(_shift(len2), crc1) ^ crc2


def frame_checks(frames: Sequence[Any]) -> list[int | None]:
    """The CRC-32 of each codec frame that its codec header vouches for, else None.

    A frame sent without zstd carries zlib.crc32 of its bytes in the header's
    `frames` list, checked when the delta was read on receipt; the codec
    header frame itself and zstd frames have none.

    Args:
        frames: a codec message's frames as received (header first).

    Returns:
        One entry per frame.
    """
    none: list[int | None] = [None] * len(frames)
    try:
        header = msgpack.unpackb(memoryview(frames[0]), raw=False)
        entries = header["frames"]
        if header.get("zstd") or len(entries) != len(frames) - 1:
            return none
        checks = [int(e[2]) for e in entries]
        sizes = [int(e[1]) for e in entries]
    except Exception:  # noqa: BLE001 - any doubt: compute every checksum
        return none
    if any(memoryview(f).nbytes != n for f, n in zip(frames[1:], sizes, strict=True)):
        return none
    return [None, *checks]


def event_to_record(event: Event) -> tuple[dict[str, Any], list[np.ndarray]]:
    """The log record of an event.

    Args:
        event: InitEvent, AcceptEvent or StepEvent.

    Returns:
        (record header, payload arrays).
    """
    if isinstance(event, AcceptEvent):
        c = event.contribution
        header = {
            "t": "accept",
            "island": c.island,
            "round": c.round,
            "fragment": c.fragment,
            "base_version": c.base_version,
            "tokens": c.tokens,
            "steps": c.steps,
            "arrived": c.arrived,
        }
        if c.floor is not None:
            header["floor"] = c.floor
        if event.frames is not None:
            header["codec"] = [memoryview(f).nbytes for f in event.frames]
            return header, list(event.frames)
        header["codec"] = None
        values = np.empty(c.delta.size, np.float32)
        c.delta.decode_into(0, c.delta.size, values)
        return header, [values]
    if isinstance(event, StepEvent):
        header = {
            "t": "step",
            "fragment": event.fragment,
            "keys": [list(k) for k in event.keys],
            "at": event.at,
            "expected": event.expected,
        }
        if event.momentum_dtype != "float32":  # absent: float32 (and logs from before it)
            header["momentum"] = event.momentum_dtype
        if event.outside:
            header["outside"] = [
                [g.path, g.fragment, [list(k) for k in g.keys], g.gram.ravel().tolist()]
                for g in event.outside
            ]
        return header, []
    if isinstance(event, InitEvent):
        order = sorted(event.values)
        header = {
            "t": "init",
            "plan": event.plan_wire,
            "fragments": [[i, int(event.values[i].shape[0])] for i in order],
        }
        return header, [np.ascontiguousarray(event.values[i], dtype=np.float32) for i in order]
    if isinstance(event, InitBeginEvent):
        return {"t": "init_begin", "plan": event.plan_wire, "island": event.island}, []
    if isinstance(event, InitPieceEvent):
        header = {"t": "init_piece", "fragment": event.fragment, "offset": event.offset}
        return header, [np.ascontiguousarray(event.values, dtype=np.float32)]
    raise TypeError(f"not an event: {type(event).__name__}")


def record_to_event(record: Record) -> Event:
    """Inverse of `event_to_record`.

    Args:
        record: a record read back from the log.

    Returns:
        The event.

    Raises:
        WalError: an unknown or inconsistent record.
    """
    h = record.header
    try:
        kind = h["t"]
        if kind == "accept":
            lengths = h.get("codec")
            if lengths is None:
                delta = from_array(np.frombuffer(record.payload, dtype=np.float32))
            else:
                frames, offset = [], 0
                view = memoryview(record.payload)
                for n in lengths:
                    frames.append(view[offset : offset + n])
                    offset += n
                if offset != len(view):
                    raise ValueError(f"payload has {len(view)} bytes, frames need {offset}")
                delta = _coded_delta(frames)
            c = Contribution(
                h["island"],
                h["round"],
                h["fragment"],
                h["base_version"],
                h["tokens"],
                h["steps"],
                h["arrived"],
                delta,
                floor=h.get("floor"),
            )
            return AcceptEvent(c)
        if kind == "step":
            keys = tuple((str(island), int(rnd)) for island, rnd in h["keys"])
            outside = tuple(_piece_gram(g) for g in h.get("outside", ()))
            expected = int(h.get("expected", 0))
            kept = str(h.get("momentum", "float32"))
            return StepEvent(int(h["fragment"]), keys, float(h["at"]), outside, expected, kept)
        if kind == "init":
            flat = np.frombuffer(record.payload, dtype=np.float32)
            values, offset = {}, 0
            for index, size in h["fragments"]:
                values[int(index)] = flat[offset : offset + size]
                offset += size
            if offset != flat.shape[0]:
                raise ValueError(f"payload has {flat.shape[0]} values, fragments need {offset}")
            return InitEvent(h["plan"], values)
        if kind == "init_begin":
            return InitBeginEvent(h["plan"], str(h["island"]))
        if kind == "init_piece":
            values = np.frombuffer(record.payload, dtype=np.float32)
            return InitPieceEvent(int(h["fragment"]), int(h["offset"]), values)
    except (KeyError, TypeError, ValueError) as exc:  # codec.CodecError is a ValueError
        raise WalError(f"log record at byte {record.offset} is inconsistent: {exc!r}") from exc
    raise WalError(f"log record at byte {record.offset} has unknown type {h.get('t')!r}")


def _coded_delta(frames: list) -> CodedTensor:
    """The coded delta of an accept record's frames (raises ValueError: not one 'delta')."""
    tensors = read_coded(frames)
    if len(tensors) != 1 or tensors[0].path != ("delta",):
        raise ValueError(f"frames hold {[t.path for t in tensors]}, not one 'delta'")
    return tensors[0]


logger = logging.getLogger(__name__)

WAL_MAGIC = b"DDWAL\x00\x00\x00"
WAL_FORMAT_VERSION = 1
_FILE_HEADER = struct.Struct("<8sII")
_PREFIX = struct.Struct("<II")
_HLEN = struct.Struct("<I")
# A record body larger than this is treated as a garbage length field.
MAX_RECORD_BYTES = 1 << 31


class WalError(RuntimeError):
    """The log cannot be read safely (bad header, corrupted record in the middle)."""


@dataclass(frozen=True)
class Record:
    """One log record: its msgpack header, raw payload and byte offset in the file."""

    header: dict[str, Any]
    payload: bytes
    offset: int


def _file_header() -> bytes:
    head = struct.pack("<8sI", WAL_MAGIC, WAL_FORMAT_VERSION)
    return head + struct.pack("<I", zlib.crc32(head))


def write_whole(path: Path, fill: Callable[[int], None], fsync: bool) -> None:
    """Write the file `path` so that a crash leaves it whole or absent (or as it was).

    `fill` writes a temporary file beside it (``.<name>.tmp-<pid>``, mode 0600);
    that file is fsynced, renamed over `path`, and the directory synced. On any
    failure the temporary file is removed; one a crash leaves behind is for the
    reader's recovery to remove.

    Args:
        path: the file to (re)place.
        fill: writes the content to the open file descriptor it is given.
        fsync: whether to fsync the file and the directory (False only for
            throwaway runs).
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        fill(fd)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent, fsync)


class WriteAheadLog:
    """An open log segment for appending."""

    def __init__(self, path: str | os.PathLike, *, fsync: bool = True, truncate_to: int = 0):
        """Open (creating if missing) a log segment for appending.

        Args:
            path: the segment file.
            fsync: whether `sync` calls fsync (False only for throwaway runs).
            truncate_to: for an existing file, cut it to this length first (the
                `end_offset` of a replay, dropping a torn tail); 0 keeps it whole.

        Raises:
            WalError: an existing file with a bad header.
        """
        self.path = Path(path)
        self.fsync = fsync
        if not self.path.exists():  # created whole: a crash never leaves a part of a header
            write_whole(self.path, lambda fd: os.write(fd, _file_header()), fsync)
        self._fd = open_private(self.path, os.O_RDWR)  # 0600: deltas are private
        try:
            _check_file_header(os.pread(self._fd, _FILE_HEADER.size, 0), self.path)
            if truncate_to:
                os.ftruncate(self._fd, truncate_to)
                self._sync_file()
            self.size = os.lseek(self._fd, 0, os.SEEK_END)
        except BaseException:
            os.close(self._fd)
            raise
        self.synced = self.size  # the length the last good sync (or the open) covered
        self.broken = False  # a failed write or sync could not be cut back yet
        self._dirty = False

    def append(
        self,
        header: Mapping[str, Any],
        payload: Sequence[Any] = (),
        checks: Sequence[int | None] | None = None,
    ) -> int:
        """Append one record (durable against process death on return; call sync for power loss).

        Args:
            header: msgpack-serializable map.
            payload: bytes-like pieces written back to back after the header.
            checks: per piece, its zlib.crc32 when already known and verified
                (combined into the record's instead of reading the piece
                again), else None; None: compute every one.

        Returns:
            The record's byte offset.

        Raises:
            OSError: the record could not be written (nothing of it stays in the
                file; if even that cut failed, `broken` is set and the next append
                retries the cut first).
        """
        if self.broken:
            self._cut(self.size)
        head = msgpack.packb(dict(header), use_bin_type=True)
        pieces = [memoryview(p).cast("B") for p in payload]
        body_len = _HLEN.size + len(head) + sum(p.nbytes for p in pieces)
        crc = zlib.crc32(_HLEN.pack(len(head)))
        crc = zlib.crc32(head, crc)
        for i, p in enumerate(pieces):
            known = checks[i] if checks is not None else None
            crc = zlib.crc32(p, crc) if known is None else crc32_combine(crc, known, p.nbytes)
        buffers = [_PREFIX.pack(body_len, crc), _HLEN.pack(len(head)), head, *pieces]
        total = _PREFIX.size + body_len
        try:
            write_all(self._fd, buffers)
        except OSError:
            self._cut_after_failure(self.size)
            raise
        offset = self.size
        self.size += total
        self._dirty = True
        return offset

    def sync(self) -> None:
        """fsync everything appended so far (no-op when nothing changed or fsync is off).

        Raises:
            OSError: fsync failed; the records appended since the last good sync
                are cut off (`size` drops to `synced`), or `broken` is set if the
                cut failed too.
        """
        if not self._dirty:
            return
        try:
            self._sync_file()
        except OSError:
            self.rollback()
            raise
        self._dirty = False
        self.synced = self.size

    def rollback(self) -> None:
        """Cut off every record appended since the last good sync (a batch that failed).

        Leaves `broken` set when the cut fails (the next append retries it).
        """
        self._dirty = False
        self._cut_after_failure(self.synced)
        self.size = self.synced

    def _cut(self, length: int) -> None:
        """Cut the file to `length` bytes and append from there (durable with the next sync)."""
        os.ftruncate(self._fd, length)
        os.lseek(self._fd, length, os.SEEK_SET)
        self.broken = False

    def _cut_after_failure(self, length: int) -> None:
        try:
            self._cut(length)
        except OSError as exc:
            self.broken = True
            logger.error("%s: cannot cut the log back to %d bytes: %s", self.path, length, exc)

    def _sync_file(self) -> None:
        if self.fsync:
            os.fsync(self._fd)

    def close(self) -> None:
        """Sync and close the file."""
        if self._fd >= 0:
            try:
                self.sync()
            except OSError as exc:  # nothing unsynced was acknowledged: say so and close
                logger.error("%s: last sync before closing failed: %s", self.path, exc)
            finally:
                os.close(self._fd)
                self._fd = -1


def iov_max() -> int:
    """The most buffers one `writev` takes here (IOV_MAX: 1024 on Linux; 16 if unknown)."""
    try:
        limit = os.sysconf("SC_IOV_MAX")
    except (ValueError, OSError):
        limit = -1
    return limit if limit > 0 else 16


IOV_MAX = iov_max()


def write_all(fd: int, buffers: Sequence[Any]) -> int:
    """Write every buffer, in order, with `writev` calls of at most IOV_MAX buffers each.

    A record may hold any number of payload frames (a push cut into 1,100
    frames is legal): one `writev` past IOV_MAX fails with EINVAL, so the
    vector goes in batches; a short write (e.g. disk full) is finished with
    the rest, or raises.

    Args:
        fd: the file descriptor (at its append position).
        buffers: bytes-like pieces, written back to back.

    Returns:
        The bytes written (the sum of the buffers' sizes).

    Raises:
        OSError: a write failed (some of the pieces may be written).
    """
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if v.nbytes]
    total = 0
    while views:
        batch = views[:IOV_MAX]
        written = os.writev(fd, batch)
        if written <= 0:  # no progress on a non-empty batch: treat it as a full disk
            raise OSError(errno.ENOSPC, "writev wrote nothing")
        total += written
        # drop what went out; a short write leaves part of a buffer for the next call
        done = 0
        while done < len(batch) and written >= batch[done].nbytes:
            written -= batch[done].nbytes
            done += 1
        views = views[done:]
        if written:
            views[0] = views[0][written:]
    return total


def _check_file_header(raw: bytes, path: Path) -> None:
    if len(raw) < _FILE_HEADER.size:
        raise WalError(
            f"{path}: shorter than the {_FILE_HEADER.size}-byte log header (an older build "
            "killed while creating a segment left it so: if it is the newest segment, it "
            "holds no record and can be moved away)"
        )
    magic, version, crc = _FILE_HEADER.unpack(raw)
    if magic != WAL_MAGIC or crc != zlib.crc32(raw[:12]):
        raise WalError(f"{path}: not a write-ahead log (bad magic or header checksum)")
    if version != WAL_FORMAT_VERSION:
        raise WalError(
            f"{path}: log format {version}; this build reads {WAL_FORMAT_VERSION}. "
            "Restore with the build that wrote it."
        )


class LogReader:
    """Iterates the records of one segment; after iteration, `end_offset` and `torn_at` are set.

    `end_offset` is the length of the good prefix (pass it as `truncate_to`
    when reopening); `torn_at` is the offset of a torn tail, or None.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        """Prepare to read a segment.

        Args:
            path: the segment file.
        """
        self.path = Path(path)
        self.end_offset = 0
        self.torn_at: int | None = None
        self.records = 0

    def __iter__(self) -> Iterator[Record]:
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            _check_file_header(f.read(_FILE_HEADER.size), self.path)
            offset = _FILE_HEADER.size
            self.end_offset = offset
            while offset < size:
                prefix = f.read(_PREFIX.size)
                if len(prefix) < _PREFIX.size:
                    self._torn(offset, size)
                    return
                body_len, crc = _PREFIX.unpack(prefix)
                end = offset + _PREFIX.size + body_len
                if body_len < _HLEN.size or body_len > MAX_RECORD_BYTES or end > size:
                    self._torn(offset, size)
                    return
                body = f.read(body_len)
                if len(body) < body_len:
                    self._torn(offset, size)
                    return
                if zlib.crc32(body) != crc:
                    if end == size:
                        self._torn(offset, size)
                        return
                    raise WalError(
                        f"{self.path}: record at byte {offset} has a bad checksum and "
                        f"{size - end} bytes follow it: the log is corrupted in the middle. "
                        "Restore the data dir from a backup, or move this file away to "
                        "start from the newest checkpoint (losing the records after it)."
                    )
                header = _parse_body_header(body, self.path, offset)
                (hlen,) = _HLEN.unpack_from(body)
                yield Record(header, body[_HLEN.size + hlen :], offset)
                self.records += 1
                offset = end
                self.end_offset = end

    def _torn(self, offset: int, size: int) -> None:
        self.torn_at = offset
        logger.warning(
            "%s: torn tail at byte %d (%d bytes of an unfinished record dropped)",
            self.path,
            offset,
            size - offset,
            extra={"path": str(self.path), "offset": offset, "dropped_bytes": size - offset},
        )


def _parse_body_header(body: bytes, path: Path, offset: int) -> dict[str, Any]:
    (hlen,) = _HLEN.unpack_from(body)
    try:
        if _HLEN.size + hlen > len(body):
            raise ValueError("header length past the record")
        header = msgpack.unpackb(body[_HLEN.size : _HLEN.size + hlen], raw=False)
        if not isinstance(header, dict):
            raise ValueError("record header is not a map")
    except Exception as exc:
        raise WalError(f"{path}: record at byte {offset} has a valid checksum but {exc}") from exc
    return header


def fsync_dir(path: str | os.PathLike, enabled: bool = True) -> None:
    """fsync a directory (after creating, renaming or deleting files in it).

    Args:
        path: the directory.
        enabled: False makes it a no-op (fsync off).
    """
    if not enabled:
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
