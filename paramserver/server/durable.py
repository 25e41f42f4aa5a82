"""Durability of one shard: events to the write-ahead log, periodic checkpoints, recovery.

This module owns the shard's data directory and both on-disk forms of a
shard state: the mapping between `paramserver.server.state` events and log records,
and a checkpoint's content (`export_state` / `restore_state`); the record and checkpoint file
formats are `paramserver.server.wal` and `paramserver.server.checkpoint`.

Layout of ``<data_dir>/shard-<i>/``:

    checkpoint-<n>.ckpt   the shard's state at checkpoint n (n = 1, 2, ...)
    wal-<n>.log           the events after checkpoint n (wal-0: after the empty state)

A checkpoint n+1 is written (atomically) only after the log is synced; then
wal-<n+1>.log is started (if it cannot be, checkpoint n+1 is removed again).
The newest two checkpoints are kept, and the log segments from the older of
them on, so the previous checkpoint and the log after it stay as a fallback.
Recovery loads the newest checkpoint that reads back intact (a corrupted one is reported, renamed to ``*.corrupt`` and the previous one
used), replays every log segment from its generation on, truncates a torn
tail of the last segment, and appends there. If a corrupted checkpoint was
skipped, a fresh checkpoint is written at once.

Storage faults (disk full, file-size limit, read-only, I/O error): a failed
append or sync raises `StorageError` and the log keeps only what was synced
before (`paramserver.server.wal`); the caller refuses what it could not log and,
after a failed sync, rebuilds its state from disk (`reload`). A failed
checkpoint is logged and retried later (the log still holds everything).
Faults are logged at most once per `FAULT_LOG_EVERY_S`, recovery once.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from paramserver.plumbing import daemon
from paramserver.server.checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from paramserver.server.config import ShardConfig
from paramserver.server.log_records import event_to_record, record_to_event
from paramserver.server.policy import ArrivalStats
from paramserver.server.records import (
    Contribution,
    Counters,
    DedupEntry,
    Event,
    FragmentState,
    StateError,
    StepEvent,
)
from paramserver.server.state import ShardState
from paramserver.server.wal import LogReader, WalError, WriteAheadLog, fsync_dir
from paramserver.wire.plan import Plan

logger = logging.getLogger(__name__)

_CKPT = re.compile(r"^checkpoint-(\d+)\.ckpt$")
_WAL = re.compile(r"^wal-(\d+)\.log$")

FAULT_LOG_EVERY_S = 60.0  # storage faults are logged at most this often
CHECKPOINT_RETRY_S = 10.0  # a failed checkpoint is tried again after this long


class DurabilityError(RuntimeError):
    """The data directory cannot be recovered without losing acknowledged data."""


class StorageError(RuntimeError):
    """The write-ahead log could not be written or synced; what it was for is not durable."""


# ----- the checkpoint's content: a shard state <-> (meta, arrays) ---------------------


def export_state(state: ShardState) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Everything durable of a shard state, as a msgpack-ready map plus named arrays.

    Args:
        state: the shard's state.

    Returns:
        (meta, arrays) of a checkpoint; `restore_state` inverts it. The island registry
        is not included (islands say hello again after a restart).
    """
    arrays: dict[str, np.ndarray] = {}
    frags = []
    for index, frag in sorted(state.fragments.items()):
        arrays[f"params/{index}"] = np.asarray(frag.params)
        if frag.residual is not None:
            arrays[f"residual/{index}"] = frag.residual
        opt = state.optimizer.state_to_arrays(frag.opt_state)
        for k, arr in enumerate(opt):
            arrays[f"opt/{index}/{k}"] = arr
        pending = []
        for j, c in enumerate(frag.pending):
            arrays[f"pending/{index}/{j}"] = c.delta
            pending.append([c.island, c.round, c.base_version, c.tokens, c.steps, c.arrived])
        st = frag.stats
        frags.append(
            {
                "index": index,
                "version": frag.version,
                "opt_arrays": len(opt),
                "stats": [st.ema_interarrival_s, st.last_arrival, st.count],
                "pending": pending,
                "norms": list(frag.norms),
            }
        )
    c = state.counters
    meta = {
        "shard": state.index,
        "shards": state.cfg.shards,
        "num_fragments": state.cfg.num_fragments,
        "outer_optimizer": state.cfg.outer_optimizer,
        "plan": state.plan.to_wire() if state.plan else None,
        "fragments": frags,
        "dedup": [
            [island, fragment, e.newest, sorted(e.rounds)]
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


def restore_state(
    cfg: ShardConfig, index: int, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
) -> ShardState:
    """Rebuild a shard state from `export_state` output.

    Args:
        cfg: the settings to run with (must match the checkpoint's cluster shape).
        index: this shard's index.
        meta: the exported map.
        arrays: the exported arrays.

    Returns:
        The restored state.

    Raises:
        StateError: the checkpoint belongs to another shard or cluster shape,
            or is inconsistent.
    """
    state = ShardState(cfg, index)
    got = (meta.get("shard"), meta.get("shards"), meta.get("num_fragments"))
    want = (index, cfg.shards, cfg.num_fragments)
    if got != want:
        raise StateError(
            f"checkpoint is for shard/shards/fragments {got}, this process runs {want}: "
            "point data_dir at this cluster's directory or start with an empty one"
        )
    try:
        if meta["plan"] is not None:
            state.plan = Plan.from_wire(meta["plan"])
        for f in meta["fragments"]:
            i = f["index"]
            params = np.asarray(arrays[f"params/{i}"], dtype=np.float32)
            opt_arrays = [arrays[f"opt/{i}/{k}"] for k in range(f["opt_arrays"])]
            opt_state = state.optimizer.state_from_arrays(opt_arrays, params)
            frag = FragmentState(jnp.asarray(params), opt_state)
            if f"residual/{i}" in arrays:
                frag.residual = np.array(arrays[f"residual/{i}"], dtype=np.float32)
            frag.version = int(f["version"])
            frag.norms = [float(n) for n in f.get("norms", [])]
            ema, last, count = f["stats"]
            frag.stats = ArrivalStats(ema, last, int(count))
            for j, (island, rnd, base, tokens, steps, arrived) in enumerate(f["pending"]):
                frag.pending.append(
                    Contribution(
                        island, rnd, i, base, tokens, steps, arrived, arrays[f"pending/{i}/{j}"]
                    )
                )
            state.fragments[i] = frag
        for island, fragment, newest, rounds in meta["dedup"]:
            state.dedup[(island, fragment)] = DedupEntry(newest, set(rounds))
        c = meta["counters"]
        state.counters = Counters(
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


class Durability:
    """The shard's data directory: log appends, group fsync, checkpoints, recovery."""

    def __init__(self, cfg: ShardConfig, index: int) -> None:
        """Prepare (touches no files until `recover`).

        Args:
            cfg: settings (data_dir, fsync, checkpoint cadence).
            index: shard index; files live in <data_dir>/shard-<index>/.
        """
        self.cfg = cfg
        self.index = index
        self.dir = daemon.shard_dir(cfg.data_dir, index)
        self.generation = 0
        self._wal: WriteAheadLog | None = None
        self._events_since = 0
        self._steps_since = 0
        self._last_checkpoint = time.time()
        self.last_checkpoint_s: float | None = None
        self.last_checkpoint_bytes: int | None = None
        self.replayed = 0
        self.faults = 0  # storage faults since the last good write
        self._fault_logged = -FAULT_LOG_EVERY_S  # monotonic time of the last fault log
        self._checkpoint_retry_at = 0.0

    # ----- recovery --------------------------------------------------------------

    def recover(self) -> ShardState:
        """Load the newest good checkpoint, replay the log after it, open the log for appends.

        Returns:
            The recovered state (empty for a new data dir).

        Raises:
            DurabilityError: recovery would lose acknowledged data (a log corrupted
                in the middle, no usable checkpoint and no log from the start), or
                the data dir belongs to another cluster shape; the message says
                which and what to do.
            OSError: the directory cannot be created or read.
        """
        try:
            return self._recover()
        except (WalError, StateError) as exc:
            raise DurabilityError(f"shard {self.index} cannot recover {self.dir}: {exc}") from exc

    def _recover(self) -> ShardState:
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(".checkpoint-*.tmp-*"):  # a checkpoint write cut short
            logger.warning("shard %d: removing unfinished checkpoint %s", self.index, stale.name)
            stale.unlink(missing_ok=True)
        checkpoints = self._numbered(_CKPT)
        skipped = False
        state, gen = None, 0
        for n in sorted(checkpoints, reverse=True):
            path = checkpoints[n]
            try:
                meta, arrays = read_checkpoint(path)
            except CheckpointError as exc:
                logger.error(
                    "shard %d: checkpoint %s is unusable (%s); trying the previous one",
                    self.index,
                    path.name,
                    exc,
                    extra={"shard": self.index, "path": str(path)},
                )
                path.rename(path.with_name(path.name + ".corrupt"))
                skipped = True
                continue
            state, gen = restore_state(self.cfg, self.index, meta, arrays), n
            break
        segments = {n: p for n, p in self._numbered(_WAL).items() if n >= gen}
        if state is None:
            state = ShardState(self.cfg, self.index)
            if checkpoints and 0 not in segments:
                raise DurabilityError(
                    f"{self.dir}: no checkpoint reads back intact and the log from the empty "
                    "state is gone; restore the data dir from a backup"
                )
        order = sorted(segments)
        reader = None
        for n in order:
            reader = LogReader(segments[n])
            for record in reader:
                state.apply(record_to_event(record))
                self.replayed += 1
            if reader.torn_at is not None and n != order[-1]:
                raise WalError(
                    f"{segments[n]}: torn at byte {reader.torn_at} but later segments exist; "
                    "the log is corrupted in the middle"
                )
        if order:
            self.generation = order[-1]
            assert reader is not None
            self._wal = WriteAheadLog(
                segments[order[-1]],
                fsync=self.cfg.fsync,
                truncate_to=reader.end_offset if reader.torn_at is not None else 0,
            )
        else:
            self.generation = gen
            self._wal = WriteAheadLog(self._wal_path(gen), fsync=self.cfg.fsync)
        logger.info(
            "shard %d recovered: checkpoint %s, %d log records replayed, versions %s",
            self.index,
            gen or "none",
            self.replayed,
            state.versions(),
            extra={"shard": self.index, "checkpoint": gen, "replayed": self.replayed},
        )
        self._events_since = self.replayed
        self._last_checkpoint = time.time()
        if skipped and state.initialized:
            self.checkpoint(state, time.time())
        return state

    def _numbered(self, pattern: re.Pattern) -> dict[int, Path]:
        found = {}
        for path in self.dir.iterdir():
            m = pattern.match(path.name)
            if m:
                found[int(m.group(1))] = path
        return found

    def _wal_path(self, n: int) -> Path:
        return self.dir / f"wal-{n}.log"

    # ----- the running shard -------------------------------------------------------

    def append(self, event: Event) -> None:
        """Append an event to the log (fsynced by the next `sync`); the state's journal.

        Args:
            event: the event about to be applied to the state.

        Raises:
            StorageError: it could not be written (the log is unchanged).
        """
        assert self._wal is not None, "call recover() first"
        header, payload = event_to_record(event)
        try:
            self._wal.append(header, payload)
        except OSError as exc:
            raise self._fault("append to", exc) from exc
        if self.faults:
            logger.warning(
                "shard %d: the write-ahead log is writable again after %d failure(s)",
                self.index,
                self.faults,
                extra={"shard": self.index, "faults": self.faults},
            )
            self.faults = 0
        self._events_since += 1
        if isinstance(event, StepEvent):
            self._steps_since += 1

    def sync(self) -> None:
        """fsync what was appended (call before sending acks).

        Raises:
            StorageError: fsync failed; the log is cut back to the previous sync,
                so the state is ahead of it: `reload` before going on.
            OSError: fsync failed and the log could not even be cut back (the
                shard must stop: its log may hold records that were never durable).
        """
        if self._wal is None:
            return
        try:
            self._wal.sync()
        except OSError as exc:
            if self._wal.broken:
                raise
            raise self._fault("sync", exc) from exc

    def _fault(self, what: str, exc: OSError) -> StorageError:
        """Count a storage fault, log it (at most once per FAULT_LOG_EVERY_S), and describe it."""
        self.faults += 1
        error = StorageError(f"cannot {what} {self.dir}: {exc.strerror or exc}")
        now = time.monotonic()
        if now - self._fault_logged >= FAULT_LOG_EVERY_S:
            self._fault_logged = now
            logger.error(
                "shard %d: %s (%d failure(s) so far; pushes are refused with storage_error "
                "until writes succeed; next report in %.0f s)",
                self.index,
                error,
                self.faults,
                FAULT_LOG_EVERY_S,
                extra={"shard": self.index, "faults": self.faults},
            )
        return error

    def reload(self, old: ShardState) -> ShardState:
        """Rebuild the state from disk after a failed sync (the log was cut back to the last sync).

        Args:
            old: the state that got ahead of the log; its island registry, paces and
                request counters carry over.

        Returns:
            The state of the checkpoint plus the synced log.
        """
        self.close()
        self.replayed = 0
        state = self.recover()
        state.last_seen, state.paces = old.last_seen, old.paces
        for name in ("duplicates", "rejected", "bytes_in", "bytes_out", "hello_requests"):
            setattr(state.counters, name, getattr(old.counters, name))
        logger.warning(
            "shard %d: state rebuilt from disk after a failed sync: versions %s",
            self.index,
            state.versions(),
            extra={"shard": self.index},
        )
        return state

    def maybe_checkpoint(self, state: ShardState, now: float) -> bool:
        """Checkpoint when checkpoint_every_steps steps or checkpoint_every_s seconds have passed.

        Args:
            state: the shard's state (synced with the log).
            now: wall-clock seconds.

        Returns:
            Whether a checkpoint was written.
        """
        every_steps, every_s = self.cfg.checkpoint_every_steps, self.cfg.checkpoint_every_s
        if time.monotonic() < self._checkpoint_retry_at:
            return False
        due = (every_steps and self._steps_since >= every_steps) or (
            every_s and self._events_since and now - self._last_checkpoint >= every_s
        )
        return bool(due) and self.checkpoint(state, now)

    def checkpoint(self, state: ShardState, now: float) -> bool:
        """Write a checkpoint, start a new log segment, delete what is no longer needed.

        Args:
            state: the shard's state (synced with the log).
            now: wall-clock seconds.

        Returns:
            False when nothing changed since the last checkpoint, or when storage
            failed (logged; tried again after CHECKPOINT_RETRY_S, the log keeps
            everything meanwhile).
        """
        assert self._wal is not None, "call recover() first"
        if self._events_since == 0 or not state.initialized:
            return False
        self.sync()
        gen = max([self.generation, *self._numbered(_CKPT), *self._numbered(_WAL)]) + 1
        start = time.perf_counter()
        meta, arrays = export_state(state)
        path = self.dir / f"checkpoint-{gen}.ckpt"
        try:
            size = write_checkpoint(path, meta, arrays, fsync=self.cfg.fsync)
            try:
                wal = WriteAheadLog(self._wal_path(gen), fsync=self.cfg.fsync)
            except OSError:  # appends must not go on in a segment older than the checkpoint
                path.unlink(missing_ok=True)
                raise
        except OSError as exc:
            self._checkpoint_retry_at = time.monotonic() + CHECKPOINT_RETRY_S
            self._fault("write a checkpoint in", exc)
            return False
        self._wal.close()
        self._wal = wal
        self.generation = gen
        self._prune()
        self.last_checkpoint_s = time.perf_counter() - start
        self.last_checkpoint_bytes = size
        self._events_since = self._steps_since = 0
        self._last_checkpoint = now
        logger.info(
            "shard %d checkpoint %d: %d bytes in %.3f s",
            self.index,
            gen,
            size,
            self.last_checkpoint_s,
            extra={"shard": self.index, "checkpoint": gen, "bytes": size},
        )
        return True

    def _prune(self) -> None:
        """Keep the newest two checkpoints and the log segments from the older one on."""
        checkpoints = self._numbered(_CKPT)
        keep = sorted(checkpoints)[-2:]
        oldest = keep[0] if len(keep) == 2 else 0
        for n, path in checkpoints.items():
            if n not in keep:
                path.unlink(missing_ok=True)
        for n, path in self._numbered(_WAL).items():
            if n < oldest:
                path.unlink(missing_ok=True)
        fsync_dir(self.dir, self.cfg.fsync)

    def close(self) -> None:
        """Sync and close the log."""
        if self._wal is not None:
            self._wal.close()
            self._wal = None
