"""A shard's data directory while it runs: log appends, one fsync per batch, checkpoints.

This module owns the files of ``<data_dir>/shard-<i>/`` and the order in
which they change; what the log records and checkpoints mean is
`paramserver.server.storage.wal` and `.checkpoint`, how a state
is rebuilt from them `.recovery`. When to checkpoint is the shard core's
decision (`paramserver.server.core`).

Layout:

    checkpoint-<n>.ckpt   the shard's state at checkpoint n (n = 1, 2, ...)
    wal-<n>.log           the events after checkpoint n (wal-0: after the empty state)
    checkpoint.hold       made by an operator (or a test), never by the shard:
                          background checkpoint writes pause while it exists
    log.hold              likewise: the log writer thread waits before each fsync
                          while it exists (`paramserver.server.group_commit`)

A checkpoint n is taken between two loop turns, after the log is synced:
wal-<n>.log is started (appends go on there) and the state as it is then is
captured (`begin_checkpoint`); the file is written from a thread while the
loop serves (`paramserver.server.storage.checkpoint_job`: copy-on-write per
fragment, a second copy only for a step whose pending deltas near the
limit), atomically (fsync of the
file, rename, fsync of the directory). Only then, in the job's thread, is
anything deleted: the newest two checkpoints are kept, and the log segments
from the older of them on, so the previous checkpoint and the log after it
stay as a fallback. Until then, and when the write fails or the process
dies, recovery loads the previous checkpoint and replays wal-<n-1> and
wal-<n> (nothing is lost; a failed checkpoint is tried again later under a
new number). One job at a time: `poll_checkpoint` collects it,
`abandon_checkpoint` stops it (at stop; a rebuild from disk stops it too).
`checkpoint` writes one in the calling thread (at stop, and at once when
recovery skipped a corrupted checkpoint).

Storage faults (disk full, file-size limit, read-only, I/O error): a failed
sync raises `StorageError` and cuts the log back to what the last good sync
covered (`paramserver.server.storage.wal`), so nothing of the batch is on
disk; the caller then rebuilds its state from disk (`reload`) and refuses the
batch. A failed append costs only its own record (`append_each`): the
caller rebuilds its state from disk and refuses that request alone, while
the rest of the batch is acked. A failed checkpoint is logged, counted in `faults` and
reported not written (the log still holds everything). Faults are logged at
most once per `FAULT_LOG_EVERY_S`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from paramserver.plumbing import daemon
from paramserver.server.config import ShardConfig
from paramserver.server.fragment import AcceptEvent, Event, StepEvent
from paramserver.server.state import ShardState
from paramserver.server.storage.checkpoint import checkpoint_summary, export_state
from paramserver.server.storage.checkpoint_job import HOLD_NAME, CheckpointJob, CheckpointResult
from paramserver.server.storage.recovery import CHECKPOINT_NAME, LOG_NAME, numbered, recover
from paramserver.server.storage.wal import (
    WriteAheadLog,
    event_to_record,
    frame_checks,
    fsync_dir,
)

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
        # the newest durable checkpoint for status: generation, step, versions, time, bytes,
        # seconds (None: none yet; after a restart, the loaded one with seconds None)
        self.last_checkpoint: dict[str, Any] | None = None
        self._job: CheckpointJob | None = None
        self._job_summary: dict[str, Any] = {}
        self.replayed = 0
        self.faults = 0  # storage faults since the last good write
        self.last_fault = ""  # what the last one was (one line)
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
        if found.loaded is not None:
            self.last_checkpoint = {"generation": found.checkpoint, **found.loaded}
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
        if self._job is not None:  # recovery reads the directory a writer would change
            self._job.abandon()  # (collected, as not written, by the next poll_checkpoint)
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
                self._wal.append(*_record(event))
        except OSError as exc:
            self._wal.rollback()
            if self._wal.broken:
                raise
            raise self._fault("append to", exc) from exc
        if self.faults:
            self._writable_again()

    def append_each(self, events: Sequence[Event]) -> list[Event]:
        """Append a batch's events one by one; a record that fails costs only its own event.

        A failed append cuts off that record alone (`WriteAheadLog.append`), and
        the batch goes on: other islands' events in the batch stay. A step
        after a lost event is not appended (it may have merged the lost delta:
        it is taken again, from the state rebuilt from disk), nor is one whose
        own record fails: then the whole batch is cut back (`rollback`).

        Args:
            events: the events applied since the last sync, in order.

        Returns:
            The events that are not in the log (in order; empty when all are):
            the caller rebuilds its state from disk (`reload`) after `sync`
            whenever this is not empty.

        Raises:
            OSError: a record could not even be cut off (the shard must stop).
        """
        assert self._wal is not None, "call recover() first"
        lost: list[Event] = []
        for event in events:
            if lost and isinstance(event, StepEvent):
                lost.append(event)
                continue
            try:
                self._wal.append(*_record(event))
            except OSError as exc:
                if self._wal.broken:  # the record could not be cut off: cut the batch
                    self._wal.rollback()
                    if self._wal.broken:
                        raise
                    self._fault("append to", exc)
                    return list(events)
                self._fault("append to", exc)
                if isinstance(event, StepEvent):  # earlier steps may hold later deltas: all go
                    self._wal.rollback()
                    if self._wal.broken:
                        raise
                    return list(events)
                lost.append(event)
        if not lost and self.faults:
            self._writable_again()
        return lost

    def _writable_again(self) -> None:
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
        self.last_fault = str(error)
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

    @property
    def checkpoint_writing(self) -> bool:
        """Whether a checkpoint job has begun and not been collected by `poll_checkpoint`."""
        return self._job is not None

    def begin_checkpoint(self, state: ShardState, now: float) -> CheckpointJob | None:
        """Start a new log segment and capture the state for a checkpoint (writes no data yet).

        Call between loop turns, with no job in flight; then `job.start()`
        (background) or `job.run()`, and `poll_checkpoint` until it returns.

        Args:
            state: the shard's state (synced with the log here).
            now: wall-clock seconds (the capture's time, for status and the log line).

        Returns:
            The job, or None: not initialized, or storage failed (logged and
            counted; try again later).
        """
        assert self._wal is not None, "call recover() first"
        assert self._job is None, "one checkpoint at a time: poll_checkpoint() first"
        if not state.initialized:
            return None
        try:
            self.sync()
        except StorageError:
            return None
        existing = [*numbered(self.dir, CHECKPOINT_NAME), *numbered(self.dir, LOG_NAME)]
        gen = max([self.generation, *existing]) + 1
        try:  # from here on appends go after the captured state
            wal = WriteAheadLog(self.dir / f"wal-{gen}.log", fsync=self.cfg.fsync)
        except OSError as exc:
            self._fault("start a log segment in", exc)
            return None
        self._wal.close()
        self._wal = wal
        self.generation = gen
        meta, arrays = export_state(state)
        meta["taken_at"] = now
        self._job_summary = {"generation": gen, **checkpoint_summary(meta)}
        self._job = CheckpointJob(
            self.dir / f"checkpoint-{gen}.ckpt",
            gen,
            meta,
            arrays,
            fsync=self.cfg.fsync,
            hold=self.dir / HOLD_NAME,
            then=self._prune,  # in the writer's thread, once the file is durable
        )
        return self._job

    def before_step(self, fragment: int, urgent: bool = False) -> bool:
        """Whether a fragment may be stepped now (a checkpoint job may copy it first).

        Args:
            fragment: the fragment about to be stepped.
            urgent: its pending deltas are near the limit: copy it regardless.

        Returns:
            False while a checkpoint job still needs another fragment's copy
            and the step is not urgent: step it in a later turn (see
            CheckpointJob.before_step).
        """
        return self._job is None or self._job.before_step(fragment, urgent)

    def poll_checkpoint(self) -> CheckpointResult | None:
        """Collect a checkpoint job that ended: prune after a durable one, report a failed one.

        Returns:
            The job's result once it ended (then the next one may begin), else None.
        """
        job = self._job
        if job is None or not job.done:
            return None
        self._job = None
        result = job.result
        assert result is not None
        if not result.written:
            if result.exc is not None:
                self._fault("write a checkpoint in", result.exc)
            else:
                logger.warning(
                    "shard %d checkpoint %d not written: %s",
                    self.index,
                    result.generation,
                    result.error,
                    extra={"shard": self.index, "checkpoint": result.generation},
                )
            return result
        self.last_checkpoint_s = result.seconds
        self.last_checkpoint_bytes = result.bytes
        self.last_checkpoint = {
            **self._job_summary,
            "bytes": result.bytes,
            "seconds": round(result.seconds, 6),
        }
        logger.info(
            "shard %d checkpoint %d: %d bytes in %.3f s",
            self.index,
            result.generation,
            result.bytes,
            result.seconds,
            extra={"shard": self.index, "checkpoint": result.generation, "bytes": result.bytes},
        )
        return result

    def abandon_checkpoint(self) -> CheckpointResult | None:
        """Stop a checkpoint job in flight and wait for it (its file is not made).

        Returns:
            Its result (written, if it finished first), or None when none was in flight.
        """
        if self._job is None:
            return None
        self._job.abandon()
        return self.poll_checkpoint()

    def checkpoint(self, state: ShardState, now: float) -> bool:
        """Write a checkpoint in the calling thread, start a new log segment, prune.

        Args:
            state: the shard's state (synced with the log).
            now: wall-clock seconds (for status and the log line).

        Returns:
            Whether it was written: False before init, or when storage failed
            (logged; the log keeps everything meanwhile).
        """
        self.abandon_checkpoint()
        job = self.begin_checkpoint(state, now)
        if job is None:
            return False
        job.run()  # (an operator's hold pauses background writes only)
        result = self.poll_checkpoint()
        return result is not None and result.written

    def _prune(self) -> None:
        """Keep the newest two checkpoints and the log segments from the older one on.

        Run by a checkpoint job once its file is durable (in its thread: while a
        job runs, the loop changes nothing in the directory but the current log).
        """
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
        """Stop a checkpoint in flight, sync and close the log."""
        if self._job is not None:
            self._job.abandon()
        if self._wal is not None:
            self._wal.close()
            self._wal = None


def _record(event: Event) -> tuple[dict[str, Any], list[Any], list[int | None] | None]:
    """An event's log record and, for an accepted delta's frames, the crc32s checked on receipt.

    Args:
        event: the event.

    Returns:
        (header, payload, checks) for `WriteAheadLog.append`.
    """
    header, payload = event_to_record(event)
    received = isinstance(event, AcceptEvent) and event.frames is not None
    return header, payload, frame_checks(event.frames) if received else None
