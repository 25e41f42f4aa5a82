"""The cluster page's data: shard statuses in, the `/api/cluster` JSON out. Pure functions.

This module owns what the page shows and how it is derived from the status
maps the supervisor scrapes (`paramserver.plumbing.probe.shard_status`, one
per shard and sample): per shard its fragment versions, pending deltas and
bytes, accepted / duplicate / rejected counts, byte rates (from two
consecutive samples), live islands; per island (the union of what the shards
say in their `islands` and `credited_tokens`) its liveness, last push, rounds,
staleness and its own report (train loss, step rate, goodput); and a bounded
history of versions and losses for the plots (`History`). Times are wall-clock
seconds; nothing here reads a clock or a socket.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from paramserver.wire.protocol import TRAINING_FIELDS

# Samples kept for the plots (at the supervisor's 2 s interval: an hour).
HISTORY_POINTS = 1800


@dataclass(frozen=True)
class Sample:
    """One scrape: when, and each shard's status (or {"shard", "endpoint", "error"})."""

    time: float
    shards: tuple[Mapping[str, Any], ...]


def _rate(now: Mapping[str, Any], before: Mapping[str, Any] | None, key: str, dt: float):
    """Per-second growth of a counter between two statuses; None when it cannot be told."""
    if before is None or dt <= 0 or "error" in before or key not in before:
        return None
    grown = now.get(key, 0) - before[key]
    return None if grown < 0 else grown / dt  # a restarted shard counts from 0 again


def shard_view(
    status: Mapping[str, Any], before: Mapping[str, Any] | None, dt: float
) -> dict[str, Any]:
    """One shard's row of the page.

    Args:
        status: the shard's status map (+ "endpoint"), or {"shard", "endpoint", "error"}.
        before: the same shard's status one sample earlier (None: none).
        dt: seconds between the two samples.

    Returns:
        shard, endpoint, up, error, and for a shard that answered: versions
        (fragment map), pending (fragment map), pending_deltas, pending_bytes,
        max_pending_bytes, accepted, duplicates, rejected (reason -> count),
        steps, bytes_in, bytes_out, bytes_in_per_s, bytes_out_per_s (None on the
        first sample) and islands_live.
    """
    row: dict[str, Any] = {
        "shard": status.get("shard"),
        "endpoint": status.get("endpoint"),
        "up": "error" not in status,
        "error": status.get("error"),
    }
    if "error" in status:
        return row
    pending = {str(k): int(v) for k, v in dict(status.get("pending", {})).items()}
    return {
        **row,
        "initialized": bool(status.get("initialized")),
        "versions": {str(k): int(v) for k, v in dict(status.get("versions", {})).items()},
        "pending": pending,
        "pending_deltas": sum(pending.values()),
        "pending_bytes": status.get("pending_bytes", 0),
        "max_pending_bytes": status.get("max_pending_bytes"),
        "accepted": status.get("accepted", 0),
        "duplicates": status.get("duplicates", 0),
        "rejected": dict(status.get("rejected", {})),
        "steps": status.get("steps", 0),
        "bytes_in": status.get("bytes_in", 0),
        "bytes_out": status.get("bytes_out", 0),
        "bytes_in_per_s": _rate(status, before, "bytes_in", dt),
        "bytes_out_per_s": _rate(status, before, "bytes_out", dt),
        "islands_live": list(status.get("islands_live", [])),
    }


def _newest(values: Sequence[Any]) -> Any:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def island_views(shards: Sequence[Mapping[str, Any]], now: float) -> list[dict[str, Any]]:
    """Every island any shard knows, merged over the shards.

    Args:
        shards: the shards' status maps (those with "error" are skipped).
        now: the sample's time (for ages).

    Returns:
        One row per island, sorted by id: island, live (live on some shard),
        heard_s_ago, last_push_s_ago (None before a push), rounds and staleness
        (the most any shard saw), accepted, credited_tokens (summed), reported_s_ago
        and the newest report's inner_loss, steps_per_s and goodput (None when
        never reported).
    """
    answered = [s for s in shards if "error" not in s]
    ids = sorted(
        {i for s in answered for i in s.get("islands", {})}
        | {i for s in answered for i in s.get("islands_live", [])}
    )
    rows = []
    for island in ids:
        seen = [s["islands"][island] for s in answered if island in s.get("islands", {})]
        reports = [r for r in seen if r.get("reported") is not None]
        newest = max(reports, key=lambda r: r["reported"]) if reports else {}
        heard = _newest([r.get("heard") for r in seen])
        pushed = _newest([r.get("last_push") for r in seen])
        rows.append(
            {
                "island": island,
                "live": any(island in s.get("islands_live", []) for s in answered),
                "heard_s_ago": None if heard is None else max(0.0, now - heard),
                "last_push_s_ago": None if pushed is None else max(0.0, now - pushed),
                "rounds": _newest([r.get("rounds") for r in seen]) or 0,
                "accepted": sum(r.get("accepted", 0) for r in seen),
                "staleness": _newest([r.get("staleness") for r in seen]),
                "credited_tokens": sum(
                    s.get("credited_tokens", {}).get(island, 0.0) for s in answered
                ),
                "reported_s_ago": max(0.0, now - newest["reported"]) if newest else None,
                **{k: newest.get(k) for k in TRAINING_FIELDS},
            }
        )
    return rows


class History:
    """The plots' bounded past: per sample the fragments' versions and new loss reports."""

    def __init__(self, limit: int = HISTORY_POINTS) -> None:
        """Start empty.

        Args:
            limit: the most samples kept (the oldest go first).
        """
        self.points: deque[tuple[float, dict[str, int], dict[str, float]]] = deque(maxlen=limit)
        self._reported: dict[str, float] = {}  # island -> `reported` of its last plotted loss

    def add(self, sample: Sample) -> None:
        """Keep one sample's versions and every loss reported since the previous sample.

        Args:
            sample: the scrape.
        """
        versions: dict[str, int] = {}
        newest: dict[str, tuple[float, float]] = {}  # island -> (reported, loss)
        for status in sample.shards:
            if "error" in status:
                continue
            versions.update({str(k): int(v) for k, v in status.get("versions", {}).items()})
            for island, report in status.get("islands", {}).items():
                at, loss = report.get("reported"), report.get("inner_loss")
                if at is not None and loss is not None and at > newest.get(island, (-1.0, 0))[0]:
                    newest[island] = (at, loss)
        losses = {}
        for island, (at, loss) in newest.items():
            if at != self._reported.get(island):
                self._reported[island] = at
                losses[island] = loss
        self.points.append((sample.time, versions, losses))

    def series(self) -> dict[str, Any]:
        """Aligned series for the plots (one value per sample; None where there is none).

        Returns:
            {"t": [sample times], "versions": {fragment: [version]}, "loss": {island: [loss]}}.
        """
        fragments = sorted({f for _, v, _ in self.points for f in v}, key=int)
        islands = sorted({i for _, _, loss in self.points for i in loss})
        return {
            "t": [t for t, _, _ in self.points],
            "versions": {f: [v.get(f) for _, v, _ in self.points] for f in fragments},
            "loss": {i: [loss.get(i) for _, _, loss in self.points] for i in islands},
        }


def cluster_view(
    sample: Sample, before: Sample | None, history: History, interval_s: float
) -> dict[str, Any]:
    """The whole `/api/cluster` document.

    Args:
        sample: the newest scrape.
        before: the scrape before it (None: none), for byte rates.
        history: the plots' past (with `sample` already added).
        interval_s: the scrape interval (the page refreshes at about this pace).

    Returns:
        {"time", "interval_s", "shards": [shard_view], "islands": [island_views],
        "history": History.series()}.
    """
    dt = sample.time - before.time if before is not None else 0.0
    previous = {s.get("shard"): s for s in before.shards} if before is not None else {}
    return {
        "time": sample.time,
        "interval_s": interval_s,
        "shards": [shard_view(s, previous.get(s.get("shard")), dt) for s in sample.shards],
        "islands": island_views(sample.shards, sample.time),
        "history": history.series(),
    }
