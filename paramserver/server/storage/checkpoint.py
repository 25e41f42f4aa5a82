"""A checkpoint: what of the state it holds, and the file it is written to (atomically) and read from.

Content (`export_state` / `restore_state`): a shard state <-> (msgpack-ready
meta, named arrays). The island
registry is not included (islands say hello again after a restart). Pending
deltas are stored as they are kept, coded (`codec.coded.CodedTensor`: codes
and scales, topk entries or raw values, with their clip factor), not decoded.
The meta names the dtype the outer momentum is kept in (`momentum_dtype`; a
bfloat16 momentum is stored as its uint16 bits, as the downlink residual), and
a shard set to the other dtype refuses the checkpoint (`MomentumDtypeError`)
rather than convert it.

`export_state` copies nothing big: its meta map is built fresh, but its
arrays are the live ones (numpy views of params, optimizer state and the
downlink residual, which a step may change in place; `live_fragment` names
the fragment whose step does) and the pending deltas as accepted (never
changed). Whoever keeps them past the next step copies them first
(`paramserver.server.storage.checkpoint_job`).

Files (`write_checkpoint`, `read_checkpoint`): a msgpack metadata map plus
named numpy arrays, checksummed, written atomically.

File format (integers little endian):

    header   8 bytes magic b"DDCKPT\x00\x00", uint32 format version
             (CHECKPOINT_FORMAT_VERSION), uint32 metadata length M
    meta     M bytes msgpack map: {"meta": caller's map, "arrays": [[name,
             dtype, shape, offset, nbytes], ...]} with offsets relative to
             the data section
    data     the arrays' bytes, each starting at a multiple of 64 bytes
    trailer  uint32 crc32 of everything before it, 4 bytes b"DONE"

Writing: a temporary file in the same directory (``.<name>.tmp-<pid>``),
fsync, rename over the final name, fsync the directory (`wal.write_whole`,
which creates the log's segments too), so a reader sees the old file or the
new one, never half of one. The arrays go out in pieces of
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

import jax
import msgpack
import numpy as np

from codec.coded import CodedTensor, from_array
from paramserver.server.admission.outcomes import ShardCounters
from paramserver.server.config import ShardConfig
from paramserver.server.fragment import (
    Contribution,
    DedupEntry,
    FragmentState,
    MomentumDtypeError,
    StateError,
)
from paramserver.server.state import ShardState
from paramserver.server.step.downlink import restore_residual
from paramserver.server.step.fragment_step import BFLOAT16, host_state, host_vector
from paramserver.server.step.policy import ArrivalStats
from paramserver.server.step.weighting import RoundClock
from paramserver.server.storage.wal import write_whole
from paramserver.wire.plan import Plan


def export_state(state: ShardState) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Everything durable of a shard state, as a msgpack-ready map plus named arrays.

    Args:
        state: the shard's state.

    Returns:
        (meta, arrays) of a checkpoint; `restore_state` inverts it. The island registry
        is not included (islands say hello again after a restart). The arrays
        named by `live_fragment` are views of the live state: copy them before
        that fragment's next step if they must outlive it.
    """
    arrays: dict[str, np.ndarray] = {}
    frags = []
    for index, frag in sorted(state.fragments.items()):
        arrays[f"params/{index}"] = np.asarray(frag.params)
        if frag.residual is not None:  # bfloat16, stored as its bits
            arrays[f"residual/{index}"] = frag.residual.view(np.uint16)
        # the leaves in the order of FragmentOptimizer.state_to_arrays, without its copies;
        # a bfloat16 momentum as its bits (uint16), as the residual
        opt = [_stored_leaf(np.asarray(leaf)) for leaf in jax.tree.leaves(frag.opt_state)]
        for k, arr in enumerate(opt):
            arrays[f"opt/{index}/{k}"] = arr
        pending = []
        for j, c in enumerate(frag.pending):
            coding = _export_coded(c.delta, f"pending/{index}/{j}", arrays)
            pending.append(
                [c.island, c.round, c.base_version, c.tokens, c.steps, c.arrived, coding, c.clip]
            )
        st = frag.stats
        frags.append(
            {
                "index": index,
                "version": frag.version,
                "opt_arrays": len(opt),
                "stats": [st.ema_interarrival_s, st.last_arrival, st.count],
                "pending": pending,
                "norms": list(frag.norms),
                "clock": frag.clock.to_wire(),
            }
        )
    c = state.counters
    meta = {
        "shard": state.index,
        "shards": state.cfg.shards,
        "num_fragments": state.cfg.num_fragments,
        "outer_optimizer": state.cfg.outer_optimizer,
        "momentum_dtype": state.cfg.momentum_dtype,
        "plan": state.plan.to_wire() if state.plan else None,
        "fragments": frags,
        "dedup": [
            [island, fragment, e.newest, sorted(e.rounds), e.floor]
            for (island, fragment), e in sorted(state.dedup.items())
        ],
        "counters": {
            "accepted": c.accepted,
            "duplicates": c.duplicates,
            "rejected": dict(c.rejected),
            "hello_requests": c.hello_requests,
            "bytes_in": c.bytes_in,
            "bytes_out": c.bytes_out,
            "staleness": [[k, v] for k, v in sorted(c.staleness.items())],
            "steps": c.steps,
            "clipped": c.clipped,
            "credited": dict(c.credited),
        },
    }
    return meta, arrays


def checkpoint_summary(meta: Mapping[str, Any]) -> dict[str, Any]:
    """What status says of a checkpoint, from its meta map.

    Args:
        meta: `export_state`'s map (with "taken_at", wall-clock seconds, once
            the data dir added it; older checkpoints have none).

    Returns:
        {"step": outer steps of the shard, "versions": {fragment: version} (str
        keys), "time": when the state was captured or None}.
    """
    return {
        "step": meta["counters"]["steps"],
        "versions": {str(f["index"]): f["version"] for f in meta["fragments"]},
        "time": meta.get("taken_at"),
    }


def live_fragment(name: str) -> int | None:
    """The fragment whose outer step may change an exported array in place.

    Args:
        name: an array name of `export_state`.

    Returns:
        The fragment index for params, optimizer state and residual; None for
        the pending deltas (kept as accepted, never changed).
    """
    kind, _, rest = name.partition("/")
    if kind in ("params", "residual", "opt"):
        return int(rest.partition("/")[0])
    return None


def restore_state(
    cfg: ShardConfig,
    index: int,
    meta: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
    timer: Callable[[], float] | None = None,
) -> ShardState:
    """Rebuild a shard state from `export_state` output.

    Args:
        cfg: the settings to run with (must match the checkpoint's cluster shape).
        index: this shard's index.
        meta: the exported map.
        arrays: the exported arrays.
        timer: the restored state's step timer (see ShardState).

    Returns:
        The restored state.

    Raises:
        StateError: the checkpoint belongs to another shard or cluster shape,
            or is inconsistent.
        MomentumDtypeError: it keeps the outer momentum in another dtype than
            `cfg.momentum_dtype` (absent in older checkpoints: float32).
    """
    state = ShardState(cfg, index, timer)
    got = (meta.get("shard"), meta.get("shards"), meta.get("num_fragments"))
    want = (index, cfg.shards, cfg.num_fragments)
    if got != want:
        raise StateError(
            f"checkpoint is for shard/shards/fragments {got}, this process runs {want}: "
            "point data_dir at this cluster's directory or start with an empty one"
        )
    kept = str(meta.get("momentum_dtype", "float32"))
    if kept != cfg.momentum_dtype:
        raise MomentumDtypeError(kept, cfg.momentum_dtype, "the checkpoint")
    try:
        if meta["plan"] is not None:
            state.plan = Plan.from_wire(meta["plan"])
        for f in meta["fragments"]:
            i = f["index"]
            params = np.asarray(arrays[f"params/{i}"], dtype=np.float32)
            opt_arrays = [_read_leaf(arrays[f"opt/{i}/{k}"]) for k in range(f["opt_arrays"])]
            opt_state = host_state(state.optimizer.state_from_arrays(opt_arrays, params))
            frag = FragmentState(host_vector(params), opt_state)
            if f"residual/{i}" in arrays:
                frag.residual = restore_residual(arrays[f"residual/{i}"])
            frag.version = int(f["version"])
            frag.clock = RoundClock.from_wire(f.get("clock"), frag.version)
            frag.norms = [float(n) for n in f.get("norms", [])]
            ema, last, count = f["stats"]
            frag.stats = ArrivalStats(ema, last, int(count))
            for j, (island, rnd, base, tokens, steps, arrived, *coding) in enumerate(f["pending"]):
                delta = _restore_coded(coding, f"pending/{i}/{j}", arrays)
                clip = float(coding[1]) if coding else 1.0
                frag.pending.append(
                    Contribution(island, rnd, i, base, tokens, steps, arrived, delta, clip)
                )
            state.fragments[i] = frag
        for island, fragment, newest, rounds, *floor in meta["dedup"]:  # floor: newer files
            entry = DedupEntry(newest, set(rounds), floor[0] if floor else None)
            state.dedup[(island, fragment)] = entry
        c = meta["counters"]
        state.counters = ShardCounters(
            accepted=c["accepted"],
            duplicates=c["duplicates"],
            rejected=dict(c["rejected"]),
            hello_requests=c.get("hello_requests", 0),
            bytes_in=c["bytes_in"],
            bytes_out=c["bytes_out"],
            staleness={int(k): v for k, v in c["staleness"]},
            steps=c["steps"],
            clipped=c.get("clipped", 0),
            credited={str(k): float(v) for k, v in c.get("credited", {}).items()},
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise StateError(f"inconsistent checkpoint: {exc!r}") from exc
    return state


def _stored_leaf(leaf: np.ndarray) -> np.ndarray:
    """An optimizer state leaf as a checkpoint stores it: bfloat16 as its uint16 bits."""
    return leaf.view(np.uint16) if leaf.dtype == BFLOAT16 else leaf


def _read_leaf(saved: np.ndarray) -> np.ndarray:
    """A stored optimizer state leaf as the state keeps it (uint16: a bfloat16 momentum)."""
    return saved.view(BFLOAT16) if saved.dtype == np.uint16 else saved


def _export_coded(delta: CodedTensor, name: str, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """Store a coded pending delta's arrays under `name`; its description for the meta."""
    arrays[f"{name}/codes"] = delta.codes
    arrays[f"{name}/scales"] = delta.scales
    return {"scheme": delta.scheme, "block": delta.block, "dtype": delta.dtype,
            "shape": list(delta.shape)}  # fmt: skip


def _restore_coded(coding: list, name: str, arrays: Mapping[str, np.ndarray]) -> CodedTensor:
    """The coded pending delta `_export_coded` stored (a float32 array in older checkpoints)."""
    # copies: the arrays read back are views of the whole checkpoint file's buffer
    if not coding:
        return from_array(np.array(arrays[name], dtype=np.float32))
    d = coding[0]
    codes, scales = np.array(arrays[f"{name}/codes"]), np.array(arrays[f"{name}/scales"])
    shape = tuple(int(n) for n in d["shape"])
    return CodedTensor(("delta",), shape, d["dtype"], d["scheme"], int(d["block"]), codes, scales)


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
    crc = 0
    unsynced = 0

    def fill(fd: int) -> None:
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

    write_whole(path, fill, fsync)  # 0600: parameters are private
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
