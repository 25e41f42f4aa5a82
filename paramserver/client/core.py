"""The client's sans-I/O core: join, ledger, replica, acks and re-sends, with no sockets.

This module owns the island side of the wire protocol (docs/protocol.md) as
one object that takes the time and the messages as arguments and returns
what to do (`paramserver.client.shards`: open, close, send on numbered
links), in the h11 pattern. It imports neither zmq, threading nor the
clock: the I/O thread (`paramserver.client.io_thread.IOThread`) only moves bytes and
calls `on_message`, `on_tick`, `push` and `on_sent`, under one lock that also
guards the API's reads. `ClientCore` holds:

- the join: `start_join`, then the handshake's states and a snapshot of
  every fragment (`paramserver.client.joining`); `join_outcome` says how it
  ended;
- the one ledger of pending deltas (`paramserver.client.ledger`), sent,
  re-sent after the adaptive ack timeout, deferred or resolved by acks;
- the replica and each shard's update stream (`paramserver.client.replica`),
  re-snapshotted on a gap or a silent stream (`ClientConfig.keep`: fp32
  values, or only versions and the increments' codes handed out, or only
  versions);
- heartbeats, and Paranoid Pirate reconnects of a silent shard (a fresh
  DEALER and a hello; its welcome re-sends that shard's deltas);
- close: wait (bounded) for acks of shards that are up, then bye.

Over 400 lines on purpose: the reply, ack, update and timer handlers share
one state (the shards, their links, the requests in flight); the decisions
they apply live in the ledger, the replica, the handshake and
`paramserver.client.welcome`.

"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

import codec
from paramserver.client.joining import Join
from paramserver.client.ledger import Key, Ledger, StorageWarning
from paramserver.client.replica import Readout, Resync, published_update
from paramserver.client.shards import Effect, Send, ShardLink, Shards
from paramserver.client.types import ClientConfig, ClientError, JoinResult, PushRequest, Update
from paramserver.client.welcome import check_rewelcome, welcome_limit
from paramserver.wire import protocol
from paramserver.wire.plan import Plan
from paramserver.wire.protocol import is_silent, next_backoff

logger = logging.getLogger(__name__)


class ClientCore:
    """One island's protocol state (see the module docstring); callers serialise the calls."""

    def __init__(self, cfg: ClientConfig, session: str) -> None:
        """Create an idle core (nothing is sent before `start_join`).

        Args:
            cfg: client settings.
            session: a token drawn once per client, sent in every hello (unless
                `cfg.session` gives the island's own), so that a shard lets this client's
                reconnect take its island id over at once.
        """
        self.cfg = cfg
        self.readout = Readout(cfg.keep)
        self.ledger = Ledger(cfg.ack_timeout_s, cfg.ack_timeout_cap_s, cfg.ack_timeout_floor_s)
        self.plan: Plan | None = None
        # The shards' size limit once a welcome says (a bigger push would be dropped
        # with the connection, not answered): checked by `Client.push`.
        self.max_message_bytes: int | None = None
        # The island's typical inner-step time (s), sent in pushes and heartbeats as
        # `t_step` for the shards' adaptive grace window; None: not reported.
        self.step_time_s: float | None = None
        # The island's configured H, sent in pushes as `inner_steps`; None: not said.
        self.inner_steps: int | None = None
        # What the island last reported of its training (protocol.TRAINING_FIELDS), sent
        # with every later push and heartbeat for the cluster page.
        self.training: dict[str, float] = {}
        self.state = "idle"  # idle -> joining -> joined -> closed (a failed join: idle again)
        self.join_outcome: JoinResult | ClientError | None = None
        self.dropped: list[PushRequest] = []  # what close left unacked
        self._join: Join | None = None  # the join in progress
        self._shards = Shards(
            cfg.island, cfg.session or session, cfg.keep != "versions", cfg.bulk_flows
        )
        self._storage_warning = StorageWarning()
        self._close_at: float | None = None
        # The PUB stream heartbeats at the server's interval: judge its silence by
        # the slower of the server's and our own settings (set from the welcome).
        self._pub_interval_s = cfg.heartbeat_interval_s
        self._pub_liveness = cfg.liveness

    # -- queries (the API, under the I/O thread's lock) --------------------------------

    @property
    def joined(self) -> bool:
        """True once the join returned its result (until close)."""
        return self.state == "joined"

    @property
    def closed(self) -> bool:
        """True once close finished: every link is closed, `dropped` holds what was left."""
        return self.state == "closed"

    @property
    def has_links(self) -> bool:
        """Whether any link is open (an idle core needs no ticks)."""
        return self._shards.has_links

    def stats(self) -> dict[str, Any]:
        """The stats dict of `Client.stats`."""
        out = self.readout.stats(sum(1 for s in self._shards.all if not s.up))
        return {**out, "ack_timeout_s": self.ledger.timer.base_s, "pending": len(self.ledger)}

    # -- the join -------------------------------------------------------------------------

    def start_join(self, now: float, flat: Mapping[str, np.ndarray]) -> list[Effect]:
        """Start joining the cluster (`paramserver.client.joining`): hello to the configured shard.

        Args:
            now: current time.
            flat: path -> this island's parameters (see `Client.join`).

        Returns:
            Effects to perform; `join_outcome` is set when the join ended.

        Raises:
            ClientError: joined already, a join in progress, or unusable
                parameters (nothing is sent then).
        """
        if self.state != "idle":
            raise ClientError(f"join: this client is {self.state}; a client joins once")
        self._join = Join(self.cfg, flat, now, self._shards, self.readout)
        self.join_outcome = None
        self.state = "joining"
        self._after_join_step()
        return self._shards.flush()

    def stop_join(self) -> list[Effect]:
        """Give up a join in progress (the API's `stop` event); no-op otherwise."""
        if self._join is not None:
            self._join.fail(ClientError("join: stopped before it finished"))
            self._after_join_step()
        return self._shards.flush()

    def _after_join_step(self) -> None:
        """Take what the join learnt: the cluster's settings, and how it ended."""
        join = self._join
        if join.cluster is not None and self.plan is None:
            cluster = join.cluster
            self.plan = cluster.plan
            self.readout.num_fragments = cluster.plan.num_fragments
            self._pub_interval_s, self._pub_liveness = cluster.pub_interval_s, cluster.pub_liveness
            if cluster.max_message_bytes is not None:
                self.max_message_bytes = cluster.max_message_bytes
        if join.outcome is None:
            return
        self.join_outcome, self._join = join.outcome, None
        if isinstance(self.join_outcome, JoinResult):
            self.state = "joined"
            return
        self._shards.close_all()
        self.plan = None
        self.state = "idle"

    # -- messages ------------------------------------------------------------------------

    def on_message(self, now: float, link: int, frames: list[Any]) -> list[Effect]:
        """Take one message that arrived on `link`.

        Args:
            now: when it arrived.
            link: the link it came in on (one already closed is ignored).
            frames: its frames.

        Returns:
            Effects to perform.

        Raises:
            ClientError: a shard that was joined lost its state or changed its plan
                (the client cannot go on).
        """
        owner = self._shards.owner(link)
        if owner is None:
            return []
        role, shard = owner
        self.readout.add(bytes_received=protocol.message_bytes(frames))
        try:
            if role == "dealer":
                shard.heard = now
                self._on_reply(now, shard, frames, link)
            else:
                shard.sub_heard = now
                self._on_published(now, shard, frames)
        except Resync as why:
            logger.info("re-snapshot shard %d: %s", shard.index, why)
            self._resync(shard, now)
        except (protocol.ProtocolError, codec.CodecError) as exc:
            self.readout.add(bad_messages=1)
            logger.warning("shard %d sent an unusable %s message: %s", shard.index, role, exc)
        if self._join is not None:
            self._join.check_synced(now)
            self._after_join_step()
        return self._shards.flush()

    def on_link_down(self, now: float, link: int) -> list[Effect]:
        """The connection of `link` died (the I/O loop saw it disconnect).

        A bulk link is replaced and what it carried unanswered is sent again on
        the shard's other links (`Shards.on_link_down`); the control link is
        left to the shard's liveness (a silent shard is reconnected).

        Args:
            now: when it was seen.
            link: the link (one already closed is ignored).

        Returns:
            Effects to perform.
        """
        owner = self._shards.owner(link)
        if owner is not None and self.state in ("joining", "joined"):
            _, shard = owner
            if link in shard.bulk:
                logger.info("shard %d: a bulk connection died; its messages go again", shard.index)
                self._shards.on_link_down(shard, link)
        return self._shards.flush()

    def _on_reply(self, now: float, shard: ShardLink, frames: list, link: int) -> None:
        header, payload = protocol.unpack(frames, protocol.REPLY)
        if self._shards.on_link_reply(shard, link, header):  # a bulk link's attach
            return
        kind, rid = header["kind"], header.get("id")
        if kind == "ack":
            self._on_ack(now, shard, header)
            return
        if kind == "heartbeat" and "credited" in header:
            self.readout.credit(shard.index, header["credited"])
        if self._join is not None and self._join.owns(rid):
            self._join.on_reply(now, rid, header)
            self._after_join_step()
            return
        if kind == "rejected" and header["reason"] == "unknown_island" and self.joined:
            # The shard forgot us (restart, or we were silent too long): hello again;
            # its welcome re-sends our pending deltas and re-snapshots.
            self._shards.requests.pop(rid, None)
            self._shards.request(shard, "hello")
            return
        request = self._shards.requests.pop(rid, None)
        if request is None:
            return  # a reply to a request from before a reconnect
        what, _, fragment = request
        if kind == "rejected":
            logger.warning(
                "shard %d refused %s: %s: %s", shard.index, what, header["reason"], header["detail"]
            )
            if what == "snapshot" and shard.feed is not None:
                # Try again after one ack timeout rather than at the snapshot timeout.
                shard.feed.sync_started = min(
                    shard.feed.sync_started,
                    now - self.cfg.snapshot_timeout_s + self.cfg.ack_timeout_s,
                )
            return
        if what == "snapshot" and kind == "snapshot_reply":
            self._on_snapshot(now, shard, header, payload)
        elif what == "hello" and kind == "welcome":
            self._on_rewelcome(now, shard, header)

    def _on_snapshot(self, now: float, shard: ShardLink, header: dict, payload: list) -> None:
        done = self._shards.on_snapshot_piece(shard, header, payload)
        if done is None or shard.feed is None:
            return
        fragment, version, seq, values = done
        self.readout.add(snapshots=1)
        self.readout.note_version(fragment, version)
        self._publish(shard.feed.on_snapshot(fragment, version, seq, values), now)

    def _on_rewelcome(self, now: float, shard: ShardLink, welcome: dict) -> None:
        """A shard answered the hello of a reconnect: re-send its deltas and re-snapshot."""
        check_rewelcome(welcome, self.plan, shard.index)
        limit = welcome_limit(welcome)
        if limit is not None:
            self.max_message_bytes = self._shards.max_message_bytes = limit
        if not shard.up:
            logger.info("shard %d is back", shard.index)
        shard.up, shard.attempt = True, 0
        for key in self.ledger.on_rejoin(shard.index):
            self._send_push(key)
        self._resync(shard, now)

    def _on_ack(self, now: float, shard: ShardLink, header: dict) -> None:
        key = (header["fragment"], header["round"])
        self.readout.note_version(header["fragment"], header["version"])
        if self.ledger.spurious(key, header["outcome"]):
            self.readout.add(spurious_resends=1)
        entry = self.ledger.get(key)
        if entry is None:
            return  # ack of a re-send whose first copy was already acked
        decision = self.ledger.on_ack(
            key, header["outcome"], header.get("reason"), now, header.get("retry_after_s")
        )
        if decision == "rejoin":
            self._shards.request(shard, "hello")  # the shard forgot us; the delta stays pending
        elif decision == "defer":
            # the shard's buffer for us is full (or its disk failed): the delta is re-sent
            # once the fragment steps (its buffer empties), or on the ack back-off; a full
            # buffer becomes back-pressure, not lost work
            self.readout.add(deferred=1)
            self._storage_warning.note(shard.index, header, now)
        elif decision == "resend":  # corrupted in transit (codec_error): again, at once
            self._send_push(key)
        else:
            self.readout.record_ack(header, now - entry.queued_at, entry.frames[1:])
            if header["outcome"] not in (protocol.ACCEPTED, protocol.DUPLICATE):
                logger.warning(
                    "delta island=%s fragment=%d round=%d rejected: %s",
                    self.cfg.island,
                    key[0],
                    key[1],
                    header.get("reason"),
                )

    def _on_published(self, now: float, shard: ShardLink, frames: list) -> None:
        header, payload = protocol.unpack(frames, protocol.PUB)
        if shard.feed is None or header["shard"] != shard.index:
            return
        if header["kind"] == "heartbeat":
            shard.feed.on_heartbeat(header["seq"])
            return
        item = published_update(header, payload, self.plan, self.cfg.keep)
        self.readout.note_version(item.fragment, header["version"])
        credit = header.get("credited", {}).get(self.cfg.island)
        if credit is not None:
            self.readout.credit(shard.index, credit)
        self._publish(shard.feed.on_update(item), now)
        # The fragment stepped, so the shard has room again: re-send what it deferred.
        for key in self.ledger.on_step(item.fragment, now):
            self._send_push(key)

    def _publish(self, updates: list[Update], now: float) -> None:
        """Hand updates to `poll_updates` (after join; join returns them itself).

        A fragment whose untaken increments outgrew their bound is forgotten and its
        shard snapshotted again (the snapshot's values go to the caller).
        """
        if not updates or not self.joined:
            return
        dropped = set(self.readout.publish(updates))
        for fragment in dropped:  # forgotten: their snapshot's values are handed out
            del self.readout.replica[fragment]
        for shard in self._shards.all:
            if dropped & set(shard.feed.fragments):
                logger.info("shard %d: updates not taken in time; re-snapshot", shard.index)
                self._resync(shard, now)

    def _resync(self, shard: ShardLink, now: float) -> None:
        if shard.feed is None:
            return
        self.readout.add(resyncs=1)
        self._shards.request_snapshots(shard, now, self.plan)

    # -- pushes -------------------------------------------------------------------------

    def push(self, now: float, request: PushRequest) -> list[Effect]:
        """Keep a delta in the ledger and send it to its shard (if that shard is up).

        Args:
            now: when it was pushed (its ack latency counts from here).
            request: the delta, checked by `Client.push`; the core is joined.

        Returns:
            Effects to perform (none when that round of the fragment is still
            pending: the push is ignored, with a warning).

        Raises:
            ClientError: not joined (closed, or the join failed).
        """
        if not self.joined:
            raise ClientError(f"push: the client is {self.state}, not joined; create a new Client")
        key = (request.fragment, request.round)
        self.readout.add(pushes=1)
        if key in self.ledger:
            logger.warning(
                "push of fragment %d round %d ignored: that round is still pending", *key
            )
            return []
        shard = self._shards.all[self.plan.fragments[request.fragment].shard]
        header = {
            "kind": "push",
            "island": self.cfg.island,
            "round": request.round,
            "fragment": request.fragment,
            "base_version": request.base_version,
            "tokens": request.tokens,
            "steps": request.steps,
            "plan_hash": self.plan.hash,
            # every round below it that we sent was acked: the shard forgets those, never a later one
            "floor": min(request.round, self.ledger.floor(request.round)),
            **self._reported_fields(),
            **({} if self.inner_steps is None else {"inner_steps": self.inner_steps}),
        }
        frames = protocol.pack(header, request.frames)
        self.ledger.add(key, shard.index, frames, protocol.message_bytes(frames), now, request)
        if shard.up:
            self._send_push(key)
        return self._shards.flush()

    def on_sent(self, send: Send, went_out: bool, now: float) -> None:
        """The I/O loop performed `send`: count it, and tell the ledger about a push.

        Args:
            send: the effect performed.
            went_out: False when the socket's queue was full (or the link closed).
            now: when it was tried.
        """
        if went_out:
            self.readout.add(bytes_sent=protocol.message_bytes(send.frames))
        if send.key is None or send.key not in self.ledger:
            return
        if went_out:
            self.readout.add(resent=int(self.ledger.sent(send.key, now, send.link)))
        else:
            self.ledger.blocked(send.key, now)  # queue full: try again after the back-off

    def _reported_fields(self) -> dict[str, float]:
        """The optional fields of a push or heartbeat: `t_step` and the training report."""
        step = {} if self.step_time_s is None else {"t_step": self.step_time_s}
        return {**step, **self.training}

    def _send_push(self, key: Key) -> None:
        entry = self.ledger.get(key)
        self._shards.send_frames(self._shards.all[entry.shard], entry.frames, key)

    # -- timers ---------------------------------------------------------------------------

    def on_tick(self, now: float) -> list[Effect]:
        """Time passed: join timeouts and re-sends, heartbeats, reconnects, re-sends, close.

        Args:
            now: current time (call it at least every heartbeat_interval_s / 4).

        Returns:
            Effects to perform.
        """
        if self._join is not None:
            self._join.on_tick(now)
            self._after_join_step()
        elif self.joined:
            self._timers(now)
        if self._close_at is not None and self.state != "closed":
            self._maybe_finish_close(now)
        return self._shards.flush()

    def _timers(self, now: float) -> None:
        cfg = self.cfg
        for shard in self._shards.all:
            if is_silent(now, shard.heard, cfg.heartbeat_interval_s, cfg.liveness):
                if now >= shard.next_reconnect:
                    self._reconnect(shard, now)
            elif now >= shard.next_heartbeat:
                self._shards.send(shard, {"kind": "heartbeat", **self._reported_fields()})
                shard.next_heartbeat = now + cfg.heartbeat_interval_s
            feed = shard.feed
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
        up = {shard.index for shard in self._shards.all if shard.up}
        for key in self.ledger.due(now, up):
            self._send_push(key)

    def _reconnect(self, shard: ShardLink, now: float) -> None:
        """Paranoid Pirate: a silent shard gets a fresh DEALER and a new hello."""
        if shard.up:
            logger.warning(
                "shard %d silent for %.1fs: reconnecting", shard.index, now - shard.heard
            )
        shard.up = False
        self._shards.forget_requests(shard.index)
        self._shards.open(shard, "dealer")
        self._shards.request(shard, "hello")
        shard.next_reconnect = now + next_backoff(
            shard.attempt, self.cfg.heartbeat_interval_s, self.cfg.reconnect_cap_s
        )
        shard.attempt += 1
        self.readout.add(reconnects=1)

    # -- close ----------------------------------------------------------------------------

    def begin_close(self, now: float, flush_timeout_s: float) -> list[Effect]:
        """Close: wait up to `flush_timeout_s` for acks (while a shard holding one is up), bye.

        Args:
            now: current time.
            flush_timeout_s: the longest wait for outstanding acks.

        Returns:
            Effects to perform; `closed` says when it finished (at once when
            nothing is pending).
        """
        if self._join is not None:
            self._join.fail(ClientError("join: the client was closed"))
            self._after_join_step()
        self._close_at = now + max(0.0, flush_timeout_s)
        self._maybe_finish_close(now)
        return self._shards.flush()

    def _maybe_finish_close(self, now: float) -> None:
        up = {shard.index for shard in self._shards.all if shard.up}
        if self.ledger and now < self._close_at and self.ledger.shards() & up:
            return  # a shard that is up holds deltas: wait (bounded) for their acks
        if self.ledger:
            logger.warning("closing with %d deltas unacked", len(self.ledger))
        for shard in self._shards.all:
            if shard.up and shard.dealer is not None:
                self._shards.send(shard, {"kind": "bye"})
        self._shards.close_all()
        self.dropped = self.ledger.drop_all()
        self.state = "closed"
