"""Checking a push's payload, on the serving loop or off it: the check, its job, the thread.

A push's payload check reads every byte the island sent: the codec frames'
checksums (or zstd decompression), the header's sizes, that every value is
finite, and the delta's L2 norm for the robust clip (`check_payload`, a pure
function of the frames and the fragment's size). For a large push that is
tens of milliseconds or more, which heartbeats, acks and status waiting on
the same loop would wait too. So the core (`paramserver.server.core`) hands a
push of at least `ShardCore.check_off_loop_bytes` to the shard loop as a
`PushCheck` job, once the checks that read no payload byte passed; the loop
runs it in the checker thread (`PushChecker`) and keeps serving; on a later
turn it hands the checked job back (`ShardCore.finish_push`), which runs the
payload-free checks again (a copy of the push may have been accepted
meanwhile, or a step begun) and admits the checked delta. Its record is then
logged with the batch and fsynced before its ack, as any other push.

Order: one thread, first in first out, and once any push is being checked
every later push goes the same way (`ShardCore`), so pushes are admitted in
arrival order. Without a thread (the simulation tests, a draining loop) the
loop runs the job itself in the same turn.

The thread wakes the loop through a pipe whose read end the loop polls
beside its sockets (`wake_fd`), as the step thread does.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from codec.decode import CodedTensor
from paramserver.server.admission import outcomes
from paramserver.server.admission.outcomes import Outcome


@dataclass(frozen=True)
class CheckedPayload:
    """A push's payload, checked: its delta (kept coded) and norm, or why it is refused.

    Attributes:
        delta: the delta, or None when refused.
        norm: its L2 norm (float64; 0 when refused).
        refusal: the rejected outcome (codec_error, bad_shape, bad_dtype,
            non_finite; not yet counted), or None.
    """

    delta: CodedTensor | None
    norm: float = 0.0
    refusal: Outcome | None = None


def check_payload(payload: Sequence[Any], size: int) -> CheckedPayload:
    """Check a push's payload and take its delta's norm (reads every byte once; no state).

    Args:
        payload: codec frames of the tree {"delta": 1-D vector}.
        size: the fragment's size.

    Returns:
        The checked payload.
    """
    delta = outcomes.read_delta(payload, size)
    if isinstance(delta, Outcome):
        return CheckedPayload(None, refusal=delta)
    # the norm `step.weighting.l2_norm` takes of a coded delta, bit for bit
    return CheckedPayload(delta, float(np.sqrt(delta.sum_squares())))


@dataclass
class PushCheck:
    """A push whose payload the loop has checked off the core (`check_payload`).

    Attributes:
        request: the request as received (admitted: its rate was charged).
        header: its decoded header.
        payload: its codec frames.
        size: the fragment's size.
        result: the checked payload, once `run` ran.
    """

    request: Any
    header: dict[str, Any]
    payload: Sequence[Any]
    size: int
    result: CheckedPayload | None = field(default=None)

    def run(self) -> PushCheck:
        """Check the payload (any error becomes an internal_error refusal).

        Returns:
            self, with `result` set.
        """
        try:
            self.result = check_payload(self.payload, self.size)
        except Exception as exc:  # a bug must not take the shard down; it is counted
            refusal = outcomes.refused("internal_error", f"{type(exc).__name__}: {exc}")
            self.result = CheckedPayload(None, refusal=refusal)
        return self


class PushChecker:
    """One thread that checks submitted pushes in turn; see the module docstring."""

    def __init__(self) -> None:
        """Start the thread (a daemon: a stuck check never keeps the process alive)."""
        self._todo: queue.SimpleQueue[PushCheck | None] = queue.SimpleQueue()
        self._done: list[PushCheck] = []
        self._queued = 0  # submitted and not yet done
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        self._thread = threading.Thread(target=self._serve, name="push-check", daemon=True)
        self._thread.start()

    @property
    def wake_fd(self) -> int:
        """A file descriptor readable once a check is done (poll it beside the sockets)."""
        return self._read_fd

    def submit(self, job: PushCheck) -> None:
        """Check a push in the thread, after those submitted before it.

        Args:
            job: the push (from the core's effects).
        """
        with self._lock:
            self._queued += 1
            self._idle.clear()
        self._todo.put(job)

    def take(self) -> list[PushCheck]:
        """The checks done since the last call, in submission order.

        Returns:
            The jobs, each with its `result`.
        """
        try:
            while os.read(self._read_fd, 64):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            done, self._done = self._done, []
        return done

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted check is done (the drain at stop).

        Args:
            timeout_s: how long at most (None: until they are).

        Returns:
            Whether none is still running or queued.
        """
        return self._idle.wait(timeout_s)

    def close(self) -> None:
        """Stop the thread after the checks queued (if any) and close the pipe."""
        self._todo.put(None)
        self._thread.join()
        os.close(self._read_fd)
        os.close(self._write_fd)

    def _serve(self) -> None:
        while (job := self._todo.get()) is not None:
            job.run()
            with self._lock:
                self._done.append(job)
                self._queued -= 1
                if not self._queued:
                    self._idle.set()
            os.write(self._write_fd, b"\x01")
