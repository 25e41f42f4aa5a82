"""One checkpoint written off the serving loop, from the state as it was at a step boundary.

This module owns how a checkpoint is written while the shard goes on
serving: the loop captures the state between two turns (`export_state`: a
fresh meta map, views of the live arrays, the pending deltas as accepted)
and a `CheckpointJob` writes that capture from a thread
(`checkpoint.write_checkpoint`, piece by piece). Where the files go and
what happens after a job is `paramserver.server.storage.shard_storage`'s.

Consistency is copy-on-write per fragment. Only an outer step changes a
fragment's arrays, and the loop asks `before_step(fragment)` first:

- fragment already written, or the job is over: step at once;
- otherwise, if no other fragment's copy is still held: copy what of this
  fragment is not written yet (its params, optimizer state, residual) and
  step; the writer takes those arrays from the copy from then on;
- otherwise, if the step is urgent (the core says some island has half its
  pending limit waiting on the fragment: deferring more would refuse its
  pushes `too_many_pending`): copy it too, beside the other copy;
- otherwise: not now (the core defers that step to a later turn, within a
  fragment's write time), so a second copy is taken only under that pressure.

The writer copies each piece (`CHUNK_BYTES`) of a live array into its own
buffer under the job's lock, so a step never runs while a piece is read.
Transient memory: one piece (8 MiB) plus one fragment's unwritten params,
optimizer state and residual (12 B per parameter of one fragment for
Nesterov with the int8 downlink, 10 with the momentum in bfloat16: a shard of F equal fragments, 12/F B/param
of the shard), plus one such copy for each urgent step meanwhile (at worst,
every fragment stepping urgently before the writer reaches it, the unwritten
part of the shard: 12 B/param); nothing when no fragment steps during the
write. The price: a deferred step waits up to one fragment's write, or
until its pending deltas make it urgent.

A job runs once (`run`, or `start` for a thread). In a thread it is paced
for the loop serving meanwhile: a lower CPU priority, a rest after each
piece as long as the piece took (`REST_PER_WORK`), an fdatasync every
`SYNC_EVERY_BYTES` (so the log's fsyncs never wait for a whole file's
writeback). `abandon` sets its stop signal and waits for the writer, which
notices it between pieces, while resting and while paused. While
``checkpoint.hold`` exists in the shard's directory a background job pauses
before each piece: an operator can keep the disk quiet for a while (e.g. for
a backup), and the tests catch a checkpoint in the middle of its file. The
log keeps every acknowledged delta meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from paramserver.server.storage.checkpoint import CHUNK_BYTES, live_fragment, write_checkpoint

logger = logging.getLogger(__name__)

HOLD_NAME = "checkpoint.hold"  # while this file exists, background checkpoint writes pause
HOLD_POLL_S = 0.05  # how often a paused write looks at the hold file again
# a background write is synced every this many bytes (see write_checkpoint's sync_every)
SYNC_EVERY_BYTES = 16 << 20
# after each piece a background writer rests this many times as long as the piece took:
# on a busy machine a writer flat out slowed the loop's acks ~5x (CPU: crc32, copies,
# the kernel's), resting 1x kept them within ~2-3x of quiet for a write ~1.6x longer
REST_PER_WORK = 1.0
WRITER_NICE = 10  # a background writer's CPU priority below the loop's


class CheckpointAbandoned(Exception):
    """The job's stop signal was set: the write gave up between two pieces."""


@dataclass
class CheckpointResult:
    """How a job ended: written (with its size and duration) or not (with the error)."""

    generation: int
    written: bool
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    exc: OSError | None = field(default=None, repr=False)  # the storage fault, if that was it


class CheckpointJob:
    """One checkpoint file written from a step-boundary capture; see the module docstring."""

    def __init__(
        self,
        path: Path,
        generation: int,
        meta: dict[str, Any],
        arrays: dict[str, np.ndarray],
        *,
        fsync: bool = True,
        hold: Path | None = None,
        then: Callable[[], None] | None = None,
    ) -> None:
        """Prepare a job (writes nothing yet).

        Args:
            path: the checkpoint file to write.
            generation: its generation (for the result).
            meta: the capture's meta map (owned by the job from now on).
            arrays: the capture's arrays (`export_state`: views of the live ones).
            fsync: fsync the file and directory.
            hold: pause before each piece while this file exists (None: never).
            then: run by the writer once the file is durable (the data dir's
                pruning: deleting an 800 MB file took 0.25 s, which the loop
                must not wait for); an OSError of it is logged, not a failure.
        """
        self.path = path
        self.generation = generation
        self.meta = meta
        self.arrays = arrays
        self.fsync = fsync
        self.hold = hold
        self.then = then
        self.result: CheckpointResult | None = None
        self.stop = threading.Event()  # abandon: the writer gives up at its next piece
        self._lock = threading.Lock()
        self._unwritten: dict[int, set[str]] = {}  # fragment -> its live arrays not yet written
        for name, arr in arrays.items():
            fragment = live_fragment(name)
            if fragment is not None and arr.nbytes:  # (an empty array is never read)
                self._unwritten.setdefault(fragment, set()).add(name)
        self._copies: dict[str, np.ndarray] = {}  # name -> a copy taken before a step
        self._piece = np.empty(CHUNK_BYTES, np.uint8)
        self._thread: threading.Thread | None = None
        self._background = False
        self._piece_at = 0.0

    # ----- the loop's side --------------------------------------------------------------

    def before_step(self, fragment: int, urgent: bool = False) -> bool:
        """Whether `fragment` may be stepped now; copies what the job still needs of it first.

        Args:
            fragment: the fragment the loop is about to step.
            urgent: copy it even while another fragment's copy is held (its
                pending deltas near the limit: deferring would refuse pushes).

        Returns:
            True: step it (nothing of it is read live any more); False: another
            fragment's copy is still held and the step is not urgent: step it
            in a later turn.
        """
        with self._lock:
            names = self._unwritten.get(fragment)
            if self.result is not None or not names:
                return True
            held = {live_fragment(name) for name in self._copies}
            if held - {fragment} and not urgent:
                return False
            for name in names - set(self._copies):
                self._copies[name] = np.array(self.arrays[name], copy=True)
            return True

    def start(self) -> None:
        """Write from a daemon thread, paced for the loop; `result` is set when it ends.

        The thread runs at a lower CPU priority (nice +10, where the OS has
        per-thread priorities), rests REST_PER_WORK times as long as each
        piece took, syncs every SYNC_EVERY_BYTES and pauses while the hold
        file exists, so the loop's turns come first on a busy machine.
        """
        self._thread = threading.Thread(
            target=self._run_in_background, name=f"checkpoint-{self.generation}", daemon=True
        )
        self._thread.start()

    @property
    def done(self) -> bool:
        """Whether the job has ended (written, failed or abandoned)."""
        return self.result is not None

    def abandon(self) -> None:
        """Stop the writer at its next piece (or pause) and wait for it; the file is not made."""
        self.stop.set()
        if self._thread is not None:
            self._thread.join()

    # ----- the writer's side ------------------------------------------------------------

    def _run_in_background(self) -> None:
        # Linux: a thread's id names it for setpriority; elsewhere it competes as it is
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        self.run(background=True)

    def run(self, background: bool = False) -> None:
        """Write the file (in the calling thread); never raises: see `result`.

        Args:
            background: pace it for a loop serving meanwhile (sync every
                SYNC_EVERY_BYTES, pause while the hold file exists).
        """
        self._background = background
        started = time.perf_counter()
        try:
            size = write_checkpoint(
                self.path,
                self.meta,
                self.arrays,
                fsync=self.fsync,
                read=self._read,
                sync_every=SYNC_EVERY_BYTES if background else 0,
            )
            result = CheckpointResult(self.generation, True, size, time.perf_counter() - started)
        except CheckpointAbandoned:
            result = CheckpointResult(self.generation, False, error="abandoned")
        except OSError as exc:
            result = CheckpointResult(self.generation, False, error=str(exc), exc=exc)
        except Exception as exc:  # a bug must not vanish with the thread
            logger.exception("checkpoint %d: write failed", self.generation)
            result = CheckpointResult(self.generation, False, error=f"{type(exc).__name__}: {exc}")
        if result.written and self.then is not None:
            try:
                self.then()
            except OSError as exc:  # the checkpoint is durable; old files go the next time
                logger.warning("checkpoint %d: after writing it: %s", self.generation, exc)
        with self._lock:
            self._copies.clear()
            self.arrays = {}
            self.result = result

    def _read(self, name: str, lo: int, hi: int) -> Any:
        """Bytes [lo, hi) of array `name` at the capture: a live array's piece is copied."""
        self._wait_while_held()
        with self._lock:
            source = self._copies.get(name, self.arrays[name])
            raw = source.reshape(-1).view(np.uint8)[lo:hi]
            fragment = live_fragment(name)
            if fragment is None:  # a pending delta: never changed, written as it is
                return raw
            piece = self._piece[: hi - lo]
            np.copyto(piece, raw)
            if hi == source.nbytes:  # the array's last piece: the copy is no longer needed
                self._unwritten[fragment].discard(name)
                self._copies.pop(name, None)
        return piece

    def _wait_while_held(self) -> None:
        if self.stop.is_set():
            raise CheckpointAbandoned
        if self._background and self._piece_at:
            worked = time.perf_counter() - self._piece_at
            if self.stop.wait(REST_PER_WORK * worked):
                raise CheckpointAbandoned
        self._piece_at = time.perf_counter()
        while self._background and self.hold is not None and os.path.exists(self.hold):
            if self.stop.wait(HOLD_POLL_S):
                raise CheckpointAbandoned
