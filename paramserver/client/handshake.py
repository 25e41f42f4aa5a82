"""An island's join handshake as states: hello, the cluster's map, plan check, init.

This module owns the rules of the first part of `Client.join`, with no I/O and
no clock: `Handshake` takes the time and the shards' replies as arguments and
returns the requests to send (`Ask`), so the join (`paramserver.client.joining`)
drives it from the core's message and tick handlers (no nested event loop):
it sends each `Ask`, re-sends an unanswered hello, and routes the reply back
by shard; once `done`, it subscribes to every shard and snapshots its
fragments (the join's last phase, the same re-sync the core uses later).

The states:
- "first": hello to the configured shard; its welcome gives the cluster map
  and this island's plan (`welcome.read_welcome`); the core then opens a
  DEALER to every other shard (`cluster` is set);
- "hellos": hello to every other shard; each welcome says whether that shard
  is initialised, and with which plan;
- "init": initialise what is not, in index order (below);
- "done": the cluster is known and initialised.

A hello answered `island_in_use` (a restarted island's old connection is
still live) is asked again every `RETRY_S` for up to `in_use_wait_s`, then
fails: the old connection falls silent within two heartbeats, a second
running island with the same id stays refused.

Initialisation: the island that initialises shard 0 (the first joiner; a
lost race for it is fine, the winner's values count) initialises every other
shard with its own values, in index order. A shard still uninitialised
`init_grace_s` after another island took shard 0 (that island died half-way)
is initialised by the joining island with its own values, so that a
half-initialised cluster can always be joined. While it waits, the island
asks that shard (hello) every `RETRY_S`. Each shard's init goes in pieces
(`paramserver.client.init_upload`): `init_begin`, then pieces that fit the
shard's `max_message_bytes`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np

from paramserver.client.init_upload import DONE, LOST, Ask, Upload
from paramserver.client.shards import pieces_in_flight
from paramserver.client.types import ClientConfig, ClientError, JoinTimeout
from paramserver.client.welcome import (
    Cluster,
    leaves_of,
    read_welcome,
    shard_initialized,
)
from paramserver.wire import protocol
from paramserver.wire.plan import Plan

logger = logging.getLogger(__name__)

FIRST = -1
"""The shard index of the configured shard before its welcome says which it is."""

RETRY_S = 0.2  # a hello refused for now (id in use, shard awaiting its init) is asked again


class Handshake:
    """The join's states up to a known, initialised cluster (see the module docstring)."""

    def __init__(self, cfg: ClientConfig, flat: Mapping[str, np.ndarray], now: float) -> None:
        """Check the parameters (before anything is sent) and start in state "first".

        Args:
            cfg: client settings (island, timeouts).
            flat: path -> this island's parameters (initial values of an empty cluster).
            now: when the join starts; it must finish by now + join_timeout_s.

        Raises:
            ClientError: the parameters cannot be planned (nothing was sent).
        """
        self.cfg = cfg
        self._flat = flat
        self._leaves = leaves_of(flat)
        self.deadline = now + cfg.join_timeout_s
        self.state = "first"
        self.cluster: Cluster | None = None
        self._initialized: dict[int, bool] = {}
        self._waiting: dict[int, str] = {}  # shard -> kind of its unanswered request
        self._in_use_until: dict[int, float] = {}  # shard -> give up on island_in_use then
        self._retry_at: dict[int, float] = {}  # shard -> hello again then
        self._order: list[int] = []  # init: the shards still to initialise, in index order
        self._ours = True  # init: shard 0 was ours, so the others are
        self._grace_until = 0.0  # init: another island's init of the current shard is awaited
        self._lost = False  # init: the current shard's init lost a race (checking its plan)
        self._upload: Upload | None = None  # init: the current shard's pieces

    @property
    def done(self) -> bool:
        """True once every shard is known to be initialised with this island's plan."""
        return self.state == "done"

    @property
    def plan(self) -> Plan | None:
        """This island's plan, once the first welcome was read."""
        return None if self.cluster is None else self.cluster.plan

    def start(self, now: float) -> list[Ask]:
        """The first request: hello to the configured shard.

        Args:
            now: current time.

        Returns:
            The requests to send.
        """
        logger.info(
            "island %s: waiting for the server at %s (join timeout %gs)",
            self.cfg.island,
            self.cfg.connect,
            self.cfg.join_timeout_s,
        )
        return [self._hello(FIRST, now, fresh=True)]

    # -- replies --------------------------------------------------------------------------

    def on_reply(self, now: float, shard: int, header: dict) -> list[Ask]:
        """Take the reply to the join's request to `shard`.

        Args:
            now: when it arrived.
            shard: the shard it came from (`FIRST` before the first welcome).
            header: the reply header.

        Returns:
            The requests to send next.

        Raises:
            ClientError: a refusal, a plan mismatch, or an id in use for too long.
        """
        kind = self._waiting.pop(shard, None)
        if kind == "init":
            return self._on_init_reply(now, shard, header)
        if kind != "hello":
            return []
        if header["kind"] == "rejected" and header.get("reason") == "island_in_use":
            if now >= self._in_use_until[shard]:
                router = self._router(shard)
                raise ClientError(
                    f"join: island id {self.cfg.island!r} is in use by another running island "
                    f"(shard at {router}: {header.get('detail')}); give each island its own id "
                    "or stop the other one"
                )
            self._pause(shard, now)
            return []
        self._in_use_until.pop(shard, None)
        welcome = _expect(header, "welcome", "hello")
        if self.state == "first":
            return self._on_first_welcome(now, welcome)
        if self.state == "hellos":
            self._initialized[shard] = shard_initialized(welcome, self.plan, shard)
            return self._after_hellos(now) if not self._waiting and not self._retry_at else []
        return self._on_init_welcome(now, shard, welcome)

    def on_tick(self, now: float) -> list[Ask]:
        """Time passed: hello again where a pause ended; fail past the deadline.

        Args:
            now: current time.

        Returns:
            The requests to send.

        Raises:
            ClientError: the join did not finish by its deadline.
        """
        if now > self.deadline and not self.done:
            shard, kind = next(iter(self._waiting.items()), (FIRST, "hello"))
            router = self._router(shard)
            raise JoinTimeout(
                f"join: no {kind} reply from shard at {router} within "
                f"{self.cfg.join_timeout_s:g}s; is the server running?",
                endpoint=router,
                request=kind,
                timeout_s=self.cfg.join_timeout_s,
            )
        asks = []
        for shard, at in list(self._retry_at.items()):
            if now >= at:
                del self._retry_at[shard]
                asks.append(self._hello(shard, now, fresh=False))
        return asks

    # -- states ---------------------------------------------------------------------------

    def _on_first_welcome(self, now: float, welcome: dict) -> list[Ask]:
        self.cluster = cluster = read_welcome(welcome, self.cfg, self._leaves)
        self._initialized = {cluster.shard: cluster.initialized}
        self.state = "hellos"
        others = [i for i in range(cluster.plan.num_shards) if i != cluster.shard]
        if not others:
            return self._after_hellos(now)
        return [self._hello(i, now, fresh=True) for i in others]

    def _after_hellos(self, now: float) -> list[Ask]:
        plan = self.plan
        logger.info(
            "island %s: cluster of %d shards, %d fragments, initialized %s, plan %s",
            self.cfg.island,
            plan.num_shards,
            plan.num_fragments,
            [i for i in sorted(self._initialized) if self._initialized[i]],
            plan.hash,
        )
        self._order = [i for i in sorted(self._initialized) if not self._initialized[i]]
        self._ours = not self._initialized[0]  # shard 0 is ours: then so are the others
        self._grace_until = now + self.cfg.init_grace_s
        self.state = "init"
        return self._next_init(now)

    def _next_init(self, now: float) -> list[Ask]:
        """Initialise (or await) the first shard of `_order`; "done" when none is left."""
        self._lost = False
        if not self._order:
            self.state = "done"
            return []
        shard = self._order[0]
        if self._ours:
            return self._init(shard)
        return [self._hello(shard, now, fresh=True)]  # has the other island initialised it?

    def _on_init_welcome(self, now: float, shard: int, welcome: dict) -> list[Ask]:
        """A welcome during init: after a lost race, or while awaiting another island's init."""
        initialized = shard_initialized(welcome, self.plan, shard)
        if self._lost:  # checked the winner's plan: the next shard
            if shard == 0:  # lost the race for shard 0: the winner initialises the rest
                self._ours, self._grace_until = False, now + self.cfg.init_grace_s
            self._order.pop(0)
            return self._next_init(now)
        if initialized:
            self._order.pop(0)
            return self._next_init(now)
        if now < min(self._grace_until, self.deadline):
            self._pause(shard, now)
            return []
        logger.warning(
            "shard %d is still not initialised %.1fs after another island initialised "
            "shard 0 (it stopped half-way?): island %s initialises it with its own values",
            shard,
            self.cfg.init_grace_s,
            self.cfg.island,
        )
        return self._init(shard)

    def _on_init_reply(self, now: float, shard: int, header: dict) -> list[Ask]:
        if self._upload is None or shard != self._upload.shard:
            return []  # a late reply of an upload that ended
        what, asks = self._upload.on_reply(header)
        if what == DONE:
            logger.info(
                "island %s initialized shard %d in %d piece(s)",
                self.cfg.island,
                shard,
                self._upload.total,
            )
            self._upload = None
            self._order.pop(0)
            return self._next_init(now)
        if what == LOST:
            logger.info("shard %d already initialized by another island", shard)
            self._upload = None
            self._lost = True
            return [self._hello(shard, now, fresh=True)]
        self._waiting[shard] = "init"  # more replies to come
        return asks

    # -- requests -------------------------------------------------------------------------

    def _hello(self, shard: int, now: float, fresh: bool) -> Ask:
        """Ask `shard` hello; `fresh`: a new hello (the island_in_use wait starts again)."""
        if fresh or shard not in self._in_use_until:
            self._in_use_until[shard] = min(self.deadline, now + self.cfg.in_use_wait_s)
        self._waiting[shard] = "hello"
        return Ask(shard, "hello")

    def _init(self, shard: int) -> list[Ask]:
        """Start the init of `shard` in pieces sized to its message limit (init_upload)."""
        limit = self.cluster.max_message_bytes or protocol.DEFAULT_MAX_MESSAGE_BYTES
        window, piece_limit = pieces_in_flight(self.cfg.bulk_flows, limit)  # one per bulk link
        self._upload = Upload(self.plan, self._flat, shard, piece_limit, window)
        self._waiting[shard] = "init"
        return self._upload.begin()

    def _pause(self, shard: int, now: float) -> None:
        self._retry_at[shard] = now + RETRY_S

    def _router(self, shard: int) -> str:
        if shard == FIRST or self.cluster is None:
            return self.cfg.connect
        return self.cluster.endpoints[shard][0]


def _expect(header: dict, kind: str, what: str) -> dict:
    """The reply `header` when it is of `kind`; otherwise a ClientError naming the refusal."""
    if header["kind"] != kind:
        raise ClientError(f"join: {what} refused: {header.get('reason')}: {header.get('detail')}")
    return header
