"""What the shard's core takes and returns: a request as received, and the effects of a batch.

`paramserver.server.core.ShardCore` returns `Effects` (the events to log
first, the `Reply`s to send whatever happens, the `DurableReply`s whose answer
depends on the log, the `Publish`es); the I/O loop
(`paramserver.server.shard.run_batch`) performs them and tells the core of a
`StorageFailure`. A `DueStep` is a step the merge policy says is due. A
`PushCheck` is a push whose payload the loop checks off the core (its one
piece of work: `outcomes.check_payload`, pure) and hands back. Plain data,
no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from paramserver.server.admission import outcomes
from paramserver.server.admission.outcomes import CheckedPayload, Outcome, check_payload
from paramserver.server.fragment import AcceptEvent, Event, StepEvent
from paramserver.server.state import ShardState


@dataclass(frozen=True)
class Request:
    """One request off the ROUTER: the connection, the message's frames, its CURVE User-Id.

    `envelope` holds the frames before the header that a reply must repeat: the
    empty delimiter frame of a REQ socket (the core strips it from `frames`).
    `admitted`: already counted and charged to its bucket (a request the core
    held back while a step changes the arrays it reads, handled again after).
    """

    conn: bytes
    frames: list[Any]
    user_id: str | None = None
    envelope: tuple[bytes, ...] = ()
    admitted: bool = False


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
    event: Event | None = None  # the event whose record the reply vouches for (None: none)


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
    """What the I/O loop does for a batch: log `records` (fsynced), send the replies and publishes.

    What vouches for a record waits for its fsync (`paramserver.server.group_commit`);
    the rest is sent in the turn that answered it.
    """

    records: list[Event] = field(default_factory=list)
    replies: list[Reply | DurableReply] = field(default_factory=list)
    publishes: list[Publish] = field(default_factory=list)
    # pushes whose payload the loop checks off the core, then hands back (`ShardCore.finish_push`)
    checks: list[PushCheck] = field(default_factory=list)

    def extend(self, other: Effects) -> None:
        """Add another request's effects after these (in order).

        Args:
            other: the effects to add.
        """
        self.records += other.records
        self.replies += other.replies
        self.publishes += other.publishes
        self.checks += other.checks


@dataclass(frozen=True)
class DueStep:
    """An outer step the merge policy says is due: its fragment, and whether deferring it risks refusals."""

    fragment: int
    urgent: bool


@dataclass(frozen=True)
class StorageFailure:
    """A batch whose records did not all become durable: what failed, the state rebuilt from disk.

    `lost` holds the events whose records are not on disk (the rest of the
    batch is); None: none of the batch is (a failed sync).
    """

    error: str
    rebuilt: ShardState
    lost: tuple[Event, ...] | None = None

    def lost_event(self, event: Event | None, request: dict[str, Any] | None = None) -> bool:
        """Whether a reply vouching for `event` must be refused (its record is not on disk).

        Args:
            event: the event the reply vouches for (None: none of its own).
            request: the request's header: a duplicate of a push whose
                record was lost in the same batch is refused too.

        Returns:
            True when the reply must say `storage_error`.
        """
        if self.lost is None:
            return True
        if event is not None:
            return any(event is e for e in self.lost)
        if request is None or request.get("kind") != "push":
            return False
        key = (request.get("island"), request.get("round"), request.get("fragment"))
        return any(
            isinstance(e, AcceptEvent)
            and (e.contribution.island, e.contribution.round, e.contribution.fragment) == key
            for e in self.lost
        )

    def lost_step(self, fragment: Any) -> bool:
        """Whether an update of `fragment` must not be published (its step is not on disk)."""
        if self.lost is None:
            return True
        return any(isinstance(e, StepEvent) and e.fragment == fragment for e in self.lost)


@dataclass
class PushCheck:
    """A push whose payload the loop has checked off the core (`check_payload`).

    Attributes:
        request: the request as received (admitted: its rate was charged).
        header: its decoded header.
        payload: its codec frames.
        size: the fragment's size.
        result: the checked payload, once `run` ran.
    """

    request: Request
    header: dict[str, Any]
    payload: Sequence[Any]
    size: int
    result: CheckedPayload | None = field(default=None)

    def run(self) -> PushCheck:
        """Check the payload (any error becomes an internal_error refusal).

        Returns:
            self, with `result` set.
        """
        try:
            self.result = check_payload(self.payload, self.size)
        except Exception as exc:  # a bug must not take the shard down; it is counted
            refusal = outcomes.refused("internal_error", f"{type(exc).__name__}: {exc}")
            self.result = CheckedPayload(None, refusal=refusal)
        return self
