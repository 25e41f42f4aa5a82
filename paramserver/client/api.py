"""The client library an island uses, and the one thread that moves its bytes.

One concept, the client's threaded shell around its sans-I/O core
(`paramserver.client.core`), in one module: the public API, `Client`, and
the I/O thread it hands every command to (`IOThread`, with its sockets,
`Links`). It is longer than 700 lines because the two share one lock and one
set of commands: every wait of the API is on the I/O thread's Condition, and
every command the API posts is run by that thread, so each side is read with
the other.

The API. Its types (`ClientConfig`, `JoinResult`, `Update`, `ClientError`,
`ClientConfigError`, `PushRequest`) live in `paramserver.client.types`, and
the package `paramserver.client` exports both. All network I/O runs in one
background thread that owns every socket; the API hands it commands through a
thread-safe queue plus an inproc wake-up, so `push` and `poll_updates` never
wait on the network. The API calls the core under the I/O thread's lock
(`push` puts the delta in the core's one ledger and hands the sends to the
thread). `push` blocks only for back-pressure, when `max_unacked` deltas are
pending in that ledger; `join` and `push` take a `stop` event that ends their
waits at once (an island's SIGTERM). `close` hands the deltas it could not
deliver to `unacked`, so that the caller can keep them (e.g. in a file) and
push them again later.

    client = Client(ClientConfig(connect="tcp://127.0.0.1:5555", island="a"))
    res = client.join(flat_params)        # plan, params, versions
    client.push_request(PushRequest(fragment, round, base_version, tokens, steps, frames))
    for update in client.poll_updates(): ...
    client.close()
    kept = client.unacked()               # PushRequest(fragment, round, ...) each

The I/O thread (`IOThread`) touches the island's sockets and no protocol: it
polls, hands each message and the time to the core, performs the effects the
core returns (open, close, send), ticks the core's timers, and runs the API's
commands (join, push effects, close). Every call into the core, there and in
the API, holds `lock`, a Condition that is notified after each one, so the
API's waits (back-pressure) wake up when the ledger shrinks. `failure` (set
under the lock) says why the thread died, if it did.

`Links` holds those sockets: the context, the CURVE keys, a wake-up pair and
one socket per link (a shard's DEALER or SUB) named by the link numbers the
core picks (`paramserver.client.shards`), connecting with linger 0 and a
capped reconnect interval, the poller, non-blocking sends and reads, and
closing everything. A bulk DEALER is watched by a ZeroMQ socket monitor: a
connection that dies under it is reported (`poll`) to the core
(`ClientCore.on_link_down`), which replaces the link and sends again what it
carried. Only `wake` and `close_wake` may be called from another thread than
the I/O thread.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import parse_monitor_message

from paramserver.client.core import ClientCore
from paramserver.client.shards import Close, Effect, Open, Send, flow_buffer_bytes
from paramserver.client.types import (
    ClientConfig,
    ClientError,
    JoinResult,
    JoinTimeout,
    PushRequest,
    Update,
)
from paramserver.plumbing import curve
from paramserver.plumbing.peer_peek import silence_cause
from paramserver.wire import protocol
from paramserver.wire.plan import Plan

__all__ = ["Client"]

logger = logging.getLogger(__name__)

_INSTANCES = itertools.count()
# A wait sleeps on the I/O thread's Condition (notified after every message) in slices
# this long, so that it sees a `stop` event (which notifies nobody) and so that Ctrl-C
# reaches a main thread that waits; a flush at close looks at its `stop` as often.
_STOP_POLL_S = 0.05
_HEADER_BYTES = 512  # a push header's size on the wire is at most this (island id <= 128)


def _uint(name: str, value: object, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ClientError(f"push: {name}={value!r} must be an int >= {low}")
    return int(value)


def _silence_explained(exc: ClientError, cfg: ClientConfig) -> ClientError:
    """A join timeout at `cfg.connect` with what answers there instead (`peer_peek`), if known."""
    if not isinstance(exc, JoinTimeout) or exc.endpoint != cfg.connect:
        return exc
    cause = silence_cause(cfg.connect, curve=bool(cfg.curve_secret_key_file))
    if cause is None:
        return exc
    return JoinTimeout(
        f"join: no {exc.request} reply from shard at {exc.endpoint} within "
        f"{exc.timeout_s:g}s; {cause}",
        endpoint=exc.endpoint,
        request=exc.request,
        timeout_s=exc.timeout_s,
    )


def _check_params(flat_params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    if not isinstance(flat_params, Mapping) or not flat_params:
        raise ClientError("join: pass a non-empty mapping of parameter name -> float array")
    flat = {}
    for name, value in flat_params.items():
        arr = np.asarray(value)
        if not (arr.dtype.kind == "f" or "float" in arr.dtype.name):
            raise ClientError(
                f"join: cannot use these parameters: {name!r} has dtype {arr.dtype}; "
                "only float parameters are synchronised"
            )
        flat[name] = arr
    return flat


class Client:
    """An island's connection to every shard (see the module docstring)."""

    def __init__(self, cfg: ClientConfig) -> None:
        """Create the client and its I/O thread (nothing is sent before `join`).

        Args:
            cfg: connection settings.
        """
        if not isinstance(cfg, ClientConfig):
            raise ClientError(f"Client needs a ClientConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self._plan: Plan | None = None
        self._joined = False
        self._closed = False
        self._close_lock = threading.Lock()  # a second `close` waits for the first's flush
        self._unacked: list[PushRequest] = []
        self._io = IOThread(cfg, f"inproc://client-wake-{next(_INSTANCES)}")
        self._lock = self._io.lock  # guards the core (and the thread's `failure`)
        self._core = self._io.core
        self._io.start()

    def _check_alive(self) -> None:
        if self._closed:
            raise ClientError("client is closed; create a new Client")
        with self._lock:
            failure = self._io.failure
        if failure is not None:
            raise ClientError(f"client I/O thread failed: {failure}")

    # -- public API --------------------------------------------------------------------

    def join(
        self, flat_params: Mapping[str, np.ndarray], stop: threading.Event | None = None
    ) -> JoinResult:
        """Join the cluster: learn its map, initialise it if empty, fetch every fragment.

        Args:
            flat_params: path -> array (float dtypes); the first joiner of an empty
                cluster provides the initial values (and so does a later joiner for
                shards its initialiser left uninitialised for `init_grace_s`); other
                joiners' values are only used for their shapes.
            stop: when set, the join gives up at once (ClientError "stopped").

        Returns:
            JoinResult(plan, params as float32 arrays, versions per fragment);
            params is {} with `ClientConfig(keep="versions")` (only the versions are read).

        Raises:
            ClientError: no answer in time, plan mismatch with the cluster, the
                island id in use by another running island, a shard refused the
                join, or `stop` was set.
        """
        self._check_alive()
        if self._joined:
            raise ClientError("join() was already called on this client")
        flat = _check_params(flat_params)
        future: Future = Future()
        self._io.submit(("join", flat, future))
        deadline = time.monotonic() + self.cfg.join_timeout_s + 10.0
        try:
            while stop is not None and not future.done() and time.monotonic() < deadline:
                if stop.wait(_STOP_POLL_S):
                    self._io.stop_join.set()
                    break
            result = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            raise ClientError(
                f"join: no result within {self.cfg.join_timeout_s:g}s; is the server at "
                f"{self.cfg.connect} running?"
            ) from None
        except ClientError as exc:
            raise _silence_explained(exc, self.cfg) from None
        self._plan = result.plan
        self._joined = True
        return result

    def push(
        self,
        fragment: int,
        round: int,
        base_version: int,
        tokens: int,
        steps: int,
        frames: Sequence[Any],
        stop: threading.Event | None = None,
    ) -> None:
        """Queue one delta for its shard: `push_request` of a `PushRequest` of these fields.

        Args:
            fragment: fragment index.
            round: the island's round (monotone; with island and fragment the
                idempotency key).
            base_version: the fragment version the delta was computed from.
            tokens: tokens trained since that version (>= 1).
            steps: inner steps since that version (>= 1).
            frames: codec frames of {"delta": 1-D vector of the fragment's size};
                not modified afterwards by the caller.
            stop: an event (e.g. the island's SIGTERM) that ends the wait for a slot.

        Raises:
            ClientError: as `push_request`.
        """
        request = PushRequest(fragment, round, base_version, tokens, steps, list(frames))
        self.push_request(request, stop=stop)

    def push_request(self, request: PushRequest, stop: threading.Event | None = None) -> None:
        """Queue one delta for its shard; it is kept and re-sent until acked.

        The request itself travels on (the ledger keeps it; `unacked` hands it
        back), so the caller does not modify it or its frames afterwards.
        Blocks only while `max_unacked` deltas are outstanding, and never once
        `stop` is set: the delta is then queued at once, past the limit, so that
        `close` hands it to `unacked` with the others rather than losing it.

        Args:
            request: the delta (fragment, round, base_version, tokens >= 1, steps >= 1,
                codec frames of {"delta": 1-D vector of the fragment's size}).
            stop: an event (e.g. the island's SIGTERM) that ends the wait for a slot.

        Raises:
            ClientError: not joined, a bad field, a delta larger than the shards
                accept (never queued), the client closed meanwhile, or no free slot
                within `push_timeout_s`.
        """
        self._check_alive()
        if not self._joined or self._plan is None:
            raise ClientError("push: call join() first")
        if not isinstance(request, PushRequest):
            raise ClientError(f"push: pass a PushRequest, got {type(request).__name__}")
        fragment = _uint("fragment", request.fragment)
        if fragment >= self._plan.num_fragments:
            raise ClientError(
                f"push: fragment={fragment} out of range: the plan has "
                f"{self._plan.num_fragments} fragments"
            )
        for name, low in (("round", 0), ("base_version", 0), ("tokens", 1), ("steps", 1)):
            _uint(name, getattr(request, name), low)
        if not isinstance(request.frames, list) or not request.frames:
            raise ClientError(
                "push: frames must be a non-empty list; pass the frames a codec's encode returned"
            )
        self._check_size(request)
        with self._lock:
            if not self._wait_for_slot(stop):
                raise ClientError(
                    f"push: {len(self._core.ledger)} deltas still unacked after "
                    f"{self.cfg.push_timeout_s:g}s; is the server reachable?"
                )
            if self._closed:  # by another thread while this push waited
                raise ClientError("client is closed; create a new Client")
            if self._io.failure is not None:
                raise ClientError(f"client I/O thread failed: {self._io.failure}")
            effects = self._core.push(time.monotonic(), request)  # raises once closed
        self._io.submit(("effects", effects, None))

    def _check_size(self, request: PushRequest) -> None:
        """Refuse a push larger than the shards accept (their welcome says the limit)."""
        with self._lock:
            limit = self._core.max_message_bytes
        if limit is None:
            return
        size = sum(memoryview(f).nbytes for f in request.frames) + _HEADER_BYTES
        if size > limit:
            raise ClientError(
                f"push: the delta of fragment {request.fragment} (round {request.round}) is "
                f"{size} bytes with its header, over the shards' max_message_bytes={limit}; "
                "use more fragments or a stronger codec (int8/int4)"
            )

    def _wait_for_slot(self, stop: threading.Event | None) -> bool:
        """With the lock held: wait until a push may be queued (back-pressure, or stop set).

        Returns:
            False when no slot freed within `push_timeout_s`.
        """

        def ready() -> bool:
            return (
                len(self._core.ledger) < self.cfg.max_unacked
                or self._io.failure is not None
                or self._closed
                or (stop is not None and stop.is_set())
            )

        deadline = time.monotonic() + self.cfg.push_timeout_s
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._lock.wait(min(left, _STOP_POLL_S))
        return True

    def _wait(
        self, done: Callable[[], bool], stop: threading.Event | None, timeout_s: float
    ) -> bool:
        """Wait on the I/O thread's Condition until `done()` holds (asked under the lock).

        Returns:
            True once `done()`; False when `stop` is set or `timeout_s` passed first.

        Raises:
            ClientError: the client is closed (also while waiting) or its thread failed.
        """
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                if self._closed:
                    raise ClientError("client is closed; create a new Client")
                if self._io.failure is not None:
                    raise ClientError(f"client I/O thread failed: {self._io.failure}")
                if done():
                    return True
                left = deadline - time.monotonic()
                if (stop is not None and stop.is_set()) or left <= 0:
                    return False
                self._lock.wait(min(left, _STOP_POLL_S))

    def report_step_time(self, seconds: float, inner_steps: int | None = None) -> None:
        """Tell the shards this island's typical inner-step time (padding included).

        Sent as `t_step` with every later push and heartbeat; the shards' adaptive
        grace window (`--grace-rule eq3`) uses it.

        Args:
            seconds: a finite time > 0.
            inner_steps: the island's configured H, sent as `inner_steps` with every
                later push (the shards warn when it takes other default outer
                settings than theirs); None: not said.

        Raises:
            ClientError: not a finite positive number, or an H that is not an int >= 1.
        """
        if isinstance(seconds, bool) or not isinstance(seconds, int | float | np.floating):
            raise ClientError(f"report_step_time: seconds={seconds!r} must be a number")
        if not math.isfinite(seconds) or seconds <= 0:
            raise ClientError(f"report_step_time: seconds={seconds!r} must be finite and > 0")
        if inner_steps is not None and (
            isinstance(inner_steps, bool) or not isinstance(inner_steps, int) or inner_steps < 1
        ):
            raise ClientError(f"report_step_time: inner_steps={inner_steps!r} must be an int >= 1")
        with self._lock:
            self._core.step_time_s = float(seconds)
            if inner_steps is not None:
                self._core.inner_steps = inner_steps

    def report_training(
        self,
        inner_loss: float | None = None,
        steps_per_s: float | None = None,
        goodput: float | None = None,
    ) -> None:
        """Tell the shards how this island trains, for people watching (the cluster page).

        Sent as `inner_loss`, `steps_per_s` and `goodput` with every later push and
        heartbeat until the next call; a None is not sent. The shards only show them.

        Args:
            inner_loss: the island's last inner (train) loss, a finite number.
            steps_per_s: its inner steps per second, finite and > 0.
            goodput: its goodput, from 0 to 1.

        Raises:
            ClientError: a value the shards would refuse (naming it).
        """
        values = {"inner_loss": inner_loss, "steps_per_s": steps_per_s, "goodput": goodput}
        report = {k: float(v) if isinstance(v, np.floating) else v for k, v in values.items()}
        report = {k: v for k, v in report.items() if v is not None}
        for field, value in report.items():
            problem = protocol.request_field_problem(field, value)
            if problem is not None:
                raise ClientError(f"report_training: {problem}")
        with self._lock:
            self._core.training = {k: float(v) for k, v in report.items()}

    def poll_updates(self) -> list[Update]:
        """The newest update of each fragment that changed since the last call.

        With `ClientConfig(keep="increments")`: every update since the last call, in
        order (an increment applies only to the version before it).

        Returns:
            Updates in fragment order, then version (values: full 1-D float32, read-only,
            bit-exact with the shards; see `Update` for what each `keep` hands out).
        """
        self._check_alive()
        with self._lock:
            return self._core.readout.take_updates()

    def take_refused(self) -> list[tuple[int, int, list[Any]]]:
        """The deltas the shards finally refused since the last call (then forgotten).

        A refused delta never enters the model; an island with error feedback puts
        its decoded values back into its residual (`codec.refund`) so its next push
        carries them. Deferred (`too_many_pending`) and re-sent deltas are not here.

        Returns:
            (fragment, round, codec frames as pushed) per delta, oldest first.
        """
        self._check_alive()
        with self._lock:
            return self._core.readout.take_refused()

    def round_merged(self, round: int) -> bool:
        """Whether the global parameters this client holds include all of `round`'s deltas.

        Args:
            round: a round id passed to `push` for every fragment.

        Returns:
            True once each fragment's delta of that round is acked and a version
            that merged it has arrived (rejected deltas count as resolved), so
            `poll_updates` hands out parameters that include the round.
        """
        self._check_alive()
        with self._lock:
            return self._core.readout.round_merged(round)

    def wait_round_merged(
        self, round: int, stop: threading.Event | None = None, timeout_s: float = 1.0
    ) -> bool:
        """Wait until `round_merged(round)` (woken by each message, not by polling).

        Args:
            round: a round id passed to `push` for every fragment.
            stop: ends the wait once set.
            timeout_s: the longest wait (finite; call again to wait on).

        Returns:
            True once the round is merged; False on `stop` or the timeout.

        Raises:
            ClientError: the client is closed (also while waiting) or its thread failed.
        """
        return self._wait(lambda: self._core.readout.round_merged(round), stop, timeout_s)

    def wait_settled(self, stop: threading.Event | None = None, timeout_s: float = 1.0) -> bool:
        """Wait until no pushed delta is pending (each acked or finally refused).

        Args:
            stop: ends the wait once set.
            timeout_s: the longest wait (finite; call again to wait on).

        Returns:
            True once nothing is pending; False on `stop` or the timeout.

        Raises:
            ClientError: the client is closed (also while waiting) or its thread failed.
        """
        return self._wait(lambda: len(self._core.ledger) == 0, stop, timeout_s)

    def delta_outcomes(self, keys: Iterable[tuple[int, int]]) -> dict[tuple[int, int], str]:
        """What became of pushed deltas: whether their work entered the model yet.

        Readable after `close` too (the answers as of the close).

        Args:
            keys: (round, fragment) of deltas passed to `push`.

        Returns:
            (round, fragment) -> "merged" (acked, and the parameters this client
            holds include it), "acked" (its shard holds it, not merged or not
            heard of yet), "rejected", or "pending" (no final ack yet).
        """
        with self._lock:
            return {(r, f): self._core.readout.delta_outcome(r, f) for r, f in keys}

    def watch_outcomes(self, listener: Callable[[int, int, str], None] | None) -> None:
        """Be told what becomes of each pushed delta, as it happens (no polling).

        Call it before the first push. `listener(round, fragment, outcome)` runs on
        the client's I/O thread, under the client's lock, so it must be quick and
        must not call the client: "acked" (its shard holds it; once per delta, at
        its final ack), "merged" (later: a version that includes it reached this
        client), "rejected" (finally refused). A delta acked into a version this
        client already holds is told "merged" at once. Deltas left unacked at
        `close` are told nothing (`unacked` hands them back). A watched client
        keeps the merge versions of its newest 16 rounds only (`delta_outcomes`
        and `round_merged` forget older ones): the listener's owner keeps its own
        record of each delta.

        Args:
            listener: the callable, or None to stop telling.
        """
        with self._lock:
            self._core.readout.listener = listener

    def stats(self) -> dict[str, Any]:
        """Counters of this client.

        Returns:
            dict with bytes_sent, bytes_received (sums of frame lengths at the
            sockets), pushes, acked (duplicates included), duplicates, rejected
            (reason -> count), resent, spurious_resends (re-sends of deltas an
            earlier send had delivered), ack_timeout_s (the current adaptive
            re-send timeout), pending, snapshots, updates_applied,
            version_lag, reconnects, resyncs, shards_down, credited_tokens
            (tokens of this island that entered the model: each merged delta's
            tokens x its fragment's share of the parameters, staleness not
            counted, as the shards last said in heartbeat replies and updates).
        """
        with self._lock:
            return self._core.stats()

    def ack_latencies(self) -> list[float]:
        """Ack latencies of the deltas acked since the last call (for load measurements).

        Returns:
            Seconds from `push` to its ack, one per acked delta (the newest
            100,000 at most are kept between calls).
        """
        with self._lock:
            return self._core.readout.take_ack_latencies()

    def close(self, flush_timeout_s: float = 5.0, stop: threading.Event | None = None) -> int:
        """Wait up to `flush_timeout_s` for unacked deltas, say bye, close every socket.

        The wait ends early when every shard that holds an unacked delta is
        down, or once `stop` is set. The deltas left unacked are kept for `unacked`.

        Args:
            flush_timeout_s: how long to wait for outstanding acks.
            stop: ends the wait once set (e.g. a second Ctrl-C while it flushes).

        Returns:
            Deltas dropped unacked.
        """
        with self._close_lock:  # safe from any thread: a second caller waits for the first
            if self._closed:
                return 0
            with self._lock:
                self._closed = True
                self._lock.notify_all()  # waits of other threads end (ClientError: closed)
            self._unacked = self._io.shutdown(flush_timeout_s, stop)
            return len(self._unacked)

    def unacked(self) -> list[PushRequest]:
        """The deltas `close` gave up on, to keep and push again later (same round ids).

        Returns:
            PushRequest(fragment, round, base_version, tokens, steps, frames as
            bytes) per delta, in push order; empty before `close`. The shards'
            (island, round, fragment) dedup makes pushing one again safe.
        """
        return list(self._unacked)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_MAX_BATCH = 256  # messages read from one socket per poll round, so no socket starves the rest


class IOThread(threading.Thread):
    """The one thread that touches the client's sockets."""

    def __init__(self, cfg: ClientConfig, wake_endpoint: str) -> None:
        """Create the core and the wake-up sockets (links are opened as the core asks).

        Args:
            cfg: client settings.
            wake_endpoint: unique inproc address for the wake-up PAIR.
        """
        super().__init__(name=f"diloco-client-{cfg.island}", daemon=True)
        self.lock = threading.Condition()  # guards `core` and `failure`
        self.core = ClientCore(cfg, secrets.token_hex(8))
        self.failure: str | None = None
        self.stop_join = threading.Event()  # set by the API: a join in progress gives up
        self._links = Links(cfg, wake_endpoint)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._join: Future | None = None  # the join in progress
        self._closing: Future | None = None  # the close in progress
        self._finished = False
        self._tick_s = min(0.1, cfg.heartbeat_interval_s / 4)

    # -- API side (any thread) -----------------------------------------------------------

    def submit(self, command: tuple[str, Any, Future | None]) -> None:
        """Queue a command for the I/O thread and wake it.

        Args:
            command: ("join", flat params, future), ("effects", effects of a core
                call the API made, None) or ("close", flush timeout, future).
        """
        self._commands.put(command)
        self._links.wake()

    def shutdown(
        self, flush_timeout_s: float, stop: threading.Event | None = None
    ) -> list[PushRequest]:
        """Flush (bounded), stop the thread, close every socket and the context.

        Args:
            flush_timeout_s: how long to wait for unacked deltas (less when every
                shard that holds one is down).
            stop: once set, the flush ends at once (a Ctrl-C while it waits).

        Returns:
            The deltas dropped unacked, in push order.
        """
        dropped: list[PushRequest] = []
        if self.is_alive():
            future: Future = Future()
            self.submit(("close", max(0.0, float(flush_timeout_s)), future))
            deadline = time.monotonic() + flush_timeout_s + 10.0
            try:
                while not future.done() and time.monotonic() < deadline:
                    if stop is not None and stop.is_set():
                        self.submit(("close", 0.0, None))  # cut the flush
                        stop = None
                    with contextlib.suppress(FutureTimeout):
                        future.result(timeout=_STOP_POLL_S)
                dropped = future.result(timeout=0)
            except Exception as exc:  # the thread failed while closing
                logger.warning("client close: %s", exc)
            self.join(timeout=10.0)
        if not self.is_alive():  # a thread that failed left its ledger to us
            with self.lock:
                dropped += self.core.ledger.drop_all()
        self._links.close_wake()
        if not self.is_alive():
            self._links.term()
        return dropped

    # -- thread body -----------------------------------------------------------------

    def run(self) -> None:
        """Serve commands and sockets until closed; record a failure for the API."""
        try:
            while not self._finished:
                self._iteration()
        except Exception as exc:
            logger.exception("client I/O thread failed")
            with self.lock:
                self.failure = str(exc) or type(exc).__name__
                self.lock.notify_all()
            self._fail_commands(exc)
        finally:
            self._links.close_all()

    def _iteration(self) -> None:
        """Poll once, hand what arrived to the core, run commands and the core's timers."""
        with self.lock:
            active = self.core.has_links
        timeout_ms = int(self._tick_s * 1000) if active else 1000
        ready, down = self._links.poll(timeout_ms)
        for link in ready:  # first: what a dead link got before it died is still read
            for _ in range(_MAX_BATCH):
                frames = self._links.recv(link)
                if frames is None:
                    break
                self._call(self.core.on_message, time.monotonic(), link, frames)
                if not self._links.is_open(link):  # replaced while handling the message
                    break
        for link in down:
            self._call(self.core.on_link_down, time.monotonic(), link)
        self._run_commands()
        if self.stop_join.is_set():
            self.stop_join.clear()
            self._call(self.core.stop_join)
        self._call(self.core.on_tick, time.monotonic())
        self._settle()

    def _call(self, method: Any, *args: Any) -> None:
        """Call the core under the lock, perform the effects it returns, wake the API."""
        with self.lock:
            self.perform(method(*args))
            self.lock.notify_all()

    def perform(self, effects: Sequence[Effect]) -> None:
        """Perform the core's effects in order (with `lock` held)."""
        for effect in effects:
            if isinstance(effect, Send):
                went_out = self._links.send(effect.link, effect.frames)
                self.core.on_sent(effect, went_out, time.monotonic())
            elif isinstance(effect, Open):
                self._links.open(effect.link, effect.role, effect.endpoint)
            elif isinstance(effect, Close):
                self._links.close(effect.link)

    def _queued(self) -> Iterator[tuple[str, Any, Future | None]]:
        """The commands queued so far, taken off the queue one by one."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_commands(self) -> None:
        for name, arg, future in self._queued():
            if name == "effects":
                with self.lock:
                    self.perform(arg)
            elif name == "join":
                self._start_join(arg, future)
            elif name == "close":  # future None: the flush of the close in progress is cut
                if future is not None:
                    self._closing = future
                self._call(self.core.begin_close, time.monotonic(), arg)

    def _start_join(self, flat: Mapping[str, np.ndarray], future: Future) -> None:
        with self.lock:
            try:
                self.perform(self.core.start_join(time.monotonic(), flat))
            except ClientError as exc:
                future.set_exception(exc)
                return
        self._join = future

    def _settle(self) -> None:
        """Resolve the join's and close's futures once the core says they ended."""
        with self.lock:
            outcome, closed = self.core.join_outcome, self.core.closed
            if outcome is not None:
                self.core.join_outcome = None
            dropped = self.core.dropped
        if outcome is not None and self._join is not None:
            if isinstance(outcome, ClientError):
                self._join.set_exception(outcome)
            else:
                self._join.set_result(outcome)
            self._join = None
        if closed and self._closing is not None:
            self._closing.set_result(dropped)
            self._finished = True

    def _fail_commands(self, exc: Exception) -> None:
        error = ClientError(f"client I/O thread failed: {exc}")
        if self._join is not None and not self._join.done():
            self._join.set_exception(error)
        for name, _arg, future in self._queued():
            if name == "close":
                self._closing = future
            elif future is not None and not future.done():
                future.set_exception(error)
        if self._closing is not None and not self._closing.done():
            with self.lock:
                self._closing.set_result(self.core.ledger.drop_all())


# -- the sockets ------------------------------------------------------------------------


def _kernel_max() -> int:
    """The largest socket buffer this host lets a process set (net.core.wmem_max, rmem_max)."""
    sizes = []
    for name in ("wmem_max", "rmem_max"):
        try:
            sizes.append(int(Path(f"/proc/sys/net/core/{name}").read_text()))
        except (OSError, ValueError):
            return 0
    return min(sizes)


class Links:
    """Every socket of one client, by link number."""

    def __init__(self, cfg: ClientConfig, wake_endpoint: str) -> None:
        """Load the CURVE keys and create the context and the wake-up pair.

        Args:
            cfg: client settings (CURVE key files, reconnect cap).
            wake_endpoint: unique inproc address for the wake-up PAIR.

        Raises:
            ClientError: a CURVE key file cannot be used.
        """
        self._reconnect_cap_s = cfg.reconnect_cap_s
        flows = cfg.bulk_flows
        self._bulk_buffer = flow_buffer_bytes(cfg.link_bdp_bytes, max(1, flows), _kernel_max())
        self._curve: tuple[bytes, bytes, bytes] | None = None
        if cfg.curve_secret_key_file:
            try:
                public, secret = curve.load_keypair(cfg.curve_secret_key_file)
                self._curve = (public, secret, curve.load_public_key(cfg.curve_server_key_file))
            except curve.CurveError as exc:
                raise ClientError(f"client: {exc}") from None
        self._ctx = zmq.Context()
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.setsockopt(zmq.LINGER, 0)
        self._wake_rx.bind(wake_endpoint)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(wake_endpoint)
        self._wake_lock = threading.Lock()
        self._poller = zmq.Poller()
        self._poller.register(self._wake_rx, zmq.POLLIN)
        self._sockets: dict[int, zmq.Socket] = {}  # link -> socket
        self._links: dict[zmq.Socket, int] = {}  # socket -> link
        self._monitors: dict[zmq.Socket, int] = {}  # a bulk link's monitor -> link

    # -- any thread ---------------------------------------------------------------------

    def wake(self) -> None:
        """Make the I/O thread's next `poll` return (a no-op once `close_wake` ran)."""
        with self._wake_lock:
            if not self._wake_tx.closed:
                # Again: a wake-up is already queued, which is all we need.
                with contextlib.suppress(zmq.Again):
                    self._wake_tx.send(b"", zmq.NOBLOCK)

    def close_wake(self) -> None:
        """Close the sending end of the wake-up pair (the client is shutting down)."""
        with self._wake_lock:
            self._wake_tx.close(linger=0)

    def term(self) -> None:
        """Terminate the context (after `close` and `close_wake`)."""
        self._ctx.term()

    # -- the I/O thread ---------------------------------------------------------------------

    def poll(self, timeout_ms: int) -> tuple[list[int], list[int]]:
        """Wait up to `timeout_ms` for messages; wake-ups are drained here.

        Returns:
            (the links with messages to read, the bulk links whose connection died).
        """
        ready, down = [], []
        for sock, _ in self._poller.poll(timeout_ms):
            if sock is self._wake_rx:
                self._drain_wake()
            elif sock in self._links:
                ready.append(self._links[sock])
            elif sock in self._monitors and self._disconnected(sock):
                down.append(self._monitors[sock])
        return ready, down

    def _disconnected(self, monitor: zmq.Socket) -> bool:
        """Whether a bulk link's monitor reported a connection that died (its events read)."""
        died = False
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return died
            died = died or event["event"] == zmq.EVENT_DISCONNECTED

    def open(self, link: int, role: str, endpoint: str) -> None:
        """Open link `link` to `endpoint`: a DEALER ("dealer"), a bulk DEALER ("bulk": its
        buffers sized from the link's bandwidth-delay product) or a subscribe-all SUB ("sub")."""
        self.close(link)
        kind = zmq.SUB if role == "sub" else zmq.DEALER
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if role == "bulk" and self._bulk_buffer:
            sock.setsockopt(zmq.SNDBUF, self._bulk_buffer)
            sock.setsockopt(zmq.RCVBUF, self._bulk_buffer)
        if role == "bulk":
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._monitors[monitor] = link
            self._poller.register(monitor, zmq.POLLIN)
        if self._curve is not None:
            curve.secure_client(sock, *self._curve)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(self._reconnect_cap_s * 1000))
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        self._sockets[link] = sock
        self._links[sock] = link
        self._poller.register(sock, zmq.POLLIN)

    def is_open(self, link: int) -> bool:
        """Whether link `link` has a socket."""
        return link in self._sockets

    def send(self, link: int, frames: list[Any]) -> bool:
        """Send one message on a link without blocking.

        Returns:
            False when it did not go out (no such link, or its queue is full).
        """
        sock = self._sockets.get(link)
        if sock is None:
            return False
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def recv(self, link: int) -> list[Any] | None:
        """One waiting message of a link (zero-copy frames), or None when there is none."""
        sock = self._sockets.get(link)
        if sock is None:
            return None
        try:
            return sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None

    def close(self, link: int) -> None:
        """Close link `link` (linger 0), if it is open."""
        sock = self._sockets.pop(link, None)
        if sock is None:
            return
        del self._links[sock]
        self._poller.unregister(sock)
        for monitor in [m for m, of in self._monitors.items() if of == link]:
            del self._monitors[monitor]
            self._poller.unregister(monitor)
            sock.disable_monitor()
            monitor.close(linger=0)
        sock.close(linger=0)

    def close_all(self) -> None:
        """Close every socket the I/O thread uses (the links' and the wake-up receiver)."""
        for link in list(self._sockets):
            self.close(link)
        self._wake_rx.close(linger=0)

    def _drain_wake(self) -> None:
        while True:
            try:
                self._wake_rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
