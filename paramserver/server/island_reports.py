"""What one shard knows of each island for people watching: pushes, staleness, its own reports.

This module owns the per-island view behind the `islands` field of a shard's
`status` (what the cluster page shows): when the island's last delta arrived
here, how many rounds it pushed here, the staleness of its deltas in its last
merged step, and what the island last reported of its training (the optional
`inner_loss`, `steps_per_s` and `goodput` fields of its pushes and heartbeats,
`paramserver.wire.protocol.TRAINING_FIELDS`). Plain bookkeeping, not events: a
restart starts it empty. Pure: the caller passes `now` (wall-clock seconds).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from paramserver.wire.protocol import TRAINING_FIELDS

# The most islands remembered; beyond it the one heard from longest ago is forgotten.
MAX_REPORTED_ISLANDS = 4096


@dataclass
class IslandReport:
    """One island as this shard saw it (wall-clock seconds)."""

    heard: float
    last_push: float | None = None
    last_round: int | None = None
    rounds: int = 0  # distinct rounds with an accepted delta here
    accepted: int = 0
    staleness: int | None = None  # the most stale of its deltas in its last merged step
    training: dict[str, float] = field(default_factory=dict)
    reported: float | None = None  # when `training` last changed hands

    def as_status(self) -> dict[str, Any]:
        """JSON-ready: the fields above, `training` flattened into the map."""
        return {
            "heard": self.heard,
            "last_push": self.last_push,
            "last_round": self.last_round,
            "rounds": self.rounds,
            "accepted": self.accepted,
            "staleness": self.staleness,
            "reported": self.reported,
            **self.training,
        }


class IslandReports:
    """Every island's `IslandReport` on one shard, bounded by MAX_REPORTED_ISLANDS."""

    def __init__(self, limit: int = MAX_REPORTED_ISLANDS) -> None:
        """Start empty.

        Args:
            limit: the most islands kept.
        """
        self.limit = limit
        self.islands: dict[str, IslandReport] = {}

    def _of(self, island: str, now: float) -> IslandReport:
        report = self.islands.get(island)
        if report is None:
            if len(self.islands) >= self.limit:
                oldest = min(self.islands, key=lambda i: self.islands[i].heard)
                del self.islands[oldest]
            report = self.islands[island] = IslandReport(heard=now)
        report.heard = max(report.heard, now)
        return report

    def heard(self, island: str, header: Mapping[str, Any], now: float) -> None:
        """A push or heartbeat of a known island arrived (its header passed the protocol check).

        Args:
            island: the island id.
            header: the message header; its training fields, when present, replace
                the island's last report.
            now: wall-clock seconds.
        """
        report = self._of(island, now)
        training = {k: float(header[k]) for k in TRAINING_FIELDS if k in header}
        if training:
            report.training, report.reported = training, now

    def accepted(self, island: str, round_id: int, now: float) -> None:
        """One delta of the island was accepted here.

        Args:
            island: the island id.
            round_id: the push's round.
            now: wall-clock seconds.
        """
        report = self._of(island, now)
        report.last_push, report.accepted = now, report.accepted + 1
        if report.last_round != round_id:
            report.last_round, report.rounds = round_id, report.rounds + 1

    def merged(self, staleness: Iterable[tuple[str, int]]) -> None:
        """An outer step merged deltas: note each island's most stale one in it.

        Args:
            staleness: (island, staleness) of each merged delta.
        """
        worst: dict[str, int] = {}
        for island, stale in staleness:
            worst[island] = max(stale, worst.get(island, stale))
        for island, stale in worst.items():
            if island in self.islands:
                self.islands[island].staleness = stale

    def status(self) -> dict[str, dict[str, Any]]:
        """JSON-ready: island -> `IslandReport.as_status()`, sorted by id."""
        return {i: r.as_status() for i, r in sorted(self.islands.items())}
