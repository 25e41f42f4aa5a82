"""The client library an island uses: `Client`, the public API.

Its types (`ClientConfig`, `JoinResult`, `Update`, `ClientError`,
`ClientConfigError`, `PushRequest`) live in `paramserver.client.types`, and
the package `paramserver.client` exports both. All network I/O runs in one
background thread that owns every socket (`paramserver.client.io_thread`); the
API hands it commands through a thread-safe queue plus an inproc wake-up, so
`push` and `poll_updates` never wait on the network. The API calls the core
(`paramserver.client.core`) under the I/O thread's lock (`push` puts the delta
in the core's one ledger and hands the sends to the thread), and every wait of
the API is on that lock, a Condition the thread notifies after each message.
`push` blocks only for back-pressure, when `max_unacked` deltas are
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
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from paramserver.client.io_thread import STOP_POLL_S, IOThread
from paramserver.client.types import (
    ClientConfig,
    ClientError,
    JoinResult,
    JoinTimeout,
    PushRequest,
    Update,
)
from paramserver.plumbing.peer_peek import silence_cause
from paramserver.wire import protocol
from paramserver.wire.plan import Plan

__all__ = ["Client"]

_INSTANCES = itertools.count()
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
                if stop.wait(STOP_POLL_S):
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
            self._lock.wait(min(left, STOP_POLL_S))
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
                self._lock.wait(min(left, STOP_POLL_S))

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
