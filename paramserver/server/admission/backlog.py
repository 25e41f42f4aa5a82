"""Bytes of replies a peer has not read yet, per connection: the bound on what a slow reader holds.

ZeroMQ bounds a peer's queued replies in messages (its high-water mark,
1000), and a snapshot piece may be ~58 MB: a client that asks pieces and
never reads would hold gigabytes of the shard's memory. So the shard counts
bytes: a reply with a large payload (a snapshot piece, a status) is charged
to its connection when the core builds it (`charge`), and, once sent, stays
counted until ZeroMQ has written it to the socket (`track` with the send's
tracker: done when ZeroMQ let go of its frames). A connection holding
`limit` bytes or more is refused `throttled` for such a request
(`admits`), with a retry after `RETRY_AFTER_S`; a connection that holds
nothing is always served one reply, so a piece larger than the limit can
still be read. A peer that disconnects frees its queued replies, and its
entries with them.

Nothing here touches a socket: a tracker is anything with a `done` property
(pyzmq's `MessageTracker`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol

from paramserver.server.admission.outcomes import Outcome
from paramserver.wire.protocol import REJECTED

RETRY_AFTER_S = 0.5  # a backlogged peer's throttled reply: ask again after this long


class Tracker(Protocol):
    """What tells when a sent message's frames were released (pyzmq's MessageTracker)."""

    @property
    def done(self) -> bool: ...  # noqa: D102


class ReplyBacklog:
    """Per-connection bytes of replies built or sent and not yet written out."""

    def __init__(self, limit: int) -> None:
        """Start empty.

        Args:
            limit: bytes one connection may hold before its large requests are
                refused; 0 = no limit.
        """
        self.limit = limit
        self._sent: dict[bytes, list[tuple[int, Any]]] = {}
        self._charged: Counter[bytes] = Counter()

    def held(self, conn: bytes) -> int:
        """Bytes of `conn`'s replies built this turn or sent and not yet written out.

        Args:
            conn: the connection (ROUTER routing id).

        Returns:
            The bytes (entries whose tracker is done are dropped).
        """
        entries = self._sent.get(conn)
        if entries:
            entries[:] = [(n, t) for n, t in entries if not t.done]
            if not entries:
                del self._sent[conn]
        return sum(n for n, _ in entries or ()) + self._charged[conn]

    def admits(self, conn: bytes) -> bool:
        """Whether a large reply to `conn` may be built now.

        Args:
            conn: the connection.

        Returns:
            True when there is no limit, or `conn` holds less than the limit.
        """
        return self.limit <= 0 or self.held(conn) < self.limit

    def charge(self, conn: bytes, nbytes: int) -> None:
        """Count a reply built for `conn` (until the turn's sends are tracked).

        Args:
            conn: the connection.
            nbytes: its payload bytes.
        """
        self._charged[conn] += nbytes

    def track(self, conn: bytes, nbytes: int, tracker: Tracker) -> None:
        """Count a sent reply until its tracker is done.

        Args:
            conn: the connection.
            nbytes: its bytes.
            tracker: done once ZeroMQ released its frames.
        """
        if not tracker.done:
            self._sent.setdefault(conn, []).append((nbytes, tracker))

    def turn_done(self) -> None:
        """Forget this turn's charges (its replies were sent, and the large ones tracked).

        Also drops what was written out for every connection (gone peers included).
        """
        self._charged.clear()
        for conn in list(self._sent):
            self.held(conn)

    def refusal(self, conn: bytes) -> Outcome:
        """The `throttled` refusal of a large request from a connection at its limit.

        Args:
            conn: the connection.

        Returns:
            A rejected `throttled` outcome with retry_after_s, not yet counted.
        """
        return Outcome(
            REJECTED,
            "throttled",
            f"{self.held(conn)} bytes of replies to this connection are not read yet "
            f"(max_unread_reply_bytes={self.limit}): read them, and ask again after "
            f"{RETRY_AFTER_S:g} s",
            retry_after_s=RETRY_AFTER_S,
        )

    def total(self) -> int:
        """Bytes held over every connection (for status)."""
        return sum(self.held(conn) for conn in list(self._sent)) + sum(self._charged.values())
