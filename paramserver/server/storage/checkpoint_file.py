"""Atomic checkpoint files: a msgpack metadata map plus named numpy arrays, checksummed.

This module owns the checkpoint file format and how one is written safely;
what goes into a shard's checkpoint is `paramserver.server.storage.checkpoint_content`'s job.

File format (integers little endian):

    header   8 bytes magic b"DDCKPT\\x00\\x00", uint32 format version
             (CHECKPOINT_FORMAT_VERSION), uint32 metadata length M
    meta     M bytes msgpack map: {"meta": caller's map, "arrays": [[name,
             dtype, shape, offset, nbytes], ...]} with offsets relative to
             the data section
    data     the arrays' bytes, each starting at a multiple of 64 bytes
    trailer  uint32 crc32 of everything before it, 4 bytes b"DONE"

Writing: a temporary file in the same directory (``.<name>.tmp-<pid>``),
fsync, rename over the final name, fsync the directory, so a reader sees the
old file or the new one, never half of one. The arrays go out in pieces of
at most `CHUNK_BYTES`, each fetched through an optional `read` callback, so a
background writer can copy each piece under its own lock and pause or give
up between pieces (`paramserver.server.storage.checkpoint_job`). Reading
checks magic, version, trailer and checksum before trusting anything and
raises `CheckpointError` naming the problem.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from paramserver.server.storage.log_file import fsync_dir

CHECKPOINT_MAGIC = b"DDCKPT\x00\x00"
CHECKPOINT_FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sII")
_TRAILER = struct.Struct("<I4s")
_END = b"DONE"
_ALIGN = 64
CHUNK_BYTES = 8 << 20  # the largest piece of an array written (and copied) at once

# read(name, start, stop) -> the bytes [start, stop) of array `name` (a bytes-like object)
ChunkReader = Callable[[str, int, int], Any]


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, corrupted or of another format version."""


def write_checkpoint(
    path: str | os.PathLike,
    meta: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
    *,
    fsync: bool = True,
    read: ChunkReader | None = None,
    sync_every: int = 0,
) -> int:
    """Write a checkpoint atomically.

    Args:
        path: the final file name (its directory must exist).
        meta: msgpack-serializable map.
        arrays: name -> numpy array (any dtype numpy can name; written C-order).
            With `read`, only their dtype and shape are used here.
        fsync: fsync the file and directory (False only for throwaway runs).
        read: where the arrays' bytes come from, piece by piece (at most
            CHUNK_BYTES each, in file order); default: the arrays themselves.
            Whatever it raises ends the write (the temporary file is removed).
        sync_every: with fsync, also fdatasync (and drop from the page cache)
            after every this many bytes, so the file never has much unwritten
            data: the log's fsyncs, which on ext4 wait for other files' data
            of the same journal commit, then do not wait for the whole file.
            0: one fsync at the end.

    Returns:
        The file's size in bytes.

    Raises:
        OSError: the file could not be written, synced or renamed (nothing
            replaced `path`).
    """
    path = Path(path)
    table = []
    offset = 0
    contiguous = {}
    for name, arr in arrays.items():
        arr = np.asarray(arr)
        if read is None and not arr.flags.c_contiguous:  # (ascontiguousarray makes 0-d 1-d)
            arr = arr.copy(order="C")
        contiguous[name] = arr
        offset = -(-offset // _ALIGN) * _ALIGN
        table.append([name, arr.dtype.str, list(arr.shape), offset, arr.nbytes])
        offset += arr.nbytes
    if read is None:

        def read(name: str, lo: int, hi: int) -> Any:
            return contiguous[name].reshape(-1).view(np.uint8)[lo:hi]

    head_map = msgpack.packb({"meta": dict(meta), "arrays": table}, use_bin_type=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    crc = 0
    unsynced = 0
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:

        def put(buf: Any) -> None:
            nonlocal crc, unsynced
            view = memoryview(buf).cast("B")
            crc = zlib.crc32(view, crc)
            unsynced += view.nbytes
            while view.nbytes:
                n = os.write(fd, view)
                view = view[n:]
            if fsync and sync_every and unsynced >= sync_every:
                os.fdatasync(fd)
                if hasattr(os, "posix_fadvise"):  # written: keep no copy in the page cache
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                unsynced = 0

        put(_HEADER.pack(CHECKPOINT_MAGIC, CHECKPOINT_FORMAT_VERSION, len(head_map)))
        put(head_map)
        written = 0
        for name, _, _, start, nbytes in table:
            if start > written:
                put(bytes(start - written))
            for lo in range(0, nbytes, CHUNK_BYTES):
                put(read(name, lo, min(lo + CHUNK_BYTES, nbytes)))
            written = start + nbytes
        os.write(fd, _TRAILER.pack(crc, _END))
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent, fsync)
    return path.stat().st_size


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read and verify a checkpoint.

    Args:
        path: the checkpoint file.

    Returns:
        (meta, arrays): the caller's map and name -> writable numpy array.

    Raises:
        CheckpointError: unreadable, truncated, bad checksum, other format version.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        buf = bytearray(size)
        with open(path, "rb", buffering=0) as f:
            got = f.readinto(buf)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror}") from exc
    if got != size or size < _HEADER.size + _TRAILER.size:
        raise CheckpointError(f"{path}: truncated ({got} of {size} bytes)")
    view = memoryview(buf)
    magic, version, meta_len = _HEADER.unpack_from(view)
    if magic != CHECKPOINT_MAGIC:
        raise CheckpointError(f"{path}: not a checkpoint (bad magic)")
    crc, end = _TRAILER.unpack_from(view, size - _TRAILER.size)
    if end != _END or zlib.crc32(view[: size - _TRAILER.size]) != crc:
        raise CheckpointError(f"{path}: checksum mismatch or missing trailer (corrupted)")
    if version != CHECKPOINT_FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format {version}; this build reads {CHECKPOINT_FORMAT_VERSION}"
        )
    try:
        head = msgpack.unpackb(view[_HEADER.size : _HEADER.size + meta_len], raw=False)
        data_start = _HEADER.size + meta_len
        data_end = size - _TRAILER.size
        arrays = {}
        for name, dtype, shape, offset, nbytes in head["arrays"]:
            start = data_start + offset
            if start + nbytes > data_end:
                raise ValueError(f"array {name!r} runs past the data section")
            dt = np.dtype(dtype)
            count = int(np.prod(shape, dtype=np.int64))
            if count * dt.itemsize != nbytes:
                raise ValueError(f"array {name!r}: shape {shape} {dt} is not {nbytes} bytes")
            arr = np.frombuffer(buf, dtype=dt, count=count, offset=start)
            arrays[name] = arr.reshape(tuple(shape))
        return head["meta"], arrays
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: malformed table ({exc})") from exc
