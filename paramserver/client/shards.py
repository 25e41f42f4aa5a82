"""The shards as the client's core sees them: their state, their links, the requests in flight.

This module owns, with no I/O, the bookkeeping under the client's core
(`paramserver.client.core`): `ShardState` (endpoints, links, liveness and
update stream of one shard) and `Shards`, which numbers links and request
ids, keeps the tracked requests (id -> what was asked), builds the messages
(every request carries the island id, every hello the client's session) and
collects the effects (`paramserver.client.effects`) the core returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paramserver.client.effects import Close, Effect, Open, Role, Send
from paramserver.client.replica import ShardFeed
from paramserver.wire import protocol
from paramserver.wire.snapshot import snapshot_request


@dataclass
class ShardState:
    """What the core knows of one shard: its endpoints, links, liveness and update stream."""

    index: int
    router: str
    pub: str
    dealer: int | None = None  # link of its DEALER
    sub: int | None = None  # link of its SUB
    heard: float = 0.0  # last message on the DEALER
    sub_heard: float = 0.0  # last message on the SUB
    up: bool = True
    attempt: int = 0  # reconnects since the shard was last heard
    next_reconnect: float = 0.0
    next_heartbeat: float = 0.0
    feed: ShardFeed | None = None


class Shards:
    """Every shard of one client (`all`, by index), their links and the requests in flight."""

    def __init__(self, island: str, session: str) -> None:
        """Start with no shard and no link.

        Args:
            island: the island id every request carries.
            session: the token every hello carries.
        """
        self.island = island
        self.session = session
        self.all: list[ShardState] = []
        self.requests: dict[int, tuple[str, int, int]] = {}  # id -> (kind, shard, fragment)
        self._links: dict[int, tuple[Role, ShardState]] = {}
        self._next_link = 0
        self._next_id = 0
        self._out: list[Effect] = []

    @property
    def has_links(self) -> bool:
        """Whether any link is open."""
        return bool(self._links)

    def owner(self, link: int) -> tuple[Role, ShardState] | None:
        """(role, shard) of an open link, or None (closed or never opened)."""
        return self._links.get(link)

    def new_id(self) -> int:
        """A fresh request id."""
        self._next_id += 1
        return self._next_id

    def open(self, shard: ShardState, role: Role) -> None:
        """Give `shard` a fresh link of `role` (the old one, if any, is closed)."""
        old = shard.dealer if role == "dealer" else shard.sub
        if old is not None:
            self._links.pop(old, None)
            self._out.append(Close(old))
        self._next_link += 1
        link = self._next_link
        self._links[link] = (role, shard)
        self._out.append(Open(link, role, shard.router if role == "dealer" else shard.pub))
        if role == "dealer":
            shard.dealer = link
        else:
            shard.sub = link

    def close_all(self) -> None:
        """Close every link, forget every shard and request."""
        self._out.extend(Close(link) for link in self._links)
        self._links.clear()
        self.requests.clear()
        self.all = []

    def send(self, shard: ShardState, header: dict, payload: list[Any] = ()) -> list[Any]:
        """Send one message on a shard's DEALER (adds `island`, and `session` to a hello).

        Returns:
            The packed frames.
        """
        if header["kind"] == "hello":
            header = {**header, "session": self.session}
        frames = protocol.pack({"island": self.island, **header}, list(payload))
        self.send_frames(shard, frames)
        return frames

    def send_frames(self, shard: ShardState, frames: list[Any], key: Any = None) -> None:
        """Send packed frames on a shard's DEALER (`key`: the ledger's delta, for a push)."""
        self._out.append(Send(-1 if shard.dealer is None else shard.dealer, frames, key))

    def request(self, shard: ShardState, kind: str, about: int = -1, **fields: Any) -> None:
        """Send a tracked request (`about`: its fragment, if any); the reply is matched by id."""
        rid = self.new_id()
        self.requests[rid] = (kind, shard.index, about)
        self.send(shard, {"kind": kind, "id": rid, **fields})

    def request_snapshots(self, shard: ShardState, now: float) -> None:
        """Start (or restart) a snapshot of every fragment of `shard` (its feed must exist)."""
        for fragment in shard.feed.begin_sync(now):
            rid = self.new_id()
            self.requests[rid] = ("snapshot", shard.index, fragment)
            self.send(shard, snapshot_request(self.island, fragment, rid))

    def forget_requests(self, shard: int) -> None:
        """Drop the tracked requests to `shard` (its DEALER was replaced)."""
        for rid in [r for r, (_, s, _) in self.requests.items() if s == shard]:
            del self.requests[rid]

    def flush(self) -> list[Effect]:
        """The effects collected since the last flush."""
        out, self._out = self._out, []
        return out
