"""The client's network thread: owns every socket of one island and runs join, pushes and updates.

This module owns the island side of the wire protocol (`paramserver.protocol`):
one DEALER and one SUB per shard, the join sequence (hello -> welcome, plan
check, init of an empty cluster, Clone-pattern snapshots), re-sending unacked
deltas with capped exponential back-off, heartbeats to every shard,
reconnect of a silent shard (Paranoid Pirate), and re-snapshot on a sequence
gap or a silent update stream. The public API lives in `paramserver.client`
and talks to this thread only through `submit` (a queue plus an inproc
wake-up), `take_updates`, `stats` and `shutdown`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

import codec
from paramserver import curve, protocol
from paramserver.client import ClientConfig, ClientError, JoinResult, PushRequest, Update
from paramserver.liveness import is_silent, next_backoff, resend_due
from paramserver.plan import Plan, PlanError, leaf_specs, make_plan
from paramserver.replica import FragmentState, Published, Resync, ShardFeed

logger = logging.getLogger(__name__)

_RAW = codec.raw("float32")
_MAX_BATCH = 256  # messages read from one socket per poll round, so no socket starves the rest
_MAX_LATENCIES = 100_000  # ack latencies kept until `take_ack_latencies` (bounded memory)
_MAX_MERGE_ROUNDS = 1024  # rounds whose merge versions are kept for `round_merged`


@dataclass
class _Shard:
    """Connection state of one shard."""

    index: int
    router: str
    pub: str
    dealer: zmq.Socket | None = None
    sub: zmq.Socket | None = None
    heard: float = 0.0  # last message on the DEALER
    sub_heard: float = 0.0  # last message on the SUB
    up: bool = True
    attempt: int = 0  # reconnects since the shard was last heard
    next_reconnect: float = 0.0
    next_heartbeat: float = 0.0
    feed: ShardFeed | None = None


@dataclass
class _Pending:
    """One unacked delta: kept, with its frames, until the shard acks it."""

    request: PushRequest
    shard: int
    frames: list[Any]
    nbytes: int
    sent_at: float = 0.0
    attempt: int = 0
    sends: int = 0
    queued_at: float = 0.0  # when `push` handed it over (ack latency is measured from here)
    decode_retries: int = 0  # re-sends after the shard could not decode it (codec_error)
    deferred: bool = False  # refused for now (too_many_pending): re-sent on the next update


RETRYABLE_REASONS = frozenset({"too_many_pending"})
"""Rejections that say "not now" rather than "never": the delta is kept and re-sent."""

DECODE_RETRIES = 3
"""A push the shard could not decode (codec_error) was corrupted in transit, since this
client keeps its frames intact: it is re-sent at once, up to this many times, before the
rejection is final."""


@dataclass
class _Counters:
    """What `stats` reports; mutated by the I/O thread under a lock."""

    bytes_sent: int = 0
    bytes_received: int = 0
    pushes: int = 0
    acked: int = 0
    duplicates: int = 0
    rejected: Counter = field(default_factory=Counter)
    resent: int = 0
    snapshots: int = 0
    updates_applied: int = 0
    reconnects: int = 0
    resyncs: int = 0
    bad_messages: int = 0
    deferred: int = 0  # pushes the shard refused for now (too_many_pending): kept, re-sent


class IOThread(threading.Thread):
    """The one thread that touches the client's sockets."""

    def __init__(
        self, cfg: ClientConfig, wake_endpoint: str, release: Callable[[int], None]
    ) -> None:
        """Create the sockets used for wake-ups (the thread creates the rest).

        Args:
            cfg: client settings.
            wake_endpoint: unique inproc address for the wake-up PAIR.
            release: called with a count when deltas are resolved (frees push slots).
        """
        super().__init__(name=f"diloco-client-{cfg.island}", daemon=True)
        self.cfg = cfg
        self.failure: str | None = None
        # The shard's size limit when its welcome says (a bigger push would be
        # dropped with the connection, not answered): checked by `Client.push`.
        self.max_message_bytes: int | None = None
        # The island's typical inner-step time (s), sent in pushes and heartbeats as
        # `t_step` for the shards' adaptive grace window; None: not reported.
        self.step_time_s: float | None = None
        self._release = release
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
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._counters = _Counters()
        self._updates: dict[int, Update] = {}
        self._ack_latencies: deque[float] = deque(maxlen=_MAX_LATENCIES)
        self._poller = zmq.Poller()
        self._poller.register(self._wake_rx, zmq.POLLIN)
        self._sockets: dict[zmq.Socket, tuple[str, _Shard]] = {}
        self._shards: list[_Shard] = []
        self._plan: Plan | None = None
        self._replica: dict[int, FragmentState] = {}
        self._known: dict[int, int] = {}  # newest version heard of, per fragment
        # round -> fragment -> first version that includes the delta (None: rejected)
        self._merge_targets: dict[int, dict[int, int | None]] = {}
        self._credited: dict[int, float] = {}  # shard -> tokens of ours that entered the model
        self._pending: dict[tuple[int, int], _Pending] = {}
        self._requests: dict[int, tuple[str, int, int]] = {}  # id -> (kind, shard, fragment)
        self._awaited: dict[int, tuple[dict, list] | None] = {}
        self._next_id = 0
        self._joined = False
        self._close: tuple[float, Future] | None = None
        self._stopped = False
        self._tick_s = min(0.1, cfg.heartbeat_interval_s / 4)
        # The PUB stream heartbeats at the server's interval: judge its silence by
        # the slower of the server's and our own settings (set from the welcome).
        self._pub_interval_s = cfg.heartbeat_interval_s
        self._pub_liveness = cfg.liveness

    # -- API side (any thread) -----------------------------------------------------------

    def submit(self, command: tuple[str, Any, Future | None]) -> None:
        """Queue a command for the I/O thread and wake it.

        Args:
            command: (name, argument, future or None).
        """
        self._commands.put(command)
        with self._wake_lock:
            if not self._wake_tx.closed:
                # Again: a wake-up is already queued, which is all we need.
                with contextlib.suppress(zmq.Again):
                    self._wake_tx.send(b"", zmq.NOBLOCK)

    def take_updates(self) -> list[Update]:
        """Pop the newest update of every fragment that changed.

        Returns:
            Updates sorted by fragment.
        """
        with self._lock:
            updates, self._updates = self._updates, {}
        return [updates[k] for k in sorted(updates)]

    def take_ack_latencies(self) -> list[float]:
        """Pop the ack latencies recorded since the last call (bounded to the newest 100,000).

        Returns:
            Seconds from `push` to the ack (accepted or duplicate), one per delta.
        """
        with self._lock:
            out = list(self._ack_latencies)
            self._ack_latencies.clear()
        return out

    def round_merged(self, round: int) -> bool:
        """Whether every fragment's delta of `round` is resolved and in the replica.

        Args:
            round: the round id given to `push`.

        Returns:
            True once every fragment of the plan has an ack for this round and
            the replica holds a version that includes it (a rejected delta
            never will: it counts as resolved).
        """
        with self._lock:
            targets = self._merge_targets.get(round)
            if self._plan is None or targets is None:
                return False
            if len(targets) < self._plan.num_fragments:
                return False
            return all(
                target is None or (f in self._replica and self._replica[f].version >= target)
                for f, target in targets.items()
            )

    def stats(self) -> dict[str, Any]:
        """A copy of the counters plus derived values.

        Returns:
            The stats dict of `Client.stats` (without `pending`).
        """
        with self._lock:
            c = self._counters
            replica = list(self._replica.items())  # one C-level copy; the dict may grow
            lag = max((self._known.get(f, s.version) - s.version for f, s in replica), default=0)
            return {
                "bytes_sent": c.bytes_sent,
                "bytes_received": c.bytes_received,
                "pushes": c.pushes,
                "acked": c.acked,
                "duplicates": c.duplicates,
                "rejected": dict(c.rejected),
                "resent": c.resent,
                "snapshots": c.snapshots,
                "updates_applied": c.updates_applied,
                "version_lag": max(0, lag),
                "reconnects": c.reconnects,
                "resyncs": c.resyncs,
                "bad_messages": c.bad_messages,
                "deferred": c.deferred,
                "shards_down": sum(1 for s in self._shards if not s.up),
                "credited_tokens": sum(self._credited.values()),
            }

    def shutdown(self, flush_timeout_s: float) -> int:
        """Flush (bounded), stop the thread, close every socket and the context.

        Args:
            flush_timeout_s: how long to wait for unacked deltas.

        Returns:
            Deltas dropped unacked.
        """
        dropped = 0
        if self.is_alive():
            future: Future = Future()
            self.submit(("close", max(0.0, float(flush_timeout_s)), future))
            try:
                dropped = future.result(timeout=flush_timeout_s + 10.0)
            except Exception as exc:  # the thread failed while closing
                logger.warning("client close: %s", exc)
            self.join(timeout=10.0)
        with self._wake_lock:
            self._wake_tx.close(linger=0)
        if not self.is_alive():
            self._ctx.term()
        return dropped

    # -- thread body -----------------------------------------------------------------

    def run(self) -> None:
        """Serve commands and sockets until closed; record a failure for the API."""
        try:
            while not self._stopped:
                self._iteration(commands=True)
        except Exception as exc:
            logger.exception("client I/O thread failed")
            self.failure = str(exc) or type(exc).__name__
            self._release(len(self._pending) + self._commands.qsize())
            self._fail_commands(exc)
        finally:
            self._close_shards()
            self._wake_rx.close(linger=0)
            if self._close is not None and not self._close[1].done():
                self._close[1].set_result(len(self._pending))

    def _fail_commands(self, exc: Exception) -> None:
        while True:
            try:
                name, _arg, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None and not future.done():
                if name == "close":
                    future.set_result(0)
                else:
                    future.set_exception(ClientError(f"client I/O thread failed: {exc}"))

    def _iteration(self, commands: bool) -> None:
        """Poll once, handle what arrived, run the timers."""
        timeout_ms = int(self._tick_s * 1000) if self._joined or self._shards else 1000
        for sock, _ in self._poller.poll(timeout_ms):
            if sock is self._wake_rx:
                self._drain_wake()
            elif sock in self._sockets:
                role, shard = self._sockets[sock]
                self._read(sock, role, shard)
        if commands:
            self._run_commands()
        if self._joined:
            self._timers(time.monotonic())
        if self._close is not None:
            self._maybe_finish_close(time.monotonic())

    def _drain_wake(self) -> None:
        while True:
            try:
                self._wake_rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _run_commands(self) -> None:
        while True:
            try:
                name, arg, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if name == "push":
                self._on_push(arg)
            elif name == "join":
                self._on_join(arg, future)
            elif name == "close":
                self._close = (time.monotonic() + arg, future)

    # -- sockets ------------------------------------------------------------------------

    def _register(self, sock: zmq.Socket, role: str, shard: _Shard) -> None:
        self._sockets[sock] = (role, shard)
        self._poller.register(sock, zmq.POLLIN)

    def _drop_socket(self, sock: zmq.Socket | None) -> None:
        if sock is None:
            return
        if sock in self._sockets:
            del self._sockets[sock]
            self._poller.unregister(sock)
        sock.close(linger=0)

    def _connect(self, kind: int, endpoint: str) -> zmq.Socket:
        """A socket of `kind` connected to `endpoint`: linger 0, CURVE if set, capped reconnect."""
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            curve.secure_client(sock, *self._curve)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(self.cfg.reconnect_cap_s * 1000))
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        return sock

    def _new_dealer(self, shard: _Shard) -> None:
        self._drop_socket(shard.dealer)
        sock = self._connect(zmq.DEALER, shard.router)
        shard.dealer = sock
        self._register(sock, "dealer", shard)

    def _new_sub(self, shard: _Shard) -> None:
        self._drop_socket(shard.sub)
        sock = self._connect(zmq.SUB, shard.pub)
        shard.sub = sock
        self._register(sock, "sub", shard)

    def _close_shards(self) -> None:
        for shard in self._shards:
            self._drop_socket(shard.dealer)
            self._drop_socket(shard.sub)
            shard.dealer = shard.sub = None
        for sock in list(self._sockets):
            self._drop_socket(sock)
        self._shards = []

    def _send(self, shard: _Shard, header: dict, payload: list[Any] = ()) -> bool:
        """Send one request on a shard's DEALER without blocking; False when its queue is full."""
        if shard.dealer is None:
            return False
        frames = protocol.pack({"island": self.cfg.island, **header}, payload)
        try:
            shard.dealer.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        with self._lock:
            self._counters.bytes_sent += protocol.message_bytes(frames)
        return True

    def _request(self, shard: _Shard, kind: str, about: int = -1, **fields: Any) -> int:
        """Send a tracked request (`about`: its fragment, if any); the reply is matched by id."""
        self._next_id += 1
        rid = self._next_id
        self._requests[rid] = (kind, shard.index, about)
        self._send(shard, {"kind": kind, "id": rid, **fields})
        return rid

    def _read(self, sock: zmq.Socket, role: str, shard: _Shard) -> None:
        for _ in range(_MAX_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            now = time.monotonic()
            with self._lock:
                self._counters.bytes_received += protocol.message_bytes(frames)
            try:
                if role == "dealer":
                    shard.heard = now
                    self._on_reply(shard, frames)
                else:
                    shard.sub_heard = now
                    self._on_published(shard, frames)
            except Resync as why:
                logger.info("re-snapshot shard %d: %s", shard.index, why)
                self._resync(shard, now)
            except (protocol.ProtocolError, codec.CodecError) as exc:
                with self._lock:
                    self._counters.bad_messages += 1
                logger.warning("shard %d sent an unusable %s message: %s", shard.index, role, exc)
            if sock not in self._sockets:  # replaced while handling the message
                return

    # -- join ----------------------------------------------------------------------------

    def _on_join(self, flat: Mapping[str, np.ndarray], future: Future) -> None:
        try:
            future.set_result(self._join(flat, time.monotonic() + self.cfg.join_timeout_s))
        except ClientError as exc:
            self._close_shards()
            future.set_exception(exc)
        except Exception as exc:
            logger.exception("join failed")
            self._close_shards()
            future.set_exception(ClientError(f"join failed: {exc}"))

    def _call(
        self, shard: _Shard, kind: str, deadline: float, payload: list[Any] = (), **fields: Any
    ) -> tuple[dict, list]:
        """Send a request and run the loop until its reply arrives (join only)."""
        self._next_id += 1
        rid = self._next_id
        self._awaited[rid] = None
        resend_at = time.monotonic() + self.cfg.ack_timeout_s
        self._send(shard, {"kind": kind, "id": rid, **fields}, list(payload))
        try:
            while self._awaited[rid] is None:
                now = time.monotonic()
                if now > deadline:
                    raise ClientError(
                        f"join: no {kind} reply from shard at {shard.router} within "
                        f"{self.cfg.join_timeout_s:g}s; is the server running?"
                    )
                if kind == "hello" and now > resend_at:  # hello is idempotent
                    self._send(shard, {"kind": kind, "id": rid, **fields})
                    resend_at = now + self.cfg.ack_timeout_s
                self._iteration(commands=False)
            return self._awaited[rid]
        finally:
            self._awaited.pop(rid, None)

    def _join(self, flat: Mapping[str, np.ndarray], deadline: float) -> JoinResult:
        if self._joined:
            raise ClientError("join() was already called on this client")
        try:
            local_leaves = leaf_specs(flat)
        except (PlanError, ValueError, TypeError) as exc:
            raise ClientError(f"join: cannot use these parameters: {exc}") from None
        first = _Shard(-1, self.cfg.connect, "")
        self._shards = [first]
        self._new_dealer(first)
        welcome, _ = self._call(first, "hello", deadline)
        welcome = self._expect(welcome, "welcome", "hello")
        plan = self._adopt_cluster(welcome, first, local_leaves)
        if not welcome["initialized"]:
            plan = self._initialize(plan, flat, deadline)
        self._plan = plan
        joined = self._sync_all(plan, deadline)
        return dataclasses.replace(joined, mode=str(welcome.get("mode", "quorum")))

    def _expect(self, header: dict, kind: str, what: str) -> dict:
        if header["kind"] != kind:
            raise ClientError(
                f"join: {what} refused: {header.get('reason')}: {header.get('detail')}"
            )
        return header

    def _adopt_cluster(self, welcome: dict, first: _Shard, local_leaves: list) -> Plan:
        endpoints = welcome["endpoints"]
        self._pub_interval_s = max(self.cfg.heartbeat_interval_s, welcome["heartbeat_interval_s"])
        self._pub_liveness = max(self.cfg.liveness, welcome["liveness"])
        limit = welcome.get("max_message_bytes")  # optional field: known to newer shards
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            self.max_message_bytes = limit
        num_shards, num_fragments = welcome["num_shards"], welcome["num_fragments"]
        if len(endpoints) != num_shards or not 0 <= welcome["shard"] < num_shards:
            raise ClientError(
                f"join: welcome lists {len(endpoints)} endpoints for {num_shards} shards "
                f"(shard {welcome['shard']}); the cluster is misconfigured"
            )
        try:
            plan = make_plan(local_leaves, num_shards, num_fragments)
        except PlanError as exc:
            raise ClientError(f"join: cannot shard this model over the cluster: {exc}") from None
        if welcome["initialized"] and welcome["plan_hash"] != plan.hash:
            raise ClientError(_mismatch(welcome["plan_hash"], plan, num_shards, num_fragments))
        shards = []
        for i, (router, pub) in enumerate(endpoints):
            if i == welcome["shard"]:
                first.index, first.pub = i, str(pub)
                shards.append(first)
            else:
                shard = _Shard(i, str(router), str(pub))
                self._new_dealer(shard)
                shards.append(shard)
        self._shards = shards
        logger.info(
            "island %s: cluster of %d shards, %d fragments, initialized=%s, plan %s",
            self.cfg.island,
            num_shards,
            num_fragments,
            welcome["initialized"],
            plan.hash,
        )
        return plan

    def _initialize(self, plan: Plan, flat: Mapping[str, np.ndarray], deadline: float) -> Plan:
        """Init every shard with this island's values (shard 0 first); on a lost race, go on."""
        for shard in self._shards:
            tree = {
                str(f.index): plan.gather(flat, f.index) for f in plan.fragments_of(shard.index)
            }
            frames, _ = _RAW.encode(tree, None)
            reply, _ = self._call(shard, "init", deadline, frames, plan=plan.to_wire())
            if reply["kind"] == "init_ok":
                logger.info("island %s initialized shard %d", self.cfg.island, shard.index)
                continue
            reason = reply.get("reason")
            if reason == "already_initialized":
                logger.info("shard %d already initialized by another island", shard.index)
                welcome, _ = self._call(shard, "hello", deadline)
                welcome = self._expect(welcome, "welcome", "hello")
                if welcome["plan_hash"] != plan.hash:
                    raise ClientError(
                        _mismatch(welcome["plan_hash"], plan, plan.num_shards, plan.num_fragments)
                    )
                if shard.index == 0:
                    break  # lost the race: the winner initializes the other shards
                continue
            if reason == "plan_mismatch":
                raise ClientError(f"join: plan mismatch: {reply.get('detail')}")
            raise ClientError(
                f"join: shard {shard.index} refused init: {reason}: {reply.get('detail')}"
            )
        return plan

    def _sync_all(self, plan: Plan, deadline: float) -> JoinResult:
        now = time.monotonic()
        for shard in self._shards:
            self._new_sub(shard)  # Clone pattern: subscribe before the snapshot
            shard.feed = ShardFeed(
                shard.index, tuple(f.index for f in plan.fragments_of(shard.index)), self._replica
            )
            shard.heard = shard.sub_heard = now
            self._resync(shard, now, count=False)
        while any(s.feed.syncing for s in self._shards):
            if time.monotonic() > deadline:
                missing = [s.index for s in self._shards if s.feed.syncing]
                raise ClientError(
                    f"join: snapshots of shard(s) {missing} not received within "
                    f"{self.cfg.join_timeout_s:g}s"
                )
            self._iteration(commands=False)
            now = time.monotonic()
            for shard in self._shards:  # e.g. a shard the winner of an init race has not reached
                if (
                    shard.feed.syncing
                    and now - shard.feed.sync_started > self.cfg.snapshot_timeout_s
                ):
                    self._resync(shard, now, count=False)
        params = {leaf.path: np.zeros(leaf.shape, dtype=np.float32) for leaf in plan.leaves}
        for index, state in self._replica.items():
            plan.scatter(index, state.values, params)
        versions = {index: state.version for index, state in sorted(self._replica.items())}
        now = time.monotonic()
        for shard in self._shards:
            shard.heard = shard.sub_heard = shard.next_heartbeat = now
        self._joined = True
        logger.info("island %s joined: versions %s", self.cfg.island, versions)
        return JoinResult(plan, params, versions)

    # -- replies -----------------------------------------------------------------------

    def _on_reply(self, shard: _Shard, frames: list) -> None:
        header, payload = protocol.unpack(frames, protocol.REPLY)
        kind, rid = header["kind"], header.get("id")
        if kind == "ack":
            self._on_ack(shard, header)
            return
        if kind == "heartbeat" and "credited" in header:
            self._on_credit(shard, header["credited"])
        if rid in self._awaited:
            self._awaited[rid] = (header, payload)
            return
        if kind == "rejected" and header["reason"] == "unknown_island" and self._joined:
            # The shard forgot us (restart, or we were silent too long): hello again;
            # its welcome re-sends our pending deltas and re-snapshots.
            self._requests.pop(rid, None)
            self._request(shard, "hello")
            return
        request = self._requests.pop(rid, None)
        if request is None:
            return  # a reply to a request from before a reconnect
        what, _, fragment = request
        if kind == "rejected":
            logger.warning(
                "shard %d refused %s: %s: %s",
                shard.index,
                what,
                header["reason"],
                header["detail"],
            )
            if what == "snapshot" and shard.feed is not None:
                # Try again after one ack timeout rather than at the snapshot timeout.
                shard.feed.sync_started = min(
                    shard.feed.sync_started,
                    time.monotonic() - self.cfg.snapshot_timeout_s + self.cfg.ack_timeout_s,
                )
            return
        if what == "snapshot" and kind == "snapshot_reply":
            self._on_snapshot(shard, header, payload)
        elif what == "hello" and kind == "welcome":
            self._on_rewelcome(shard, header)

    def _on_snapshot(self, shard: _Shard, header: dict, payload: list) -> None:
        values = _vector(payload, "values")
        fragment = header["fragment"]
        if self._plan is not None and fragment < self._plan.num_fragments:
            size = self._plan.fragments[fragment].size
            if values.shape != (size,):
                raise protocol.ProtocolError(
                    "bad_shape", f"snapshot of fragment {fragment}: {values.shape}, want {size}"
                )
        with self._lock:
            self._counters.snapshots += 1
            self._known[fragment] = max(self._known.get(fragment, 0), header["version"])
        changed = shard.feed.on_snapshot(fragment, header["version"], header["seq"], values)
        self._publish(changed)

    def _on_rewelcome(self, shard: _Shard, welcome: dict) -> None:
        """A shard answered the hello of a reconnect: re-send its deltas and re-snapshot."""
        if not welcome["initialized"]:
            raise ClientError(
                f"shard {shard.index} restarted without its state (not initialized); "
                "restart the cluster from a checkpoint or re-join with a new client"
            )
        if self._plan is not None and welcome["plan_hash"] != self._plan.hash:
            raise ClientError(
                _mismatch(
                    welcome["plan_hash"],
                    self._plan,
                    welcome["num_shards"],
                    welcome["num_fragments"],
                )
            )
        if not shard.up:
            logger.info("shard %d is back", shard.index)
        shard.up, shard.attempt = True, 0
        now = time.monotonic()
        for pending in self._pending.values():
            if pending.shard == shard.index:
                self._send_push(shard, pending, now, resend=pending.sends > 0)
        self._resync(shard, now)

    def _on_ack(self, shard: _Shard, header: dict) -> None:
        key = (header["fragment"], header["round"])
        outcome, reason = header["outcome"], header.get("reason")
        with self._lock:
            f = header["fragment"]
            self._known[f] = max(self._known.get(f, 0), header["version"])
        pending = self._pending.get(key)
        if pending is None:
            return  # ack of a re-send whose first copy was already acked
        if outcome == "rejected" and reason == "unknown_island":
            self._request(shard, "hello")  # the shard forgot us; the delta stays pending
            return
        if outcome == "rejected" and reason in RETRYABLE_REASONS:
            # the shard's buffer for us is full: keep the delta and re-send it once the
            # fragment steps (its buffer empties), or on the ack timeout; a full buffer
            # becomes back-pressure, not lost work
            pending.deferred = True
            with self._lock:
                self._counters.deferred += 1
            return
        if (
            outcome == "rejected"
            and reason == "codec_error"
            and pending.decode_retries < DECODE_RETRIES
        ):
            pending.decode_retries += 1
            self._send_push(shard, pending, time.monotonic(), resend=True)
            return
        del self._pending[key]
        with self._lock:
            self._record_merge_target(header)
            if outcome in ("accepted", "duplicate"):
                self._counters.acked += 1
                self._ack_latencies.append(time.monotonic() - pending.queued_at)
                self._counters.duplicates += outcome == "duplicate"
            else:
                self._counters.rejected[reason or "unknown"] += 1
        if outcome not in ("accepted", "duplicate"):
            logger.warning(
                "delta island=%s fragment=%d round=%d rejected: %s",
                self.cfg.island,
                key[0],
                key[1],
                reason,
            )
        self._release(1)

    def _on_credit(self, shard: _Shard, credited: object) -> None:
        """A shard's cumulative credit of our tokens (heartbeat reply or published step)."""
        if isinstance(credited, int | float) and not isinstance(credited, bool):
            with self._lock:
                self._credited[shard.index] = max(
                    self._credited.get(shard.index, 0.0), float(credited)
                )

    def _record_merge_target(self, ack: dict) -> None:
        """Remember which version will include an acked delta (None: rejected, never)."""
        target = ack.get("merged_version")
        if ack["outcome"] == "rejected":
            target = None
        elif target is None:  # a shard that does not say: a step merges all pending
            target = ack["version"] + (ack["outcome"] == "accepted")
        self._merge_targets.setdefault(ack["round"], {})[ack["fragment"]] = target
        while len(self._merge_targets) > _MAX_MERGE_ROUNDS:
            del self._merge_targets[min(self._merge_targets)]

    # -- published updates ------------------------------------------------------------

    def _on_published(self, shard: _Shard, frames: list) -> None:
        header, payload = protocol.unpack(frames, protocol.PUB)
        if shard.feed is None or header["shard"] != shard.index:
            return
        if header["kind"] == "heartbeat":
            shard.feed.on_heartbeat(header["seq"])
            return
        fragment = header["fragment"]
        values = _vector(payload, "values")
        if self._plan is not None and (
            fragment >= self._plan.num_fragments
            or values.shape != (self._plan.fragments[fragment].size,)
        ):
            raise Resync(f"update of fragment {fragment} with shape {values.shape}")
        if header["mode"] not in ("full", "delta"):
            raise protocol.ProtocolError("malformed", f"update mode {header['mode']!r}")
        with self._lock:
            self._known[fragment] = max(self._known.get(fragment, 0), header["version"])
        credit = header.get("credited", {}).get(self.cfg.island)
        if credit is not None:
            self._on_credit(shard, credit)
        item = Published(header["seq"], fragment, header["version"], header["mode"], values)
        self._publish(shard.feed.on_update(item))
        self._resend_deferred(shard, fragment)

    def _resend_deferred(self, shard: _Shard, fragment: int) -> None:
        """A fragment stepped, so the shard has room again: re-send what it deferred (in order)."""
        now = time.monotonic()
        for pending in self._pending.values():
            if pending.deferred and pending.request.fragment == fragment:
                pending.deferred = False
                self._send_push(shard, pending, now, resend=True)

    def _publish(self, fragments: list[int]) -> None:
        """Hand changed fragments to `poll_updates` (after join; join returns them itself)."""
        if not fragments or not self._joined:
            return
        with self._lock:
            for f in fragments:
                state = self._replica[f]
                self._updates[f] = Update(f, state.version, state.values.copy())
                self._counters.updates_applied += 1

    def _resync(self, shard: _Shard, now: float, count: bool = True) -> None:
        if shard.feed is None:
            return
        if count:
            with self._lock:
                self._counters.resyncs += 1
        for fragment in shard.feed.begin_sync(now):
            self._request(shard, "snapshot", fragment, fragment=fragment)

    # -- pushes -------------------------------------------------------------------------

    def _on_push(self, request: PushRequest) -> None:
        key = (request.fragment, request.round)
        with self._lock:
            self._counters.pushes += 1
        if key in self._pending:
            logger.warning(
                "push of fragment %d round %d ignored: that round is still pending", *key
            )
            self._release(1)
            return
        shard_index = self._plan.fragments[request.fragment].shard
        header = {
            "kind": "push",
            "island": self.cfg.island,
            "round": request.round,
            "fragment": request.fragment,
            "base_version": request.base_version,
            "tokens": request.tokens,
            "steps": request.steps,
            "plan_hash": self._plan.hash,
            **self._step_time_field(),
        }
        frames = protocol.pack(header, request.frames)
        pending = _Pending(request, shard_index, frames, protocol.message_bytes(frames))
        self._pending[key] = pending
        shard = self._shards[shard_index]
        now = time.monotonic()
        pending.sent_at = pending.queued_at = now
        if shard.up:
            self._send_push(shard, pending, now, resend=False)

    def _step_time_field(self) -> dict[str, float]:
        step_time = self.step_time_s
        return {} if step_time is None else {"t_step": step_time}

    def _send_push(self, shard: _Shard, pending: _Pending, now: float, resend: bool) -> None:
        try:
            shard.dealer.send_multipart(pending.frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pending.sent_at = now  # queue full: try again after the back-off
            return
        pending.sends += 1
        pending.sent_at = now
        with self._lock:
            self._counters.bytes_sent += pending.nbytes
            self._counters.resent += resend

    # -- timers -------------------------------------------------------------------------

    def _timers(self, now: float) -> None:
        cfg = self.cfg
        for shard in self._shards:
            if is_silent(now, shard.heard, cfg.heartbeat_interval_s, cfg.liveness):
                if now >= shard.next_reconnect:
                    self._reconnect(shard, now)
            elif now >= shard.next_heartbeat:
                self._send(shard, {"kind": "heartbeat", **self._step_time_field()})
                shard.next_heartbeat = now + cfg.heartbeat_interval_s
            feed = shard.feed
            if feed is None:
                continue
            if feed.syncing:
                if now - feed.sync_started > cfg.snapshot_timeout_s:
                    logger.info("shard %d: snapshot timed out; asking again", shard.index)
                    self._resync(shard, now)
            elif shard.up and is_silent(
                now, shard.sub_heard, self._pub_interval_s, self._pub_liveness
            ):
                logger.info("shard %d: update stream silent; re-snapshot", shard.index)
                shard.sub_heard = now
                self._resync(shard, now)
        for pending in self._pending.values():
            shard = self._shards[pending.shard]
            if shard.up and resend_due(
                now, pending.sent_at, pending.attempt, cfg.ack_timeout_s, cfg.ack_timeout_cap_s
            ):
                pending.attempt += 1
                self._send_push(shard, pending, now, resend=pending.sends > 0)

    def _reconnect(self, shard: _Shard, now: float) -> None:
        """Paranoid Pirate: a silent shard gets a fresh DEALER and a new hello."""
        if shard.up:
            logger.warning(
                "shard %d silent for %.1fs: reconnecting", shard.index, now - shard.heard
            )
        shard.up = False
        for rid in [r for r, (_, s, _) in self._requests.items() if s == shard.index]:
            del self._requests[rid]
        self._new_dealer(shard)
        self._request(shard, "hello")
        shard.next_reconnect = now + next_backoff(
            shard.attempt, self.cfg.heartbeat_interval_s, self.cfg.reconnect_cap_s
        )
        shard.attempt += 1
        with self._lock:
            self._counters.reconnects += 1

    # -- close -----------------------------------------------------------------------------

    def _maybe_finish_close(self, now: float) -> None:
        deadline, future = self._close
        if self._pending and now < deadline:
            return
        dropped = len(self._pending)
        if dropped:
            logger.warning("closing with %d deltas unacked", dropped)
        for shard in self._shards:
            if shard.up:
                self._send(shard, {"kind": "bye"})
        self._close_shards()
        self._pending.clear()
        self._stopped = True
        future.set_result(dropped)


def _vector(payload: list, name: str) -> np.ndarray:
    """Decode codec frames holding {name: 1-D vector} into float32."""
    tree = codec.decode(payload)
    if name not in tree:
        raise protocol.ProtocolError("malformed", f"payload has no {name!r} tensor")
    values = np.asarray(tree[name])
    if values.ndim != 1:
        raise protocol.ProtocolError("bad_shape", f"{name} must be 1-D, got {values.shape}")
    return values.astype(np.float32, copy=False)


def _mismatch(theirs: str | None, plan: Plan, num_shards: int, num_fragments: int) -> str:
    return (
        f"plan mismatch: the cluster's plan hash is {theirs}, this island's is {plan.hash} "
        f"({len(plan.leaves)} leaves over {num_shards} shards, {num_fragments} fragments): "
        "this model's parameter names, shapes or dtypes differ from the cluster's"
    )
