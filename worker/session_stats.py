"""What a session measures and reports: step times, waits and goodput.

`RoundClock` keeps the times a session needs (its start, the caller's step
durations between two `Session.step` calls, sync-mode waits, the round's
start, the inner-step time each push carries in a `worker.goodput.WorkLedger`)
and turns them and the client's counters into a metrics row's fields (goodput
as `worker.goodput` defines it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from worker.goodput import WorkLedger, session_goodput, step_rate


@dataclasses.dataclass
class RoundClock:
    """Times of one session (monotonic seconds); pure bookkeeping, the caller passes `now`.

    `last_end` is None for a session that did not warm up: the time from its start
    to its first `step` call holds the caller's compile and counts as lost
    (`mark_start` after a warm-up passes `last_end=started`: that first interval
    is an ordinary inner step).
    """

    started: float
    round_started: float = -1.0
    step_times: list[float] = dataclasses.field(default_factory=list)
    wait_s: float = 0.0
    last_end: float | None = None
    work_s: float = 0.0  # inner-step seconds so far (the caller's time between step calls)
    # fragment -> work_s when it was last pushed: its unpushed work is work_s minus this
    work_at: dict[int, float] = dataclasses.field(default_factory=dict)
    ledger: WorkLedger = dataclasses.field(default_factory=WorkLedger)

    def __post_init__(self) -> None:
        if self.round_started < 0:
            self.round_started = self.started

    def step_started(self, now: float) -> None:
        """A `step` call began: the caller's step took the time since the last one ended."""
        if self.last_end is not None:
            self.step_times.append(now - self.last_end)
            self.work_s += now - self.last_end
            del self.step_times[:-256]

    def step_ended(self, now: float) -> None:
        """A `step` call returns now."""
        self.last_end = now

    def waited(self, seconds: float) -> None:
        """Add time spent waiting for a merge."""
        self.wait_s += seconds

    def pushed(self, round: int, fragment: int, share: float) -> None:
        """A fragment's delta left: it carries its share of the steps since its last push.

        Args:
            round: the push's round id.
            fragment: its fragment.
            share: the fragment's share of all parameters.
        """
        since = self.work_s - self.work_at.get(fragment, 0.0)
        self.work_at[fragment] = self.work_s
        self.ledger.pushed(round, fragment, since * share)

    def unpushed_s(self, shares: list[float]) -> float:
        """Inner-step seconds not pushed yet (each fragment's share since its last push)."""
        return sum((self.work_s - self.work_at.get(f, 0.0)) * s for f, s in enumerate(shares))

    def drop_unpushed(self, shares: list[float]) -> None:
        """The session closed: work no delta carries is lost (it never entered the model)."""
        self.ledger.lost_s += self.unpushed_s(shares)
        self.work_at = dict.fromkeys(range(len(shares)), self.work_s)

    def median_step_s(self, last: int) -> float:
        """Median of the last `last` step times (1 ms before any was measured)."""
        recent = self.step_times[-last:]
        return float(np.median(recent)) if recent and np.median(recent) > 0 else 1e-3

    def round_done(self, now: float) -> float:
        """Seconds the round that ends now took; starts the next one."""
        seconds, self.round_started = now - self.round_started, now
        return round(seconds, 3)

    def fields(
        self, stats: dict[str, Any], tokens: int, steps: int, now: float, shares: list[float]
    ) -> dict[str, Any]:
        """The counters a metrics row carries and the goodput they imply.

        Settle the ledger first (`ledger.settle` with the client's outcomes).

        Args:
            stats: `Client.stats()` ({} on a process other than 0).
            tokens: tokens the session counted.
            steps: step calls so far.
            now: monotonic time.
            shares: each fragment's share of all parameters.

        Returns:
            steps, tokens, version_lag, bytes, pushes, acked, rejected, pending,
            credited_tokens (the shards' word: merged tokens, no staleness factor),
            capacity_tokens (wall time x the island's median step rate), wait_s,
            work_s (inner-step seconds so far: the caller's time between `step` calls),
            useful_s (inner-step seconds whose deltas entered the model), lost_s
            (wall time lost: waits, overheads, rejected or never-merged work),
            in_flight_s (not settled yet: left out) and goodput (`worker.goodput`).
        """
        rate = step_rate(self.step_times, round(tokens / steps) if steps else 0)
        wall = now - self.started
        capacity = wall * rate if rate else 0.0
        credited = float(stats.get("credited_tokens", 0.0))
        unsettled = (self.ledger.in_flight_s, self.unpushed_s(shares))
        useful = self.ledger.useful_s
        return {
            "steps": steps,
            "tokens": tokens,
            "version_lag": max(0, stats.get("version_lag", 0)),
            "bytes_sent": stats.get("bytes_sent", 0),
            "bytes_received": stats.get("bytes_received", 0),
            "pushes": stats.get("pushes", 0),
            "acked": stats.get("acked", 0),
            "rejected": sum(stats.get("rejected", {}).values()),
            "pending": stats.get("pending", 0),
            "credited_tokens": round(credited, 1),
            "capacity_tokens": round(capacity, 1),
            "wait_s": round(self.wait_s, 3),
            "work_s": round(self.work_s, 3),
            "useful_s": round(useful, 3),
            "lost_s": round(max(0.0, wall - sum(unsettled) - useful), 3),
            "in_flight_s": round(sum(unsettled), 3),
            "goodput": session_goodput(useful, wall, unsettled) or 0.0,
        }
