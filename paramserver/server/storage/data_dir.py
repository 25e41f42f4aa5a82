"""A shard's data directory while it runs: log appends, one fsync per batch, checkpoints.

This module owns the files of ``<data_dir>/shard-<i>/`` and the order in
which they change; what the log records and checkpoints mean is
`paramserver.server.storage.log_format` and `.checkpoint_content`, how a state
is rebuilt from them `.recovery`. When to checkpoint is the shard core's
decision (`paramserver.server.core`).

Layout:

    checkpoint-<n>.ckpt   the shard's state at checkpoint n (n = 1, 2, ...)
    wal-<n>.log           the events after checkpoint n (wal-0: after the empty state)

A checkpoint n+1 is written (atomically) only after the log is synced; then
wal-<n+1>.log is started (if it cannot be, checkpoint n+1 is removed again).
The newest two checkpoints are kept, and the log segments from the older of
them on, so the previous checkpoint and the log after it stay as a fallback.
If recovery skipped a corrupted checkpoint, a fresh one is written at once.

Storage faults (disk full, file-size limit, read-only, I/O error): a failed
append or sync raises `StorageError` and cuts the log back to what the last
good sync covered (`paramserver.server.storage.log_file`), so nothing of the
batch is on disk; the caller then rebuilds its state from disk (`reload`) and
refuses the batch. A failed checkpoint is logged and reported False (the log
still holds everything). Faults are logged at most once per `FAULT_LOG_EVERY_S`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from paramserver.plumbing import daemon
from paramserver.server.config import ShardConfig
from paramserver.server.events import Event
from paramserver.server.state import ShardState
from paramserver.server.storage.checkpoint_content import export_state
from paramserver.server.storage.checkpoint_file import write_checkpoint
from paramserver.server.storage.log_file import WriteAheadLog, fsync_dir
from paramserver.server.storage.log_format import event_to_record
from paramserver.server.storage.recovery import CHECKPOINT_NAME, LOG_NAME, numbered, recover

logger = logging.getLogger(__name__)

FAULT_LOG_EVERY_S = 60.0  # storage faults are logged at most this often


class StorageError(RuntimeError):
    """The write-ahead log could not be written or synced; the batch is not durable."""


class ShardStorage:
    """The shard's data directory: recover, append, sync, checkpoint, close."""

    def __init__(
        self, cfg: ShardConfig, index: int, timer: Callable[[], float] | None = None
    ) -> None:
        """Prepare (touches no files until `recover`).

        Args:
            cfg: settings (data_dir, fsync).
            index: shard index; files live in <data_dir>/shard-<index>/.
            timer: the recovered states' step timer (see ShardState).
        """
        self.cfg = cfg
        self.index = index
        self.timer = timer
        self.dir = daemon.shard_dir(cfg.data_dir, index)
        self.generation = 0
        self._wal: WriteAheadLog | None = None
        self.last_checkpoint_s: float | None = None
        self.last_checkpoint_bytes: int | None = None
        self.replayed = 0
        self.faults = 0  # storage faults since the last good write
        self._fault_logged = -FAULT_LOG_EVERY_S  # monotonic time of the last fault log
        self._fault_reported = False  # whether the last fault was logged

    def recover(self, quiet: bool = False) -> ShardState:
        """Rebuild the state from the directory and open the log for appends.

        Args:
            quiet: log the summary at DEBUG (see `reload`).

        Returns:
            The recovered state (empty for a new data dir).

        Raises:
            DurabilityError: see `paramserver.server.storage.recovery.recover`.
            OSError: the directory cannot be created or read.
        """
        found = recover(self.cfg, self.index, self.dir, self.timer, quiet)
        self.replayed = found.replayed
        self.generation = found.segment
        self._wal = WriteAheadLog(
            self.dir / f"wal-{found.segment}.log",
            fsync=self.cfg.fsync,
            truncate_to=found.truncate_to,
        )
        if found.skipped_corrupt and found.state.initialized:
            self.checkpoint(found.state, time.time())
        return found.state

    def reload(self) -> ShardState:
        """Rebuild the state from disk after a failed append or sync (the log holds the last sync).

        Logged with the fault's rate limit (a full disk fails every batch).

        Returns:
            The state of the checkpoint plus the synced log.
        """
        self.close()
        state = self.recover(quiet=True)
        logger.log(
            logging.WARNING if self._fault_reported else logging.DEBUG,
            "shard %d: state rebuilt from disk after a storage fault: versions %s",
            self.index,
            state.versions(),
            extra={"shard": self.index},
        )
        return state

    def append(self, events: Iterable[Event]) -> None:
        """Append events to the log (durable with the next `sync`).

        Args:
            events: the events applied since the last sync, in order.

        Raises:
            StorageError: one could not be written; the log is cut back to the
                last sync (nothing of this batch stays), so `reload` before going on.
            OSError: that cut failed too (the shard must stop).
        """
        assert self._wal is not None, "call recover() first"
        try:
            for event in events:
                self._wal.append(*event_to_record(event))
        except OSError as exc:
            self._wal.rollback()
            if self._wal.broken:
                raise
            raise self._fault("append to", exc) from exc
        if self.faults:
            logger.warning(
                "shard %d: the write-ahead log is writable again after %d failure(s)",
                self.index,
                self.faults,
                extra={"shard": self.index, "faults": self.faults},
            )
            self.faults = 0

    def sync(self) -> None:
        """fsync what was appended (before any reply of the batch is sent).

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
        self._fault_reported = now - self._fault_logged >= FAULT_LOG_EVERY_S
        if self._fault_reported:
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

    def checkpoint(self, state: ShardState, now: float) -> bool:
        """Write a checkpoint, start a new log segment, delete what is no longer needed.

        Args:
            state: the shard's state (synced with the log).
            now: wall-clock seconds (for the log line).

        Returns:
            Whether it was written: False before init, or when storage failed
            (logged; the log keeps everything meanwhile).
        """
        assert self._wal is not None, "call recover() first"
        if not state.initialized:
            return False
        try:
            self.sync()
        except StorageError:
            return False
        existing = [*numbered(self.dir, CHECKPOINT_NAME), *numbered(self.dir, LOG_NAME)]
        gen = max([self.generation, *existing]) + 1
        start = time.perf_counter()
        meta, arrays = export_state(state)
        path = self.dir / f"checkpoint-{gen}.ckpt"
        try:
            size = write_checkpoint(path, meta, arrays, fsync=self.cfg.fsync)
            try:
                wal = WriteAheadLog(self.dir / f"wal-{gen}.log", fsync=self.cfg.fsync)
            except OSError:  # appends must not go on in a segment older than the checkpoint
                path.unlink(missing_ok=True)
                raise
        except OSError as exc:
            self._fault("write a checkpoint in", exc)
            return False
        self._wal.close()
        self._wal = wal
        self.generation = gen
        self._prune()
        self.last_checkpoint_s = time.perf_counter() - start
        self.last_checkpoint_bytes = size
        logger.info(
            "shard %d checkpoint %d: %d bytes in %.3f s",
            self.index,
            gen,
            size,
            self.last_checkpoint_s,
            extra={"shard": self.index, "checkpoint": gen, "bytes": size, "at": now},
        )
        return True

    def _prune(self) -> None:
        """Keep the newest two checkpoints and the log segments from the older one on."""
        checkpoints = numbered(self.dir, CHECKPOINT_NAME)
        keep = sorted(checkpoints)[-2:]
        oldest = keep[0] if len(keep) == 2 else 0
        for n, path in checkpoints.items():
            if n not in keep:
                path.unlink(missing_ok=True)
        for n, path in numbered(self.dir, LOG_NAME).items():
            if n < oldest:
                path.unlink(missing_ok=True)
        fsync_dir(self.dir, self.cfg.fsync)

    def close(self) -> None:
        """Sync and close the log."""
        if self._wal is not None:
            self._wal.close()
            self._wal = None
