"""What the shard core asks its I/O loop to do: the `Effects` of a batch, and the messages in them.

Plain data between `paramserver.server.core` (which builds them) and
`paramserver.server.shard` (which appends, fsyncs, then has the core settle
them): a `Request` as received, the events to log first, the `Reply`s to send
whatever happens, the `DurableReply`s whose answer depends on the log, and the
`Publish`es.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paramserver.server.events import Event
from paramserver.server.outcomes import Outcome


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
    """A reply to send to `conn` whatever the batch's storage outcome (a refusal, a welcome, ...).

    `envelope` (the request's, e.g. a REQ socket's empty delimiter) goes before the header.
    """

    conn: bytes
    header: dict[str, Any]
    payload: list[Any]
    envelope: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class DurableReply:
    """A reply that tells the island something is on disk (an accepted / duplicate ack, init_*).

    It is rendered once, after the batch's storage outcome is known
    (`paramserver.server.core.ShardCore.settle`): stored, it says `kind` with
    `fields` (for an ack: the `outcome` and the fragment's `version` when
    answered); not stored, it is a `storage_error` refusal instead.
    """

    conn: bytes
    request: dict[str, Any]
    kind: str  # "ack", "init_ok", "init_begun" or "init_piece_ok"
    fields: dict[str, Any] = field(default_factory=dict)
    outcome: Outcome | None = None  # an ack's outcome (accepted or duplicate)
    version: int = 0  # an ack's fragment version when answered
    envelope: tuple[bytes, ...] = ()


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
    replies: list[Reply | DurableReply] = field(default_factory=list)
    publishes: list[Publish] = field(default_factory=list)

    def extend(self, other: Effects) -> None:
        """Add another request's effects after these (in order).

        Args:
            other: the effects to add.
        """
        self.records += other.records
        self.replies += other.replies
        self.publishes += other.publishes
