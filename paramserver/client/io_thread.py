"""The client's network thread: the one thread that touches an island's sockets.

This module owns the island side's event loop over the wire protocol
(`paramserver.wire.protocol`): commands from the API (join, push, close), replies
and acks on each shard's DEALER, published updates on each shard's SUB,
heartbeats to every shard, reconnect of a silent shard (Paranoid Pirate) and
re-snapshot on a sequence gap or a silent update stream. The rules live next
to it: which deltas to send, keep or re-send in `paramserver.client.outbox`, the
join's steps in `paramserver.client.join`, the checks of snapshots and
updates in `paramserver.client.decode`; the sockets are
`paramserver.client.links`' and the state the API reads
`paramserver.client.shared`'s. The public API (`paramserver.client`) talks to
this thread only through `submit` (a queue plus an inproc wake-up), `shared`,
`stats`, `shutdown`, the `stop_join` event and the plain attributes `failure`,
`max_message_bytes` and `step_time_s`.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import numpy as np
import zmq

import codec
from paramserver.client import decode as client_decode
from paramserver.client import join as client_join
from paramserver.client.links import Links, ShardLink
from paramserver.client.outbox import Key, Outbox
from paramserver.client.replica import Resync
from paramserver.client.shared import Shared
from paramserver.client.types import ClientConfig, ClientError, JoinResult, PushRequest
from paramserver.client.unacked import StorageWarning, requests_of
from paramserver.wire import protocol
from paramserver.wire.liveness import is_silent, next_backoff
from paramserver.wire.plan import Plan

logger = logging.getLogger(__name__)

_MAX_BATCH = 256  # messages read from one socket per poll round, so no socket starves the rest


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
        self.stop_join = threading.Event()  # set by the API: a join in progress gives up
        # Drawn once per client and sent in every hello, so that a shard lets this
        # client's reconnect (a new DEALER) take its island id over at once.
        self._session = secrets.token_hex(8)
        self._storage_warning = StorageWarning()
        self.shared = Shared()  # what the API reads: updates, acks, replica, counters
        self._release = release
        self._links = Links(cfg, wake_endpoint)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox = Outbox(cfg.ack_timeout_s, cfg.ack_timeout_cap_s, cfg.ack_timeout_floor_s)
        self._plan: Plan | None = None
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
        self._links.wake()

    def stats(self) -> dict[str, Any]:
        """A copy of the counters plus derived values.

        Returns:
            The stats dict of `Client.stats` (without `pending`).
        """
        out = self.shared.stats(sum(1 for s in self._links.shards if not s.up))
        return {**out, "ack_timeout_s": self._outbox.timer.base_s}  # the timer is immutable

    def shutdown(self, flush_timeout_s: float) -> list[PushRequest]:
        """Flush (bounded), stop the thread, close every socket and the context.

        Args:
            flush_timeout_s: how long to wait for unacked deltas (less when every
                shard that holds one is down).

        Returns:
            The deltas dropped unacked, in push order.
        """
        dropped: list[PushRequest] = []
        if self.is_alive():
            future: Future = Future()
            self.submit(("close", max(0.0, float(flush_timeout_s)), future))
            try:
                dropped = future.result(timeout=flush_timeout_s + 10.0)
            except Exception as exc:  # the thread failed while closing
                logger.warning("client close: %s", exc)
            self.join(timeout=10.0)
        if not self.is_alive():  # a thread that failed left its ledger to us
            dropped += requests_of(self._outbox.drop_all())
        self._links.close_wake()
        if not self.is_alive():
            self._links.term()
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
            self._release(len(self._outbox) + self._commands.qsize())
            self._fail_commands(exc)
        finally:
            self._links.close()
            if self._close is not None and not self._close[1].done():
                self._close[1].set_result(requests_of(self._outbox.drop_all()))

    def _fail_commands(self, exc: Exception) -> None:
        while True:
            try:
                name, _arg, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None and not future.done():
                if name == "close":
                    future.set_result(requests_of(self._outbox.drop_all()))
                else:
                    future.set_exception(ClientError(f"client I/O thread failed: {exc}"))

    def _iteration(self, commands: bool) -> None:
        """Poll once, handle what arrived, run the timers (a join that is stopped gives up)."""
        if not commands and self.stop_join.is_set():
            raise ClientError("join: stopped before it finished")
        timeout_ms = int(self._tick_s * 1000) if self._joined or self._links.shards else 1000
        for sock in self._links.poll(timeout_ms):
            owner = self._links.owner(sock)
            if owner is not None:
                self._read(sock, *owner)
        if commands:
            self._run_commands()
        if self._joined:
            self._timers(time.monotonic())
        if self._close is not None:
            self._maybe_finish_close(time.monotonic())

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

    # -- messages ------------------------------------------------------------------------

    def _send(self, shard: ShardLink, header: dict, payload: list[Any] = ()) -> bool:
        """Send one request on a shard's DEALER without blocking; False when its queue is full."""
        if header["kind"] == "hello":
            header = {**header, "session": self._session}
        frames = protocol.pack({"island": self.cfg.island, **header}, payload)
        if not self._links.send(shard, frames):
            return False
        self.shared.add(bytes_sent=protocol.message_bytes(frames))
        return True

    def _request(self, shard: ShardLink, kind: str, about: int = -1, **fields: Any) -> int:
        """Send a tracked request (`about`: its fragment, if any); the reply is matched by id."""
        self._next_id += 1
        rid = self._next_id
        self._requests[rid] = (kind, shard.index, about)
        self._send(shard, {"kind": kind, "id": rid, **fields})
        return rid

    def _read(self, sock: zmq.Socket, role: str, shard: ShardLink) -> None:
        for _ in range(_MAX_BATCH):
            frames = self._links.recv(sock)
            if frames is None:
                return
            now = time.monotonic()
            self.shared.add(bytes_received=protocol.message_bytes(frames))
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
                self.shared.add(bad_messages=1)
                logger.warning("shard %d sent an unusable %s message: %s", shard.index, role, exc)
            if self._links.owner(sock) is None:  # replaced while handling the message
                return

    # -- join ----------------------------------------------------------------------------

    def _on_join(self, flat: Mapping[str, np.ndarray], future: Future) -> None:
        try:
            future.set_result(self._join(flat, time.monotonic() + self.cfg.join_timeout_s))
        except ClientError as exc:
            self._links.close_shards()
            future.set_exception(exc)
        except Exception as exc:
            logger.exception("join failed")
            self._links.close_shards()
            future.set_exception(ClientError(f"join failed: {exc}"))

    def _call(
        self, shard: ShardLink, kind: str, deadline: float, payload: list[Any] = (), **fields: Any
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
        loop = client_join.Loop(
            call=self._call,
            pump=lambda: self._iteration(commands=False),
            resync=lambda shard, now: self._resync(shard, now, count=False),
            adopt=self._adopt,
        )
        result = client_join.join(self.cfg, self._links, self.shared.replica, flat, deadline, loop)
        self._joined = True
        return result

    def _adopt(self, cluster: client_join.Cluster) -> None:
        """The join knows the cluster: use its plan and its PUB stream's heartbeat settings."""
        self._plan = cluster.plan
        self.shared.num_fragments = cluster.plan.num_fragments
        self._pub_interval_s, self._pub_liveness = cluster.pub_interval_s, cluster.pub_liveness
        if cluster.max_message_bytes is not None:
            self.max_message_bytes = cluster.max_message_bytes

    # -- replies -----------------------------------------------------------------------

    def _on_reply(self, shard: ShardLink, frames: list) -> None:
        header, payload = protocol.unpack(frames, protocol.REPLY)
        kind, rid = header["kind"], header.get("id")
        if kind == "ack":
            self._on_ack(shard, header)
            return
        if kind == "heartbeat" and "credited" in header:
            self.shared.credit(shard.index, header["credited"])
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

    def _on_snapshot(self, shard: ShardLink, header: dict, payload: list) -> None:
        values = client_decode.snapshot_values(header, payload, self._plan)
        fragment = header["fragment"]
        self.shared.add(snapshots=1)
        self.shared.note_version(fragment, header["version"])
        changed = shard.feed.on_snapshot(fragment, header["version"], header["seq"], values)
        self._publish(changed)

    def _on_rewelcome(self, shard: ShardLink, welcome: dict) -> None:
        """A shard answered the hello of a reconnect: re-send its deltas and re-snapshot."""
        client_join.check_rewelcome(welcome, self._plan, shard.index)
        limit = client_join.welcome_limit(welcome)
        if limit is not None:
            self.max_message_bytes = limit
        if not shard.up:
            logger.info("shard %d is back", shard.index)
        shard.up, shard.attempt = True, 0
        now = time.monotonic()
        for key in self._outbox.on_rejoin(shard.index):
            self._send_push(key, now)
        self._resync(shard, now)

    def _on_ack(self, shard: ShardLink, header: dict) -> None:
        key = (header["fragment"], header["round"])
        self.shared.note_version(header["fragment"], header["version"])
        now = time.monotonic()
        if self._outbox.spurious(key, header["outcome"]):
            self.shared.add(spurious_resends=1)
        entry = self._outbox.get(key)
        if entry is None:
            return  # ack of a re-send whose first copy was already acked
        decision = self._outbox.on_ack(key, header["outcome"], header.get("reason"), now)
        if decision == "rejoin":
            self._request(shard, "hello")  # the shard forgot us; the delta stays pending
        elif decision == "defer":
            # the shard's buffer for us is full (or its disk failed): the delta is re-sent
            # once the fragment steps (its buffer empties), or on the ack back-off; a full
            # buffer becomes back-pressure, not lost work
            self.shared.add(deferred=1)
            self._storage_warning.note(shard.index, header, now)
        elif decision == "resend":  # corrupted in transit (codec_error): again, at once
            self._send_push(key, now)
        else:
            self.shared.record_ack(header, now - entry.queued_at)
            if header["outcome"] not in (protocol.ACCEPTED, protocol.DUPLICATE):
                logger.warning(
                    "delta island=%s fragment=%d round=%d rejected: %s",
                    self.cfg.island,
                    key[0],
                    key[1],
                    header.get("reason"),
                )
            self._release(1)

    # -- published updates ------------------------------------------------------------

    def _on_published(self, shard: ShardLink, frames: list) -> None:
        header, payload = protocol.unpack(frames, protocol.PUB)
        if shard.feed is None or header["shard"] != shard.index:
            return
        if header["kind"] == "heartbeat":
            shard.feed.on_heartbeat(header["seq"])
            return
        item = client_decode.published_update(header, payload, self._plan)
        fragment = item.fragment
        self.shared.note_version(fragment, header["version"])
        credit = header.get("credited", {}).get(self.cfg.island)
        if credit is not None:
            self.shared.credit(shard.index, credit)
        self._publish(shard.feed.on_update(item))
        # The fragment stepped, so the shard has room again: re-send what it deferred.
        now = time.monotonic()
        for key in self._outbox.on_step(fragment):
            self._send_push(key, now)

    def _publish(self, fragments: list[int]) -> None:
        """Hand changed fragments to `poll_updates` (after join; join returns them itself)."""
        if fragments and self._joined:
            self.shared.publish(fragments)

    def _resync(self, shard: ShardLink, now: float, count: bool = True) -> None:
        if shard.feed is None:
            return
        if count:
            self.shared.add(resyncs=1)
        for fragment in shard.feed.begin_sync(now):
            self._request(shard, "snapshot", fragment, fragment=fragment)

    # -- pushes -------------------------------------------------------------------------

    def _on_push(self, request: PushRequest) -> None:
        key = (request.fragment, request.round)
        self.shared.add(pushes=1)
        if key in self._outbox:
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
        now = time.monotonic()
        self._outbox.add(key, shard_index, frames, protocol.message_bytes(frames), now)
        if self._links.shards[shard_index].up:
            self._send_push(key, now)

    def _step_time_field(self) -> dict[str, float]:
        step_time = self.step_time_s
        return {} if step_time is None else {"t_step": step_time}

    def _send_push(self, key: Key, now: float) -> None:
        """Send a pending delta (again) to its shard; the outbox learns whether it went out."""
        entry = self._outbox.get(key)
        if not self._links.send(self._links.shards[entry.shard], entry.frames):
            self._outbox.blocked(key, now)  # queue full: try again after the back-off
            return
        resend = self._outbox.sent(key, now)
        self.shared.add(bytes_sent=entry.nbytes, resent=int(resend))

    # -- timers -------------------------------------------------------------------------

    def _timers(self, now: float) -> None:
        cfg = self.cfg
        for shard in self._links.shards:
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
        up = {shard.index for shard in self._links.shards if shard.up}
        for key in self._outbox.due(now, up):
            self._send_push(key, now)

    def _reconnect(self, shard: ShardLink, now: float) -> None:
        """Paranoid Pirate: a silent shard gets a fresh DEALER and a new hello."""
        if shard.up:
            logger.warning(
                "shard %d silent for %.1fs: reconnecting", shard.index, now - shard.heard
            )
        shard.up = False
        for rid in [r for r, (_, s, _) in self._requests.items() if s == shard.index]:
            del self._requests[rid]
        self._links.open_dealer(shard)
        self._request(shard, "hello")
        shard.next_reconnect = now + next_backoff(
            shard.attempt, self.cfg.heartbeat_interval_s, self.cfg.reconnect_cap_s
        )
        shard.attempt += 1
        self.shared.add(reconnects=1)

    # -- close -----------------------------------------------------------------------------

    def _maybe_finish_close(self, now: float) -> None:
        deadline, future = self._close
        up = {shard.index for shard in self._links.shards if shard.up}
        if self._outbox and now < deadline and self._outbox.shards() & up:
            return  # a shard that is up holds deltas: wait (bounded) for their acks
        if self._outbox:
            logger.warning("closing with %d deltas unacked", len(self._outbox))
        for shard in self._links.shards:
            if shard.up:
                self._send(shard, {"kind": "bye"})
        self._links.close_shards()
        self._stopped = True
        future.set_result(requests_of(self._outbox.drop_all()))
