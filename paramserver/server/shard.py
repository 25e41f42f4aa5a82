"""The shard daemon's I/O loop: sockets, the data directory, the core between them, the step thread.

This module owns the ZeroMQ side of one shard: a ROUTER for requests and a PUB
for sequenced updates and heartbeats (wire format: `paramserver.wire.protocol`),
and the order of I/O. Every decision is the core's (`paramserver.server.core`);
the files are `paramserver.server.storage`'s. One loop turn:

    1. poll the ROUTER until the core's next wake-up (or a stop check), then
       read what is queued, up to a batch (ZeroMQ takes one message from each
       peer with messages waiting in turn; the core refuses an island over its
       request rate before decoding anything, `paramserver.server.admission.gate`,
       so a flood costs a bucket check per message);
    2. `run_batch`: book a step the step thread finished (`core.finish_step`:
       its record joins this batch's, its update is published after them);
       admit the pushes whose payload the checker thread has checked
       (`core.finish_push`; a push that sends or decodes to at least
       CHECK_OFF_LOOP_BYTES is checked there, off the loop: `PushChecker`);
       hand every request read to `core.handle`; ask the core which steps
       are due (`core.due_steps`), let the data directory defer one a
       checkpoint still reads (`storage.before_step`), and hand the first of
       the rest to the step thread (`StepWorker`, below: the
       loop answers heartbeats, acks and status while a step runs, whatever
       its size), collecting the effects (and a PUB heartbeat);
       hand the batch's events, in order, to the log writer thread
       (`paramserver.server.group_commit`: it appends everything queued and
       fsyncs once per group); what promises nothing about the disk
       (heartbeats, status, refusals, a duplicate of a push already on disk)
       is settled and sent this turn, and every reply that promises
       durability (an ack, init_*) and every update waits for its record's
       fsync: on the turn after the writer reports it, `core.settle` decides
       it from that outcome (ack, or a storage_error refusal after the state
       is rebuilt from disk) and packs it. Without a writer (the simulation
       tests) `store` appends and fsyncs the batch ONCE in the turn;
    3. send it (replies, then publishes); on the first turn without
       requests after a publish (an update, or a heartbeat: then trimming
       finds little), return the C heap's free memory to the OS
       (`heap.trim`: a step's temporaries, the merged pushes' frames, sent
       updates);
    4. `maybe_checkpoint`: collect a checkpoint that finished writing; begin
       one when the core says it is due and the log writer holds nothing
       (the state is then the one on disk). It is captured here, between two
       turns, and written by a thread while the loop goes on acking pushes
       (`paramserver.server.storage.checkpoint_job`); the log is pruned only
       once it is durable.

`run_batch` and `maybe_checkpoint` hold no sockets, so the simulation tests
drive a core and a real data directory through them with a fake clock (the
checkpoint written in the calling thread; without a step worker the steps run
in the calling thread too).

On stop: let a step under way finish (logged, then published), answer what is queued (and
what the log writer still holds, once written), abandon a checkpoint still being written
(the log has everything), write a last one in the loop's thread, close the
sockets.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import zmq

from paramserver.plumbing import heap
from paramserver.plumbing.curve import CurveServer
from paramserver.plumbing.loop_thread import LoopThread
from paramserver.server.config import ShardConfig, bind_endpoints, local_endpoints
from paramserver.server.core import Effects, Request, ShardCore, StorageFailure
from paramserver.server.effects import PushCheck
from paramserver.server.group_commit import HOLD_LOG_NAME, GroupCommit, LogWriter
from paramserver.server.state import ShardState
from paramserver.server.step.fragment_step import StepWork
from paramserver.server.storage.checkpoint_job import CheckpointResult
from paramserver.server.storage.shard_storage import ShardStorage, StorageError
from paramserver.wire import protocol

logger = logging.getLogger(__name__)

# Requests handled per loop turn before stepping and syncing (bounds ack latency).
BATCH = 64
# Longest poll; bounds how late a set stop event is noticed.
STOP_CHECK_S = 0.1
# Replies (and frames) of at least this many bytes are tracked until ZeroMQ wrote them out.
TRACK_MIN_BYTES = 64 * 1024
# Pushes that send, or decode to, at least this many payload bytes (a fragment of this many
# elements) are checked in the checker thread, off the loop (`PushChecker`); smaller ones
# cost the loop well under a millisecond.
CHECK_OFF_LOOP_BYTES = 1 << 20
# Updates the PUB keeps for one subscriber (ZeroMQ SNDHWM; the default is 1000).
PUB_HWM = 64


def store(storage: ShardStorage, records: list) -> StorageFailure | None:
    """Append a batch's events and fsync once.

    Args:
        storage: the shard's data directory.
        records: the batch's events (none: nothing is written or synced).

    Returns:
        None when they are on disk, else what failed with the state rebuilt
        from disk: the events whose records failed (the others of the batch
        are on disk), or, when the sync failed, all of them (the log was cut
        back to its last good sync).

    Raises:
        OSError: the log failed and could not even be cut back to its last sync.
    """
    if not records:  # nothing written: no sync, and no sign the log is writable again
        return None
    try:
        lost = storage.append_each(records)  # a failed record costs its own request only
        storage.sync()
    except StorageError as exc:
        return StorageFailure(str(exc), storage.reload())
    if lost:
        return StorageFailure(storage.last_fault, storage.reload(), tuple(lost))
    return None


def run_batch(
    core: ShardCore,
    storage: ShardStorage,
    requests: list[Request],
    now: float,
    tick: bool = True,
    worker: StepWorker | None = None,
    checker: PushChecker | None = None,
    commit: GroupCommit | None = None,
) -> list[tuple[bytes | None, list[Any]]]:
    """Handle a batch of requests (and a tick), store it, and settle what to send.

    With a `worker`, a step that finished running there is booked first (its
    record joins this batch's, before its update is published), and a due
    step is handed to it at the end of the turn (one at a time) instead of
    run here.

    With a `checker`, the pushes whose payload checks finished there are
    admitted first (`core.finish_push`), and the pushes the core hands off
    (`Effects.checks`) are submitted to it; without one, or while draining,
    they are checked here, each as it is handled.

    With a `commit` (the log writer thread), what the writer made durable
    since the last turn is settled and sent first (after a storage fault:
    the state rebuilt from disk), and the batch's records are handed to it:
    what needs no durability is sent now, the rest when its record is on
    disk (`paramserver.server.group_commit`). Without one the batch is
    written and fsynced here (`store`) and settled at once.

    Args:
        core: the shard's core.
        storage: the shard's data directory.
        requests: the requests received this turn, in order.
        now: wall-clock seconds.
        tick: also step due fragments and heartbeat (False while draining at stop).
        worker: the step thread (None: steps run in this thread, in the turn).
        checker: the push checker thread (None: checks run in this thread).
        commit: the log writer (None: the log is written and synced in this thread).

    Returns:
        [(conn, frames)] to send in order, conn None for the PUB.
    """
    effects = Effects()
    sent = commit.complete(core, now) if commit is not None else []

    def cleared() -> list[int]:  # a checkpoint being written may defer a step (it copies first)
        due = core.due_steps(now)
        return [d.fragment for d in due if storage.before_step(d.fragment, d.urgent)]

    def start_next() -> None:  # the others are due again once it is done
        if tick and worker is not None and not worker.busy and (fragments := cleared()):
            worker.submit(core.start_step(now, fragments[0]))

    if worker is not None and (done := worker.take()) is not None:
        effects.extend(core.finish_step(now, done))
        start_next()  # before the held requests: what still waits for a step waits again
        requests = core.release_held() + requests
    if checker is not None:
        for job in checker.take():
            effects.extend(core.finish_push(now, job))
    for request in requests:
        handled = core.handle(now, request)
        checks, handled.checks = handled.checks, []
        effects.extend(handled)
        for job in checks:
            if checker is not None and tick:
                checker.submit(job)
            else:
                effects.extend(core.finish_push(now, job.run()))
    if worker is None:
        if tick:
            effects.extend(core.on_tick(now, cleared()))
    else:
        start_next()
        if tick:
            effects.extend(core.heartbeat(now, effects))
    if commit is not None:
        return sent + commit.submit(core, effects, now)
    return core.settle(effects, now, store(storage, effects.records))


def maybe_checkpoint(
    core: ShardCore,
    storage: ShardStorage,
    now: float,
    background: bool = False,
    may_begin: bool = True,
) -> None:
    """Collect a finished checkpoint; begin one when the core says it is due (between turns).

    Args:
        core: the shard's core.
        storage: the shard's data directory.
        now: wall-clock seconds.
        background: write it from a thread while serving goes on (the shard's
            loop); False writes it before returning (the simulation tests).
        may_begin: whether the state is the one on disk (the log writer holds
            nothing: `GroupCommit.idle`); False: a due one begins on a later turn.
    """
    report_checkpoint(core, storage, storage.poll_checkpoint(), now)
    if not may_begin or not core.checkpoint_due(now):
        return
    job = storage.begin_checkpoint(core.state, now)
    if job is None:
        core.checkpoint_done(now, False, error="could not begin (see the shard's log)")
        return
    core.checkpoint_started(now)
    if background:
        job.start()
        return
    job.run()
    report_checkpoint(core, storage, storage.poll_checkpoint(), now)


def report_checkpoint(
    core: ShardCore, storage: ShardStorage, result: CheckpointResult | None, now: float
) -> None:
    """Tell the core how a checkpoint job ended (nothing when `result` is None).

    Args:
        core: the shard's core.
        storage: the shard's data directory (its last_checkpoint, for status).
        result: what poll_checkpoint or abandon_checkpoint returned.
        now: wall-clock seconds.
    """
    if result is not None:
        core.checkpoint_done(now, result.written, storage.last_checkpoint, result.error or "")


class ShardServer:
    """One shard: bind, serve until a stop event, drain, checkpoint, close."""

    def __init__(
        self,
        cfg: ShardConfig,
        index: int,
        endpoints: list[tuple[str, str]] | None = None,
        router_bind: str | None = None,
        pub_bind: str | None = None,
    ) -> None:
        """Create the shard (binds nothing, reads no files yet).

        Args:
            cfg: cluster settings.
            index: this shard's index in [0, cfg.shards).
            endpoints: connect addresses [(router, pub), ...] of every shard,
                sent to islands in `welcome`; default local_endpoints(cfg).
            router_bind: ROUTER bind address; default from cfg (port + 2 * index);
                tcp://127.0.0.1:* binds a random port (see bound_endpoints).
            pub_bind: PUB bind address; default from cfg (port + 2 * index + 1).
        """
        default_router, default_pub = bind_endpoints(cfg, index)
        self.cfg = cfg
        self.index = index
        self.endpoints = endpoints if endpoints is not None else local_endpoints(cfg)
        self.router_bind = router_bind or default_router
        self._trim_due = False  # the PUB sent something (an update: a step) since the last trim
        self.pub_bind = pub_bind or default_pub
        self.ready = threading.Event()
        self.bound_endpoints: tuple[str, str] | None = None
        self.core: ShardCore | None = None
        self._storage: ShardStorage | None = None
        self._router: zmq.Socket | None = None
        self._pub: zmq.Socket | None = None
        self._worker: StepWorker | None = None
        self._checker: PushChecker | None = None
        self._commit: GroupCommit | None = None
        self._poller: zmq.Poller | None = None

    @property
    def state(self) -> ShardState | None:
        """The shard's state (None before `serve` recovered it)."""
        return self.core.state if self.core is not None else None

    def serve(self, stop: threading.Event) -> None:
        """Recover state from the data dir, bind, serve until `stop` is set, then drain.

        Args:
            stop: set it (from any thread or a signal handler) to stop.

        Raises:
            DurabilityError: the data dir cannot be recovered without losing
                acknowledged data (paramserver.server.storage.recovery; the message says what to do).
            zmq.ZMQError: a bind failed (e.g. port in use).
            CurveError: CURVE is configured but a key file or the allow dir is unusable.
            OSError: the write-ahead log failed and could not even be cut back to
                its last sync; the shard stops rather than serve a state it cannot
                vouch for (other storage faults are answered `storage_error`).
        """
        self._storage = storage = ShardStorage(self.cfg, self.index, time.perf_counter)
        state = storage.recover()
        ctx = zmq.Context()
        self._router = router = ctx.socket(zmq.ROUTER)
        self._pub = pub = ctx.socket(zmq.PUB)
        auth: CurveServer | None = None
        try:
            for sock in (router, pub):
                sock.setsockopt(zmq.LINGER, 0)
            if self.cfg.curve_secret_key_file:
                auth = CurveServer(
                    ctx,
                    self.cfg.curve_secret_key_file,
                    self.cfg.curve_allow_dir,
                    self.index,
                    self.cfg.curve_allow_map,
                ).start()
                auth.secure(router, "router")
                auth.secure(pub, "pub")
            router.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_frame_bytes)
            bound_peers(router, pub, self.cfg)
            router.bind(self.router_bind)
            pub.bind(self.pub_bind)
            self.bound_endpoints = (
                router.getsockopt_string(zmq.LAST_ENDPOINT),
                pub.getsockopt_string(zmq.LAST_ENDPOINT),
            )
            guard = auth.guard if auth is not None else None
            self.core = ShardCore(
                self.cfg, self.index, state, self.endpoints, time.time(), guard,
                storage.replayed, storage.last_checkpoint,
            )  # fmt: skip
            logger.info(
                "shard %d serving on %s (pub %s)",
                self.index,
                *self.bound_endpoints,
                extra={"shard": self.index, "versions": state.versions()},
            )
            self._worker = StepWorker()
            self._checker = PushChecker()
            writer = LogWriter(storage, storage.dir / HOLD_LOG_NAME)
            self._commit = GroupCommit(storage, writer)
            self.core.check_off_loop_bytes = CHECK_OFF_LOOP_BYTES
            self._poller = zmq.Poller()
            self._poller.register(router, zmq.POLLIN)
            self._poller.register(self._worker.wake_fd, zmq.POLLIN)
            self._poller.register(self._checker.wake_fd, zmq.POLLIN)
            self._poller.register(writer.wake_fd, zmq.POLLIN)
            self.ready.set()
            while not stop.is_set():
                self._turn(tick=True)
            self._worker.wait()  # a step under way is finished, logged and published
            self._checker.wait()  # the pushes being checked are answered in the drain
            self._turn(tick=False)  # drain: answer what is queued, without waiting for more
            while not self._commit.idle:  # acks of what the log writer still holds
                self._send(self._commit.drain(self.core, STOP_CHECK_S))
            # the writer stops at its next piece
            report_checkpoint(self.core, storage, storage.abandon_checkpoint(), time.time())
            if self.core.unsaved:  # (what the abandoned one would have covered, too)
                storage.checkpoint(self.core.state, time.time())
        finally:
            if self._worker is not None:
                self._worker.close()
            if self._checker is not None:
                self._checker.close()
            if self._commit is not None:
                self._commit.writer.close()
            if auth is not None:
                auth.stop()
            router.close(0)
            pub.close(0)
            ctx.term()
            storage.close()
            logger.info("shard %d stopped", self.index, extra={"shard": self.index})

    def _turn(self, tick: bool) -> None:
        """One loop turn: receive a batch, tick, make it durable, send, checkpoint."""
        core, storage, router = self.core, self._storage, self._router
        assert core and storage and router and self._pub
        now = time.time()
        timeout = min(STOP_CHECK_S, core.next_wake(now) - now) if tick else 0
        timeout_ms = max(0, int(timeout * 1000) + 1) if tick else 0
        requests: list[Request] = []
        if timeout_ms and self._poller is not None:  # wakes for a request or a finished step
            self._poller.poll(timeout_ms)
        while (len(requests) < BATCH or not tick) and router.poll(0):
            frames = router.recv_multipart(copy=False)
            # only a CURVE shard has ZAP User-Ids (reading one without ZAP raises and is caught)
            user_id = _user_id(frames[1]) if core.guard is not None and len(frames) > 1 else None
            requests.append(Request(bytes(frames[0]), frames[1:], user_id))
        now = time.time()
        idle = not requests
        commit = self._commit
        self._send(
            run_batch(core, storage, requests, now, tick, self._worker, self._checker, commit)
        )
        core.backlog.turn_done()
        stepping = self._worker is not None and self._worker.busy
        if idle and self._trim_due and not stepping:  # the first quiet turn after a publish
            self._trim_due = False
            heap.trim()
        if tick:
            may_begin = commit is None or commit.idle
            maybe_checkpoint(core, storage, now, background=True, may_begin=may_begin)

    def _send(self, messages: list[tuple[bytes | None, list[Any]]]) -> None:
        """Send a turn's messages in order: replies on the ROUTER, conn None on the PUB."""
        assert self.core and self._router and self._pub
        for conn, message in messages:
            if conn is None:
                self._pub.send_multipart(message, copy=False)
                self._trim_due = True
            else:
                send_reply(self._router, self.core, conn, message)


def bound_peers(router: zmq.Socket, pub: zmq.Socket, cfg: ShardConfig) -> None:
    """Cut off silent peers, and bound how many updates a slow subscriber holds (before binding).

    A connection that sends no bytes for `peer_silence_s` (ZMTP heartbeats:
    the shard PINGs every `heartbeat_interval_s`, and any traffic, a PONG
    included, counts) is closed and whatever it half-sent is freed; a
    handshake must finish within the same time. The PUB keeps at most
    PUB_HWM updates per subscriber (shared between subscribers); one further
    behind misses updates and resyncs (docs/protocol.md section 8).

    Args:
        router: the ROUTER.
        pub: the PUB.
        cfg: the shard's settings.
    """
    if cfg.peer_silence_s > 0:
        silence_ms = max(1, int(cfg.peer_silence_s * 1000))
        ping_ms = max(1, min(int(cfg.heartbeat_interval_s * 1000), silence_ms))
        for sock in (router, pub):
            sock.setsockopt(zmq.HANDSHAKE_IVL, silence_ms)
            sock.setsockopt(zmq.HEARTBEAT_IVL, ping_ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, silence_ms)
    pub.setsockopt(zmq.SNDHWM, PUB_HWM)


def send_reply(router: zmq.Socket, core: ShardCore, conn: bytes, message: list[Any]) -> None:
    """Send one reply; a large one is tracked in `core.backlog` until ZeroMQ wrote it out.

    Args:
        router: the ROUTER.
        core: the shard's core (its backlog).
        conn: the connection.
        message: the reply's frames.
    """
    nbytes = protocol.message_bytes(message)
    if nbytes < TRACK_MIN_BYTES:
        router.send_multipart([conn, *message], copy=False)
        return
    frames = [zmq.Frame(f, track=True) if memoryview(f).nbytes >= TRACK_MIN_BYTES else f
              for f in message]  # fmt: skip
    router.send_multipart([conn, *frames], copy=False)
    tracked = [f for f in frames if isinstance(f, zmq.Frame)]
    if tracked:
        core.backlog.track(core.peer(conn), nbytes, zmq.MessageTracker(*tracked))


def _user_id(frame: Any) -> str | None:
    """The ZAP User-Id (the client's z85 public key) of a received frame, if it has one."""
    try:
        return frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None


# -- the step thread ------------------------------------------------------------


class StepWorker(LoopThread):
    """The shard's step thread: runs one outer step's arithmetic while the serving loop goes on.

    A step's cost grows with its fragment (seconds at a billion parameters); the
    answers to heartbeats, acks and status must not. The loop hands a step's
    work (`paramserver.server.step.fragment_step.StepWork`, begun by `ShardCore.start_step`)
    to this thread, keeps serving, and books the result (`ShardCore.finish_step`:
    the step's record is logged and fsynced, then its update published) on the
    first turn after the thread says it is done. The thread touches only the
    stepping fragment's arrays; numpy, numba and XLA release the GIL while they
    work, so the loop is answered within a GIL switch interval.

    One step at a time. The thread wakes the loop through a pipe whose read end
    the loop polls beside its sockets (`wake_fd`; `paramserver.plumbing.loop_thread`).
    """

    def __init__(self) -> None:
        """Start the thread."""
        self._done: StepWork | None = None
        self._running: StepWork | None = None
        super().__init__("outer-step")

    @property
    def busy(self) -> bool:
        """Whether a step was submitted and not yet taken back (`take`)."""
        with self._lock:
            return self._running is not None or self._done is not None

    def submit(self, work: StepWork) -> None:
        """Run a step's arithmetic in the thread.

        Args:
            work: the step (from `ShardCore.start_step`).

        Raises:
            RuntimeError: a step is still under way or not taken back.
        """
        with self._lock:
            if self._running is not None or self._done is not None:
                raise RuntimeError("a step is already under way")
            self._running = work
        self._put(work)

    def take(self) -> StepWork | None:
        """The step that finished running, once (then the worker is free).

        Returns:
            The run work (its `error` set if the arithmetic raised), or None
            while it runs or when none was submitted.
        """
        self._drain_wake()
        with self._lock:
            done, self._done = self._done, None
        return done

    def _handle(self, jobs: list[StepWork]) -> None:
        (work,) = jobs
        work.run()  # keeps an exception in work.error for finish_step
        with self._lock:
            self._running, self._done = None, work


# -- the push checker thread ------------------------------------------------------


class PushChecker(LoopThread):
    """The shard's push checker thread: checks large pushes' payloads while the loop serves.

    A push's payload check (`outcomes.check_payload`: the codec frames'
    checksums or zstd, the header's sizes, finiteness, the delta's L2 norm)
    reads every byte the island sent: tens of milliseconds or more for a
    large push, which heartbeats, acks and status on the loop would wait too.
    The core hands a push that sends or decodes to `ShardCore.check_off_loop_bytes` (the
    loop sets CHECK_OFF_LOOP_BYTES) to the loop as a `PushCheck` once the
    checks that read no payload byte passed; the loop submits it here and
    keeps serving, and on a later turn hands the checked job back
    (`ShardCore.finish_push`), which runs the payload-free checks again (a
    copy may have been accepted meanwhile, or a step begun) and admits it.
    Its record goes to the log writer with that turn's batch, and its ack
    waits for the record's fsync.

    One thread, first in first out; once any push is being checked every
    later push goes the same way (`ShardCore`), so pushes are admitted in
    arrival order. Without a checker (the simulation tests) or while
    draining, `run_batch` runs the job itself in the same turn. The thread
    wakes the loop through a pipe whose read end the loop polls beside its
    sockets (`wake_fd`), as the step thread does.
    """

    def __init__(self) -> None:
        """Start the thread."""
        self._done: list[PushCheck] = []
        super().__init__("push-check")

    def submit(self, job: PushCheck) -> None:
        """Check a push in the thread, after those submitted before it.

        Args:
            job: the push (from the core's effects).
        """
        self._put(job)

    def take(self) -> list[PushCheck]:
        """The checks done since the last call, in submission order.

        Returns:
            The jobs, each with its `result`.
        """
        self._drain_wake()
        with self._lock:
            done, self._done = self._done, []
        return done

    def _handle(self, jobs: list[PushCheck]) -> None:
        (job,) = jobs
        job.run()
        with self._lock:
            self._done.append(job)
