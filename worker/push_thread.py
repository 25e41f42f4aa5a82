"""The island's push: when each fragment's delta is due, and the thread that pushes it.

The thread: a session's taken deltas are framed, persisted and pushed beside
training. At a round's end (or a streamed fragment's step) `Session.step` takes the
delta (`DeviceExchange.take`: the jitted delta + quantize is dispatched and the
anchors move at once; `HostExchange.take`: the host copy and the deltas) and
hands a `PushJob` to the session's `PushThread`, then returns. The thread, in
the order the jobs came:

1. brings the codes to the host and frames them (`job.taken.frames()`) into
   the requests of the deltas' records in the island's ledger
   (`worker.deltas.DeltaLedger.framed`: the session noted each delta there
   when it took it);
2. waits, before the session's first new delta, until the deltas a previous
   run left were resolved (on the ledger's Condition);
3. persists the batch (`Outbox.record`: the deltas the ledger saw resolved
   since the last batch, then the new ones, one append and one fsync);
4. hands each delta to the client (`Client.push_request`, back-pressure
   included) and tells the ledger (`handed`);
5. once the job is done, at most every `heap.TRIM_EVERY_S`, hands the C heap's
   freed memory back to the OS (`paramserver.plumbing.heap.trim`), as a shard
   does after its steps, and its own arena's free top (`heap.trim_thread_top`:
   the frames it wrote, freed once acked): the island's RSS otherwise creeps up
   in glibc's arenas.

So persist-before-send holds as before: nothing of a delta leaves before it is
in the outbox file, fsynced. At most `max_in_flight` jobs are queued or running:
`wait_for_room` blocks the step until one is done, and the session counts
that wait as lost time. A failure is kept and raised by the next `step`
(`PushFailed`); from then on the thread persists the jobs it gets and pushes
none (the outbox keeps them for the next start; the ledger's `unhanded`
names them at close). `halt` (close, abandon, the
session's stop) makes pushes stop waiting for a slot: they queue past
`max_unacked`, and the client's close flushes or keeps them. With
`max_in_flight` 0 the session runs the same `deliver` inline (the synchronous
exchange).

The schedule: which fragments a `step` pushes (`due_fragments`,
`flush_fragments`, and in quorum mode `unblocked`: a fragment whose newest
delta is not merged yet skips its push and carries its work into the next).
Without streaming an island pushes every fragment at the end of its round, so
its link carries the whole delta in one burst every H steps. With streaming
(`--streaming true`, Streaming DiLoCo, arXiv 2501.18512) fragment p of P is
pushed at inner step ``floor(p * H / P)`` of each round, each with its own
delta since its own last push, so the bytes of a round are spread over it and
the peak rate falls by about P.

Steps are counted within a round as ``k = 1 .. H`` (k inner steps done); step
0 of a round is the end of the previous one, so a fragment whose offset is 0
(always fragment 0) is pushed at ``k = H``, where a non-streaming island
pushes everything. In the first round fragment p > 0 thus sends the work of
its first ``floor(p * H / P)`` steps, and from then on every push carries H
steps of work. When the island stops (its last round, or SIGTERM), every
fragment with unsent steps is pushed once more ("the flush"), so a streaming
run puts exactly the tokens of a non-streaming one into the model.

Adopting published versions stays per fragment (`worker.exchange.FragmentSync`
keeps a base version and an anchor per fragment), so nothing else changes.

Sync mode: a cluster of mode "sync" makes every island wait after its round
for the merge of all its fragments; there is nothing left to overlap, and
waiting per fragment would stall training P times per round. An island with
`--streaming true` therefore refuses a sync cluster at join
(`check_streaming_mode`).
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from paramserver.client import Client, PushRequest
from paramserver.plumbing import heap
from worker.deltas import DeltaLedger
from worker.outbox import Outbox

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # waits sleep in slices this long (Ctrl-C reaches a waiting main thread)


class PushFailed(RuntimeError):
    """The background exchange could not push a delta (raised by the next `Session.step`).

    Attributes:
        island: the island id.
        round: the round id of the delta that failed.
        cause: the exception it failed with (also `__cause__`).
    """

    def __init__(self, island: str, round: int, cause: BaseException) -> None:
        super().__init__(
            f"island {island!r}: pushing round {round} failed: {type(cause).__name__}: {cause}; "
            "its deltas and the later ones are kept in the outbox (data dir) for the next start"
        )
        self.island, self.round, self.cause = island, round, cause


@dataclass
class PushJob:
    """One batch of deltas taken at one step: what the thread frames, persists and pushes.

    Their fields (base version, tokens, steps) are in their records in the ledger.

    Attributes:
        round: their round id.
        taken: the exchange's taken delta (`frames()` -> fragment -> codec frames).
        fragments: their fragments, in push order.
    """

    round: int
    taken: Any
    fragments: list[int]


class PushThread:
    """Process 0's background exchange of one session (see the module docstring)."""

    def __init__(
        self,
        island: str,
        client: Client,
        outbox: Outbox | None,
        ledger: DeltaLedger,
        max_in_flight: int,
        settle_resent: Callable[[threading.Event], None],
    ) -> None:
        """Start the thread.

        Args:
            island: the island id (for messages).
            client: the joined client.
            outbox: the outbox file (None: no data dir, nothing persisted).
            ledger: the island's ledger of deltas (their records, payloads and fates).
            max_in_flight: jobs queued or running before `wait_for_room` blocks (>= 1).
            settle_resent: called with `halt` before each job's pushes (waits until the
                deltas a previous run left are resolved).
        """
        self.island, self.client, self.outbox, self.ledger = island, client, outbox, ledger
        self.max_in_flight = max(1, max_in_flight)
        self.halt = threading.Event()  # pushes stop waiting for a slot
        self.failure: PushFailed | None = None
        self.busy_s = 0.0  # seconds spent framing, persisting and pushing
        self.trim_s = 0.0  # seconds trimming the C heap after jobs (not in busy_s)
        self._trimmed_at = -math.inf
        self._settle_resent = settle_resent
        self._cond = threading.Condition()
        self._jobs: collections.deque[PushJob] = collections.deque()
        self._running = 0  # jobs taken off the queue and not done
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"push-{island}", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        """Jobs queued or running."""
        with self._cond:
            return len(self._jobs) + self._running

    def submit(self, job: PushJob) -> None:
        """Queue a job (call `wait_for_room` first to keep within `max_in_flight`)."""
        with self._cond:
            self._jobs.append(job)
            self._cond.notify_all()

    def wait_for_room(self, stop: Callable[[], bool]) -> float:
        """Block while `max_in_flight` jobs are queued or running.

        Args:
            stop: ends the wait when it returns True (the session's stop, close, abandon).

        Returns:
            Seconds waited.
        """
        t0 = time.monotonic()
        with self._cond:
            while len(self._jobs) + self._running >= self.max_in_flight and not stop():
                if self.failure is not None or not self._thread.is_alive():
                    break
                self._cond.wait(_POLL_S)
        return time.monotonic() - t0

    def wait_idle(self, stop: Callable[[], bool], timeout_s: float | None = None) -> bool:
        """Block until no job is queued or running.

        Args:
            stop: ends the wait when it returns True.
            timeout_s: the longest wait (None: no limit but `stop`).

        Returns:
            True once idle.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._jobs or self._running:
                if stop() or not self._thread.is_alive():
                    return False
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                self._cond.wait(_POLL_S)
        return True

    def close(self, timeout_s: float) -> bool:
        """Halt the pushes' waits, let the thread finish the queued jobs, end it.

        Args:
            timeout_s: the longest wait for the thread.

        Returns:
            Whether the thread ended (False: it is stuck, e.g. in a device call; it is a
            daemon thread and the outbox keeps what it persisted).
        """
        self.halt.set()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("island %s: the push thread did not end within %.1f s",
                           self.island, timeout_s)  # fmt: skip
            return False
        return True

    # -- the thread ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closing:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._running += 1
            t0 = time.perf_counter()
            try:
                self._deliver_or_keep(job)
            finally:
                self.busy_s += time.perf_counter() - t0
                with self._cond:
                    self._running -= 1
                    self._cond.notify_all()
            self._trim_heap()

    def _trim_heap(self) -> None:
        """Hand the C heap's free memory back to the OS, at most every `heap.TRIM_EVERY_S`.

        A round's frames, codes and the client's message buffers are freed but stay
        in glibc's arenas (RSS at its high-water mark, growing as they fragment);
        trimmed here, beside training and after the job is done, so no `step` waits.
        """
        now = time.monotonic()
        if now - self._trimmed_at < heap.TRIM_EVERY_S:
            return
        heap.trim()
        heap.trim_thread_top()  # the frames this thread wrote: its own arena's top
        self._trimmed_at = time.monotonic()
        self.trim_s += self._trimmed_at - now

    def _deliver_or_keep(self, job: PushJob) -> None:
        try:
            if self.failure is None:
                deliver(job, self.client, self.outbox, self.ledger, self.halt, self._settle_resent)
                return
            batch = requests(job, self.ledger)  # failed before: persist only, for the next start
            if self.outbox is not None:
                self.outbox.record([], batch)
        except BaseException as exc:  # kept for the next `step`, never lost silently
            logger.error("island %s: pushing round %d failed: %s", self.island, job.round, exc)
            with self._cond:
                self.failure = PushFailed(self.island, job.round, exc)
                self.failure.__cause__ = exc
                self._cond.notify_all()


def requests(job: PushJob, ledger: DeltaLedger) -> list[PushRequest]:
    """The job's deltas as PushRequests, kept in their ledger records (brings codes to host)."""
    return ledger.framed(job.round, job.taken.frames(), job.fragments)


def deliver(
    job: PushJob,
    client: Client,
    outbox: Outbox | None,
    ledger: DeltaLedger,
    stop: threading.Event,
    settle_resent: Callable[[threading.Event], None],
) -> None:
    """Frame a job's deltas, persist them (one fsync), then push them.

    Args:
        job: the deltas.
        client: the joined client.
        outbox: where they are persisted first (None: nowhere).
        ledger: the island's ledger of deltas (their fields; told what was framed and handed).
        stop: ends a push's wait for a slot (it queues past the limit).
        settle_resent: called with `stop` before the persist (the previous run's deltas
            first).

    Raises:
        ClientError: a push failed; the deltas not handed over are in the outbox (and
            `ledger.unhanded()`).
    """
    batch = requests(job, ledger)
    try:
        settle_resent(stop)
    except BaseException:  # e.g. the client closed meanwhile: kept for the next start
        if outbox is not None:
            outbox.record([], batch)
        raise
    if outbox is not None:  # one fsync, before anything leaves
        outbox.record(ledger.take_resolved(), batch)
    for d in batch:
        client.push_request(d, stop=stop)  # the request travels whole
        ledger.handed(d)


# -- the schedule --------------------------------------------------------------


class StreamingError(ValueError):
    """Streaming cannot run against this cluster; the message says what to change."""


def fragment_offsets(inner_steps: int, num_fragments: int) -> list[int]:
    """Inner step of the round at which each fragment is pushed.

    Args:
        inner_steps: H, inner steps per round (>= 1).
        num_fragments: P, fragments in the plan (>= 1).

    Returns:
        ``[floor(p * H / P) for p in range(P)]`` (0 = the round's end).
    """
    if inner_steps < 1 or num_fragments < 1:
        raise ValueError(
            f"inner_steps and num_fragments must be >= 1, got {inner_steps} and {num_fragments}"
        )
    return [p * inner_steps // num_fragments for p in range(num_fragments)]


def due_fragments(step: int, inner_steps: int, num_fragments: int) -> list[int]:
    """The fragments to push once `step` inner steps of the round are done.

    Args:
        step: inner steps done in this round, 1 .. H.
        inner_steps: H.
        num_fragments: P.

    Returns:
        Fragment indexes p whose offset ``floor(p * H / P)`` equals ``step mod H``,
        ascending (several share a step when H < P).
    """
    if not 1 <= step <= inner_steps:
        raise ValueError(f"step must be in 1..{inner_steps}, got {step}")
    at = step % inner_steps
    return [
        p for p, offset in enumerate(fragment_offsets(inner_steps, num_fragments)) if offset == at
    ]


def flush_fragments(unsent_steps: Mapping[int, int]) -> list[int]:
    """The fragments to push when the island stops: those with unsent work.

    Args:
        unsent_steps: fragment -> inner steps since its last push.

    Returns:
        Fragment indexes with at least one unsent step, ascending.
    """
    return sorted(p for p, steps in unsent_steps.items() if steps > 0)


def check_streaming_mode(streaming: bool, mode: str) -> None:
    """Refuse streaming against a cluster of mode "sync" (see the module docstring).

    Args:
        streaming: the island's `streaming` setting.
        mode: the cluster's merge mode, from the join.

    Raises:
        StreamingError: streaming against a sync cluster (one line: what to change).
    """
    if streaming and mode == "sync":
        raise StreamingError(
            "streaming true needs a cluster of mode quorum or async, and this one runs "
            "mode sync (islands wait for the merge after each round: nothing to overlap); "
            "start the island with --streaming false or the shards with --mode quorum"
        )


def unblocked(
    due: list[int], last_push: Mapping[int, int], outcomes: Mapping[tuple[int, int], str]
) -> list[int]:
    """The due fragments of a quorum-mode island whose previous delta is settled.

    An island keeps at most one unmerged delta per fragment in quorum mode
    while its shards are up: a fragment whose last push is still pending,
    deferred (`too_many_pending`) or acked but not merged skips this push, and
    its next push carries the work of both rounds against a newer base. (With
    a shard down the session does not ask: the client queues pushes as before
    and re-sends them when the shard is back.) A shard slower than the islands thus gets
    fewer, larger deltas instead of a queue of stale ones that it refuses, has
    re-sent and merges late under the outer momentum. (Sync mode waits for
    each round's merge; async mode steps on every delta as it comes, so its
    islands push every round: examples/own_mlp.py, async, ended at 0.028
    without the skip and 0.049 with it. A multi-process island pushes on
    schedule: its processes must agree on what each step pushes. An island
    with `skip_stale_pushes` false never asks.)

    Args:
        due: fragments due to push now.
        last_push: fragment -> round id of its last push.
        outcomes: (round, fragment) -> `Client.delta_outcomes` of those pushes.

    Returns:
        The due fragments never pushed, or whose last push was merged or rejected.
    """
    settled = {f for (_, f), outcome in outcomes.items() if outcome in ("merged", "rejected")}
    return [f for f in due if f not in last_push or f in settled]
