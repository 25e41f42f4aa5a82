"""Which connection may act as an island on a shard: the rule behind `island_in_use`.

This module owns the binding of island ids to connections (a ROUTER peer
identity: one per DEALER socket) and the pure rule of when another
connection may take an id over. The shard (`paramserver.server.shard`) asks it for
every request that names an island.

The rule, with `quiet_s = min(TAKEOVER_INTERVALS, liveness) * heartbeat_interval_s`:

- a `hello` binds the id to its connection when the id is free, already bound
  to this connection, bound under the same `session` (the hello's optional
  token: the same client process reconnecting on a new socket), or bound to
  a connection silent for more than `quiet_s`; otherwise it is refused
  `island_in_use`;
- a request from the bound connection (or for an unbound id) is served as
  usual and refreshes the binding;
- a push, heartbeat or bye from another connection is refused
  `island_in_use` while the bound one has been heard within `quiet_s`, and
  answered `unknown_island` ("say hello") once it has not, so that hello
  takes the id over.

Why it is sound: a live island heartbeats every interval, so its connection
is never silent for two; a second process with the same id is refused at its
join. An island that reconnects closed its old socket first, so that
connection falls silent and the new one gets the id at most `quiet_s` (plus
one heartbeat) later, at once when its hello carries the same `session`. A
dead island (liveness expired) is silent far longer than `quiet_s`.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

TAKEOVER_INTERVALS = 2  # heartbeat intervals of silence after which a binding may be taken

OWN = "own"  # the request comes from the bound connection, or the id is not bound
IN_USE = "in_use"  # the id is bound to another connection that is not silent
SAY_HELLO = "say_hello"  # bound to another connection that fell silent: hello takes it over


@dataclass
class Binding:
    """The connection an island id is bound to, and when it was last heard."""

    conn: bytes
    session: str | None
    heard: float


def may_take_over(
    now: float, bound: Binding | None, conn: bytes, session: str | None, quiet_s: float
) -> bool:
    """Whether a hello from `conn` may bind an island id currently bound as `bound`.

    Args:
        now: current time, seconds (the clock of `bound.heard`).
        bound: the id's binding, or None when it is free.
        conn: the connection saying hello.
        session: the hello's session token, or None.
        quiet_s: silence after which a binding may be taken over.

    Returns:
        True when the id is free, bound to `conn`, bound under the same non-empty
        session, or its connection has been silent for more than `quiet_s`.
    """
    if bound is None or bound.conn == conn:
        return True
    if session is not None and session == bound.session:
        return True
    return now - bound.heard > quiet_s


class Bindings:
    """Island id -> Binding on one shard (not persisted: islands say hello after a restart)."""

    def __init__(self, heartbeat_interval_s: float, liveness: int) -> None:
        """Set the takeover silence from the shard's heartbeat settings.

        Args:
            heartbeat_interval_s: the shard's heartbeat interval, > 0.
            liveness: intervals of silence after which an island is dead, >= 1.
        """
        self.quiet_s = min(TAKEOVER_INTERVALS, liveness) * heartbeat_interval_s
        self._bound: dict[str, Binding] = {}

    def may_bind(self, island: str, conn: bytes, session: str | None, now: float) -> bool:
        """Whether a hello from `conn` may take `island` (see `may_take_over`).

        Args:
            island: island id.
            conn: the ROUTER identity of the connection.
            session: the hello's session token, or None.
            now: current time, seconds.

        Returns:
            Whether to bind; refuse with island_in_use otherwise.
        """
        return may_take_over(now, self._bound.get(island), conn, session, self.quiet_s)

    def bind(self, island: str, held: Binding) -> None:
        """Bind `island` (after its hello was welcomed).

        Args:
            island: island id.
            held: its connection, session and the time of the hello.
        """
        self._bound[island] = held

    def verdict(self, island: str, conn: bytes, now: float) -> str:
        """How to treat a request (other than hello) for `island` from `conn`; refreshes its own.

        Args:
            island: island id.
            conn: the ROUTER identity of the connection.
            now: current time, seconds.

        Returns:
            OWN (serve it), IN_USE (refuse it) or SAY_HELLO (answer unknown_island).
        """
        bound = self._bound.get(island)
        if bound is None:
            return OWN
        if bound.conn == conn:
            bound.heard = max(bound.heard, now)
            return OWN
        return SAY_HELLO if now - bound.heard > self.quiet_s else IN_USE

    def in_use_detail(self, island: str, now: float) -> str:
        """The refusal's detail: which id, since when its connection was heard, what to do.

        Args:
            island: a bound island id.
            now: current time, seconds.

        Returns:
            A one-line explanation.
        """
        bound = self._bound.get(island)
        ago = now - bound.heard if bound is not None else 0.0
        return (
            f"island {island!r} is live on another connection (heard {ago:.1f} s ago): "
            "run each island under its own id; a reconnect is let in once the old "
            f"connection is silent for {self.quiet_s:g} s"
        )

    def forget(self, island: str) -> None:
        """Drop `island`'s binding (after its bye).

        Args:
            island: island id.
        """
        self._bound.pop(island, None)

    def prune(self, keep: Container[str]) -> None:
        """Drop the bindings of ids the shard no longer knows (forgotten dead islands).

        Args:
            keep: the ids to keep.
        """
        for gone in [i for i in self._bound if i not in keep]:
            del self._bound[gone]

    def __len__(self) -> int:
        return len(self._bound)
