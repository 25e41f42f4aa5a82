"""One join in progress, as the client's core drives it: the handshake's requests, then snapshots.

This module owns, with no I/O and no clock, the join of `ClientCore.start_join`
(`paramserver.client.core`): `Join` sends what the handshake
(`paramserver.client.handshake`) asks on the shards' links (`Shards`),
re-sends an unanswered hello every `ack_timeout_s`, an unanswered
`init_begin` or `init_piece` after `ack_timeout_s`, doubling per re-send up
to `ack_timeout_cap_s` (all three are idempotent: a lost piece or reply is
sent again), and one refused `throttled` (the shard's request limit) after
its `retry_after_s`,
routes each reply back to the handshake, opens a DEALER to every shard once
the first welcome named them, and, once the cluster is initialised,
subscribes to every shard and snapshots its fragments (Clone pattern:
subscribe first). `outcome` is the `JoinResult`, or the `ClientError` that
ended the join (at `join_timeout_s` at the latest).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from paramserver.client.handshake import FIRST, Handshake
from paramserver.client.init_upload import Ask
from paramserver.client.replica import Readout, ReplicaFragment, ShardFeed
from paramserver.client.shards import ShardLink, Shards
from paramserver.client.types import ClientConfig, ClientError, JoinResult
from paramserver.client.welcome import Cluster

logger = logging.getLogger(__name__)

# The join's requests re-sent every ack_timeout_s until answered (a re-send changes nothing).
_IDEMPOTENT = ("hello", "init_begin", "init_piece")


@dataclass
class _Call:
    """A join request in flight: re-sent (hello, init_begin, init_piece) until answered."""

    shard: ShardLink
    name: int  # the handshake's name of the shard (`FIRST` before the first welcome)
    kind: str
    frames: list[Any]
    resend_at: float
    timeout: float  # the wait before the next re-send (doubles per re-send of an init piece)


class Join:
    """The join of one client (see the module docstring)."""

    def __init__(
        self,
        cfg: ClientConfig,
        flat: Mapping[str, np.ndarray],
        now: float,
        net: Shards,
        readout: Readout,
    ) -> None:
        """Check the parameters, open a DEALER to the configured shard and say hello.

        Args:
            cfg: client settings.
            flat: path -> this island's parameters (see `Client.join`).
            now: when the join starts.
            net: the core's shards and links (emptied and refilled here).
            readout: the core's bookkeeping (its replica is filled by the snapshots).

        Raises:
            ClientError: the parameters cannot be planned (nothing was sent).
        """
        self.cfg = cfg
        self._handshake = Handshake(cfg, flat, now)
        self._shards = net
        self._readout = readout
        self._calls: dict[int, _Call] = {}
        self.cluster: Cluster | None = None  # once the first welcome was read
        self.syncing = False
        self.outcome: JoinResult | ClientError | None = None
        first = ShardLink(FIRST, cfg.connect, "")
        net.all = [first]
        net.open(first, "dealer")
        self._ask(self._handshake.start(now), now)

    def owns(self, rid: Any) -> bool:
        """Whether a reply with id `rid` answers one of the join's requests."""
        return rid in self._calls

    def on_reply(self, now: float, rid: int, header: dict) -> None:
        """Take the reply to one of the join's requests (`owns(rid)`).

        An init request refused `storage_error` (the shard's disk failed, nothing
        was kept) stays in flight and is sent again after `ack_timeout_s`; any
        request refused `throttled` (over the shard's request limit), after the
        reply's `retry_after_s`.
        """
        call = self._calls.pop(rid)
        if header.get("reason") == "throttled" and call.kind in _IDEMPOTENT:
            call.resend_at = now + header.get("retry_after_s", self.cfg.ack_timeout_s)
            self._calls[rid] = call
            return
        if call.kind.startswith("init_") and header.get("reason") == "storage_error":
            logger.warning(
                "shard %s: %s not stored (%s); again", call.name, call.kind, header["detail"]
            )
            call.resend_at = now + self.cfg.ack_timeout_s
            self._calls[rid] = call
            return
        self._step(now, lambda: self._handshake.on_reply(now, call.name, header))

    def on_tick(self, now: float) -> None:
        """Time passed: re-send unanswered requests, time out, re-snapshot a stuck shard."""
        if self.syncing:
            self._sync_tick(now)
            return
        for rid, call in self._calls.items():
            if call.kind in _IDEMPOTENT and now > call.resend_at:
                self._shards.send_frames(call.shard, call.frames, kind=call.kind, rid=rid)
                if call.kind != "hello":  # a large piece on a thin link: back off, do not flood
                    call.timeout = min(2 * call.timeout, self.cfg.ack_timeout_cap_s)
                call.resend_at = now + call.timeout
        self._step(now, lambda: self._handshake.on_tick(now))

    def fail(self, exc: ClientError) -> None:
        """End the join with `exc` (the core closes the links)."""
        self.outcome = exc

    def _step(self, now: float, advance: Any) -> None:
        try:
            asks = advance()
            if self._handshake.cluster is not None and self.cluster is None:
                self._adopt(self._handshake.cluster)
            self._ask(asks, now)
            if self._handshake.done:
                self._start_sync(now)
        except ClientError as exc:
            self.fail(exc)
        except Exception as exc:  # a bug must not leave the join hanging
            logger.exception("join failed")
            self.fail(ClientError(f"join failed: {exc}"))

    def _ask(self, asks: list[Ask], now: float) -> None:
        net = self._shards
        for ask in asks:
            shard = net.all[0] if ask.shard == FIRST else net.all[ask.shard]
            rid = net.new_id()
            frames = net.send(shard, {"kind": ask.kind, "id": rid, **ask.fields}, ask.payload)
            timeout = self.cfg.ack_timeout_s
            self._calls[rid] = _Call(shard, ask.shard, ask.kind, frames, now + timeout, timeout)

    def _adopt(self, cluster: Cluster) -> None:
        """The first welcome was read: a DEALER to every shard (the first one keeps its own)."""
        self.cluster = cluster
        first, shards = self._shards.all[0], []
        for i, (router, pub) in enumerate(cluster.endpoints):
            if i == cluster.shard:
                first.index, first.pub = i, pub
                shards.append(first)
            else:
                shard = ShardLink(i, router, pub)
                self._shards.open(shard, "dealer")
                shards.append(shard)
        self._shards.all = shards
        if cluster.max_message_bytes is not None:  # snapshot pieces fit the shards' limit
            self._shards.max_message_bytes = cluster.max_message_bytes

    def _start_sync(self, now: float) -> None:
        """The cluster is initialised: subscribe to every shard, then snapshot it."""
        self._calls.clear()
        self.syncing = True
        plan = self.cluster.plan
        for shard in self._shards.all:
            self._shards.open(shard, "sub")  # Clone pattern: subscribe before the snapshot
            fragments = tuple(f.index for f in plan.fragments_of(shard.index))
            shard.feed = ShardFeed(shard.index, fragments, self._readout.replica, self.cfg.keep)
            shard.heard = shard.sub_heard = now
            self._shards.request_snapshots(shard, now, self.cluster.plan)
        self.check_synced(now)

    def _sync_tick(self, now: float) -> None:
        shards = self._shards.all
        if now > self._handshake.deadline:
            missing = [s.index for s in shards if s.feed.syncing]
            self.fail(
                ClientError(
                    f"join: snapshots of shard(s) {missing} not received within "
                    f"{self.cfg.join_timeout_s:g}s"
                )
            )
            return
        for shard in shards:  # e.g. a shard the winner of an init race has not reached
            if shard.feed.syncing and now - shard.feed.sync_started > self.cfg.snapshot_timeout_s:
                self._shards.request_snapshots(shard, now, self.cluster.plan)
        self.check_synced(now)

    def check_synced(self, now: float) -> None:
        """Once every snapshot arrived: the values the feeds hold are the outcome.

        With `ClientConfig.keep` "values" they are the replica's (copied into the
        outcome's leaves); with "increments" the feeds forget them once taken (the
        client keeps no copy); with "versions" the outcome's params are {}.
        """
        if not self.syncing or self.outcome is not None:
            return
        if any(s.feed.syncing for s in self._shards.all):
            return
        plan = self.cluster.plan
        taken: dict[int, ReplicaFragment] = {}
        for shard in self._shards.all:
            taken.update(shard.feed.take_values())
        params: dict[str, np.ndarray] = {}
        if self.cfg.keep != "versions":  # without values there are none to hand out
            params = {leaf.path: np.zeros(leaf.shape, np.float32) for leaf in plan.leaves}
            for index, state in taken.items():
                plan.scatter(index, state.values, params)
        versions = {index: state.version for index, state in sorted(taken.items())}
        for shard in self._shards.all:
            shard.heard = shard.sub_heard = shard.next_heartbeat = now
        logger.info("island %s joined: versions %s", self.cfg.island, versions)
        self.outcome = JoinResult(plan, params, versions, self.cluster.mode)
