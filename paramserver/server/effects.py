"""What the shard core asks its I/O loop to do: the `Effects` of a batch, and the messages in them.

Plain data between `paramserver.server.core` (which builds them) and
`paramserver.server.shard` (which appends, fsyncs, then sends them): a
`Request` as received, the `Reply`s and `Publish`es to send and the events to
log first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paramserver.server.events import Event
from paramserver.wire.protocol import REJECTED


@dataclass(frozen=True)
class Request:
    """One request off the ROUTER: the connection, the message's frames, its CURVE User-Id.

    `envelope` holds the frames before the header that a reply must repeat: the
    empty delimiter frame of a REQ socket (the core strips it from `frames`).
    """

    conn: bytes
    frames: list[Any]
    user_id: str | None = None
    envelope: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class Reply:
    """A reply to send to `conn`; `request` is kept to render it again after a storage fault.

    `envelope` (the request's, e.g. a REQ socket's empty delimiter) goes before the header.
    """

    conn: bytes
    header: dict[str, Any]
    payload: list[Any]
    request: dict[str, Any] | None
    envelope: tuple[bytes, ...] = ()

    @property
    def promises_durability(self) -> bool:
        """Whether it tells the island something is on disk (accepted / duplicate ack, init_*)."""
        kind = self.header["kind"]
        if kind in ("init_ok", "init_begun", "init_piece_ok"):
            return True
        return kind == "ack" and self.header["outcome"] != REJECTED


@dataclass(frozen=True)
class Publish:
    """A message for the PUB: an `update` (numbered at release, needs durability) or a heartbeat."""

    header: dict[str, Any]
    payload: list[Any] = field(default_factory=list)

    @property
    def is_update(self) -> bool:
        """Whether it publishes a step (dropped when the step did not become durable)."""
        return self.header["kind"] == "update"


@dataclass
class Effects:
    """What the I/O loop does for a batch: append `records`, fsync, then send the rest."""

    records: list[Event] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)
    publishes: list[Publish] = field(default_factory=list)

    def extend(self, other: Effects) -> None:
        """Add another request's effects after these (in order).

        Args:
            other: the effects to add.
        """
        self.records += other.records
        self.replies += other.replies
        self.publishes += other.publishes
