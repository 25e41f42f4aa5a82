"""`Readout`: what a client's API reads of its core: counters, replica, fresh updates, acks, credit.

This module owns, with no lock and no I/O, the bookkeeping that `Client.stats`,
`poll_updates`, `round_merged`, `delta_outcomes` and `ack_latencies` report: the counters, the
newest version heard of per fragment, the updates `poll_updates` has not
taken, ack latencies, the version that will include each acked delta (for
`round_merged`) and the tokens each shard credited. The replica (`replica`) is
the one the shards' feeds fill. `Readout` belongs to the client's core
(`paramserver.client.core`); the I/O thread's lock guards both.

Untaken updates: with `ClientConfig.keep` "values" or "versions" the newest of
each fragment (an update's values are the replica's own read-only array, not a
copy); with "increments" every one, in order, since an increment only applies
to the version before it. That chain is bounded: when a fragment's untaken
increments outgrow its float32 values, it is dropped and `publish` names the
fragment, whose shard the core then snapshots again (the snapshot's values
restart the chain).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from paramserver.client.replica import ReplicaFragment
from paramserver.client.types import Update

_MAX_LATENCIES = 100_000  # ack latencies kept until `take_ack_latencies` (bounded memory)
_MAX_MERGE_ROUNDS = 1024  # rounds whose merge versions are kept for `round_merged`
_MAX_REFUSED = 256  # finally refused deltas kept for `take_refused` (the oldest go first)
# "increments": a fragment's untaken increments may hold up to this many bytes per element
# (its float32 values, what a snapshot of it costs); beyond, they are dropped for a snapshot
_CHAIN_BYTES_PER_ELEMENT = 4


@dataclass
class Counters:
    """What `stats` reports."""

    bytes_sent: int = 0
    bytes_received: int = 0
    pushes: int = 0
    acked: int = 0
    duplicates: int = 0
    rejected: Counter = field(default_factory=Counter)
    resent: int = 0
    spurious_resends: int = 0  # re-sends the shard answered `duplicate`: not needed
    snapshots: int = 0
    updates_applied: int = 0
    reconnects: int = 0
    resyncs: int = 0
    bad_messages: int = 0
    deferred: int = 0  # pushes the shard refused for now (too_many_pending): kept, re-sent


_COUNTS = frozenset(f.name for f in fields(Counters)) - {"rejected"}


class Readout:
    """The bookkeeping of one client's core (callers hold the core's lock)."""

    def __init__(self, keep: str = "values") -> None:
        """Start empty: no plan, no replica, every counter at zero.

        Args:
            keep: `ClientConfig.keep` ("increments": every untaken update is kept, in order).
        """
        self._counters = Counters()
        self._chained = keep == "increments"
        self.replica: dict[int, ReplicaFragment] = {}
        self.num_fragments: int | None = None  # the plan's, once joined
        self._known: dict[int, int] = {}  # newest version heard of, per fragment
        self._updates: dict[int, list[Update]] = {}  # fragment -> untaken updates, in order
        self._ack_latencies: deque[float] = deque(maxlen=_MAX_LATENCIES)
        # round -> fragment -> first version that includes the delta (None: rejected)
        self._merge_targets: dict[int, dict[int, int | None]] = {}
        self._credited: dict[int, float] = {}  # shard -> tokens of ours that entered the model
        # (fragment, round, codec frames) of deltas finally refused, until `take_refused`
        self._refused: deque[tuple[int, int, list[Any]]] = deque(maxlen=_MAX_REFUSED)
        # told (round, fragment, outcome) as a delta is acked, refused or merged (`Client.watch_outcomes`)
        self.listener: Callable[[int, int, str], None] | None = None
        # with a listener: fragment -> round -> the version that merges it, acked and not merged yet
        self._awaiting: dict[int, dict[int, int]] = {}

    # -- written by the core ------------------------------------------------------------------

    def add(self, **amounts: int) -> None:
        """Add to counters.

        Args:
            amounts: counter name -> amount, e.g. `add(resent=1, bytes_sent=n)`; any
                field of `Counters` but `rejected` (which `record_ack` keeps).
        """
        unknown = set(amounts) - _COUNTS
        if unknown:
            raise ValueError(f"no counter named {sorted(unknown)}; see Counters")
        for name, amount in amounts.items():
            setattr(self._counters, name, getattr(self._counters, name) + amount)

    def note_version(self, fragment: int, version: int) -> None:
        """A shard named `version` of `fragment` (ack, snapshot or update): track the newest."""
        self._known[fragment] = max(self._known.get(fragment, 0), version)

    def record_ack(self, ack: dict, latency_s: float, payload: list[Any] | None = None) -> None:
        """Count a delta's final ack and remember which version will include it.

        Args:
            ack: the ack header (outcome, reason, round, fragment, version,
                merged_version when the shard says).
            latency_s: seconds since the delta was pushed.
            payload: the delta's codec frames, kept for `take_refused` when it was refused.
        """
        target = ack.get("merged_version")
        if ack["outcome"] == "rejected":
            target = None
        elif target is None:  # a shard that does not say: a step merges all pending
            target = ack["version"] + (ack["outcome"] == "accepted")
        self._merge_targets.setdefault(ack["round"], {})[ack["fragment"]] = target
        while len(self._merge_targets) > _MAX_MERGE_ROUNDS:
            del self._merge_targets[min(self._merge_targets)]
        if self.listener is not None:
            self._tell(ack["round"], ack["fragment"], target)
        if ack["outcome"] in ("accepted", "duplicate"):
            self._counters.acked += 1
            self._ack_latencies.append(latency_s)
            self._counters.duplicates += ack["outcome"] == "duplicate"
        else:
            self._counters.rejected[ack.get("reason") or "unknown"] += 1
            if payload is not None:
                self._refused.append((ack["fragment"], ack["round"], payload))

    def _tell(self, round: int, fragment: int, target: int | None) -> None:
        """Tell the listener a delta's final ack; a merge it still waits for is awaited."""
        outcome = self.delta_outcome(round, fragment) if target is not None else "rejected"
        if outcome == "acked":
            self._awaiting.setdefault(fragment, {})[round] = target
        self.listener(round, fragment, outcome)

    def _merged_upto(self, fragment: int) -> None:
        """Tell the listener of each awaited delta of `fragment` the replica now includes."""
        waiting, state = self._awaiting.get(fragment), self.replica.get(fragment)
        if not waiting or state is None:
            return
        for round in [r for r, target in waiting.items() if state.version >= target]:
            del waiting[round]
            self.listener(round, fragment, "merged")

    def credit(self, shard: int, credited: object) -> None:
        """A shard's cumulative credit of this island's tokens (ignored unless a number)."""
        if isinstance(credited, int | float) and not isinstance(credited, bool):
            self._credited[shard] = max(self._credited.get(shard, 0.0), float(credited))

    def publish(self, updates: list[Update]) -> list[int]:
        """Hand updates (in order) to `take_updates`.

        Args:
            updates: new versions, as the shards' feeds hand them out.

        Returns:
            Fragments whose untaken increments outgrew their bound and were dropped
            ("increments"): their shard must be snapshotted again. Else [].
        """
        dropped: list[int] = []
        if self.listener is not None:
            for fragment in sorted({u.fragment for u in updates}):
                self._merged_upto(fragment)
        for u in updates:
            self._counters.updates_applied += 1
            chain = self._updates.setdefault(u.fragment, [])
            if not self._chained or u.increment is None or u.values is not None:
                chain[:] = [u]  # the newest values (or version) replace what was untaken
                continue
            chain.append(u)
            held = sum(c.increment.nbytes for c in chain if c.values is None)
            if held > _CHAIN_BYTES_PER_ELEMENT * u.increment.size:
                del self._updates[u.fragment]
                dropped.append(u.fragment)
        return dropped

    # -- read by the API ------------------------------------------------------------------------

    def take_refused(self) -> list[tuple[int, int, list[Any]]]:
        """The deltas finally refused since the last call, oldest first (then forgotten).

        Returns:
            (fragment, round, codec frames) per delta.
        """
        out = list(self._refused)
        self._refused.clear()
        return out

    def take_updates(self) -> list[Update]:
        """Pop the untaken updates: the newest of each fragment, or every one ("increments").

        Returns:
            Updates sorted by fragment, then version.
        """
        updates, self._updates = self._updates, {}
        return [u for k in sorted(updates) for u in updates[k]]

    def take_ack_latencies(self) -> list[float]:
        """Pop the ack latencies recorded since the last call (bounded to the newest 100,000).

        Returns:
            Seconds from `push` to the ack (accepted or duplicate), one per delta.
        """
        out = list(self._ack_latencies)
        self._ack_latencies.clear()
        return out

    def delta_merged(self, round: int, fragment: int) -> bool:
        """Whether the delta of (`round`, `fragment`) is resolved and in the replica.

        Args:
            round: the round id given to `push`.
            fragment: the fragment index.

        Returns:
            True once it is acked and the replica holds a version that includes
            it, or it was rejected (it never will be: resolved).
        """
        return self.delta_outcome(round, fragment) in ("merged", "rejected")

    def round_merged(self, round: int) -> bool:
        """Whether every fragment's delta of `round` is resolved and in the replica.

        Args:
            round: the round id given to `push`.

        Returns:
            True once every fragment of the plan has an ack for this round and
            the replica holds a version that includes it (a rejected delta
            never will: it counts as resolved).
        """
        targets = self._merge_targets.get(round)
        if self.num_fragments is None or targets is None:
            return False
        if len(targets) < self.num_fragments:
            return False
        return all(self.delta_merged(round, f) for f in targets)

    def delta_outcome(self, round: int, fragment: int) -> str:
        """What became of one pushed delta, as far as this client knows.

        Args:
            round: the round id given to `push`.
            fragment: the delta's fragment.

        Returns:
            "merged" (acked, and the replica holds a version that includes it),
            "acked" (the shard holds it; no version including it arrived yet),
            "rejected", or "pending" (no final ack yet, or forgotten: only the
            newest 1024 rounds are kept).
        """
        targets = self._merge_targets.get(round, {})
        if fragment not in targets:
            return "pending"
        target = targets[fragment]
        if target is None:
            return "rejected"
        state = self.replica.get(fragment)
        return "merged" if state is not None and state.version >= target else "acked"

    def stats(self, shards_down: int) -> dict[str, Any]:
        """A copy of the counters plus derived values.

        Args:
            shards_down: shards the core counts as down.

        Returns:
            The stats dict of `Client.stats` (without `pending`).
        """
        c = self._counters
        replica = list(self.replica.items())  # one C-level copy; the dict may grow
        lag = max((self._known.get(f, s.version) - s.version for f, s in replica), default=0)
        return {
            "bytes_sent": c.bytes_sent,
            "bytes_received": c.bytes_received,
            "pushes": c.pushes,
            "acked": c.acked,
            "duplicates": c.duplicates,
            "rejected": dict(c.rejected),
            "resent": c.resent,
            "spurious_resends": c.spurious_resends,
            "snapshots": c.snapshots,
            "updates_applied": c.updates_applied,
            "version_lag": max(0, lag),
            "reconnects": c.reconnects,
            "resyncs": c.resyncs,
            "bad_messages": c.bad_messages,
            "deferred": c.deferred,
            "shards_down": shards_down,
            "credited_tokens": sum(self._credited.values()),
        }
