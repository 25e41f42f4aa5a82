"""Goodput as Decoupled DiLoCo defines it; pure functions and bookkeeping, no clock.

Goodput is the share of an island's wall time spent on inner steps whose work
entered the model. The time base is the session's wall time: from its start (the
join, or `Session.mark_start` after a warm-up) to now, or at close to the end of
its last `step`. An inner step's time is the time between two `Session.step`
calls (the caller's training step); it is split over the fragments by their
share of the parameters and carried by the delta that next pushes that fragment.
That time is useful once the delta entered the model (acked, and a version that
merged it arrived in the island's replica), lost when the delta was rejected or
never pushed or acked. Everything else in the wall time is lost too: waiting for
a sync merge, back-pressure (a push blocked on a full outbox), the exchange's own
time in `step`, the first step of a session that did not warm up (it holds the
caller's compile). The caller's own work that is not training (an evaluation, a
checkpoint) is neither: it is left out of the time base when the session is
told of it, which is one rule wherever the caller runs it. Inside `step` (the
metrics row's hook, `Session(row_fields=...)`, where the island daemon runs its
global evaluation) the session times it itself; between `step` calls the
caller marks it with `Session.caller_time()`, else it counts as inner-step
time, like any other work of the caller's training step. Restarts fall
between sessions: the cluster-level figures
(`bench.chaos_score`, `bench.analysis.final_goodput`) count them, from the
tokens the shards merged over what the islands could have trained at their own
rate. Staleness costs nothing here: `g(s)` is a step-size rule, not a
measurement; its price is measured as quality (loss at equal tokens and wall
time, and the staleness histogram: `bench.fidelity_staleness`).

While a delta is in flight (not acked, or acked with its merge not seen yet) its
time is neither useful nor lost: it stays out of the time base until it settles,
so an island that never waits reads 1 during the run, not 1 - its last round.
At close an acked delta counts as merged (its shard holds it durably and merges
it at its next step; the shards' credit says whether it was).

Each pushed delta's seconds live in its record of the island's ledger of
deltas (`worker.deltas.DeltaLedger`), which moves them to useful or lost as the
client reports the delta's fate. `RoundClock` (a session's `goodput_clock`)
keeps the times a session needs (its start, the caller's step durations
between two `Session.step` calls, sync-mode waits, the round's start, the
inner-step time each push carries) and turns them, the ledger's totals (a view,
not a copy) and the client's counters into a metrics row's fields.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from worker.deltas import DeltaLedger


def step_rate(step_times_s: Sequence[float], tokens_per_step: int) -> float | None:
    """An island's training rate at its own speed: tokens per second of stepping.

    The mean step time, not the median: capacity is what the island could have
    trained in its wall time, and its wall time holds every step, slow ones
    included (on a busy machine the median was 0.87-0.92 of the mean, which
    read as 8-13% of lost time that no island lost).

    Args:
        step_times_s: durations of inner steps, padding to the emulated speed
            included (compile excluded: islands warm up first).
        tokens_per_step: tokens one inner step trains.

    Returns:
        tokens_per_step / mean step time, or None without usable steps.
    """
    times = [t for t in step_times_s if math.isfinite(t) and t > 0]
    if not times or tokens_per_step <= 0:
        return None
    return tokens_per_step * len(times) / sum(times)


def goodput(useful: float, available: float) -> float | None:
    """Share of the available time (or of the tokens it could have trained) that was useful.

    Args:
        useful: seconds of inner steps whose work entered the model (or, from the
            shards' credit, the tokens they merged: no staleness factor).
        available: the settled wall time in seconds (or the tokens the island could
            have trained in its wall time at its own rate).

    Returns:
        useful / available (a token ratio may exceed 1 a little on a noisy
        machine), or None without available time.
    """
    return useful / available if available > 0 else None


def session_goodput(useful_s: float, wall_s: float, unsettled_s: Iterable[float]) -> float | None:
    """A session's goodput: useful inner-step time over the settled part of its wall time.

    Args:
        useful_s: inner-step seconds whose deltas entered the model.
        wall_s: seconds since the session's start (its join, or `mark_start`).
        unsettled_s: seconds whose fate is not known yet (deltas in flight, work
            not pushed yet); left out of the time base.

    Returns:
        useful / (wall - unsettled) in [0, 1], or None before any time settled.
    """
    share = goodput(useful_s, wall_s - sum(unsettled_s))
    return None if share is None else min(1.0, max(0.0, share))


# -- the session's clock ------------------------------------------------------------------


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
    timed_steps: int = 0  # the inner steps work_s holds
    # fragment -> work_s when it was last pushed: its unpushed work is work_s minus this
    work_at: dict[int, float] = dataclasses.field(default_factory=dict)
    caller_s: float = 0.0  # the caller's own time (evaluation...): out of the time base
    ledger: DeltaLedger = dataclasses.field(default_factory=DeltaLedger)  # the session's

    def __post_init__(self) -> None:
        if self.round_started < 0:
            self.round_started = self.started

    def step_started(self, now: float) -> None:
        """A `step` call began: the caller's step took the time since the last one ended."""
        if self.last_end is not None:
            self.step_times.append(now - self.last_end)
            self.work_s += now - self.last_end
            self.timed_steps += 1
            del self.step_times[:-256]

    def step_ended(self, now: float) -> None:
        """A `step` call returns now."""
        self.last_end = now

    def caller_time(self, seconds: float, between_steps: bool) -> None:
        """Leave `seconds` of the caller's own work (not training) out of the time base.

        Args:
            seconds: how long it took.
            between_steps: it ran between two `step` calls (`Session.caller_time`),
                so it is no part of the inner step that the next `step_started`
                measures either; False for time inside a `step` call (the row hook),
                which is never inner-step time.
        """
        seconds = max(0.0, seconds)
        self.caller_s += seconds
        if between_steps and self.last_end is not None:
            self.last_end += seconds

    def waited(self, seconds: float) -> None:
        """Add time spent waiting for a merge."""
        self.wait_s += seconds

    def pushed(self, fragment: int, share: float) -> float:
        """A fragment's delta was taken: it carries its share of the steps since its last push.

        Args:
            fragment: its fragment.
            share: the fragment's share of all parameters.

        Returns:
            The inner-step seconds it carries (its record in the ledger keeps them).
        """
        since = self.work_s - self.work_at.get(fragment, 0.0)
        self.work_at[fragment] = self.work_s
        return since * share

    def unpushed_s(self, shares: list[float]) -> float:
        """Inner-step seconds not pushed yet (each fragment's share since its last push)."""
        return sum((self.work_s - self.work_at.get(f, 0.0)) * s for f, s in enumerate(shares))

    def drop_unpushed(self, shares: list[float]) -> None:
        """The session closed: work no delta carries is lost (it never entered the model)."""
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

        The ledger settles as the client reports outcomes; at close call
        `ledger.settle_final` first.

        Args:
            stats: `Client.stats()` ({} on a process other than 0).
            tokens: tokens the session counted.
            steps: step calls so far.
            now: monotonic time.
            shares: each fragment's share of all parameters.

        Returns:
            steps, tokens, version_lag, bytes, pushes, acked, rejected, pending,
            credited_tokens (the shards' word: merged tokens, no staleness factor),
            capacity_tokens (wall time x the island's mean step rate over all its
            timed steps), wait_s, caller_s (the caller's own time left out of the
            wall time),
            work_s (inner-step seconds so far: the caller's time between `step` calls),
            useful_s (inner-step seconds whose deltas entered the model), lost_s
            (wall time lost: waits, overheads, rejected or never-merged work),
            in_flight_s (not settled yet: left out) and goodput (`worker.goodput`;
            absent before any time settled).
        """
        per_step = round(tokens / steps) if steps else 0
        rate = per_step * self.timed_steps / self.work_s if per_step and self.work_s > 0 else None
        wall = now - self.started - self.caller_s
        capacity = wall * rate if rate else 0.0
        credited = float(stats.get("credited_tokens", 0.0))
        unsettled = (self.ledger.in_flight_s, self.unpushed_s(shares))
        useful = self.ledger.useful_s
        share = session_goodput(useful, wall, unsettled)
        row = {
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
            "caller_s": round(self.caller_s, 3),
            "work_s": round(self.work_s, 3),
            "useful_s": round(useful, 3),
            "lost_s": round(max(0.0, wall - sum(unsettled) - useful), 3),
            "in_flight_s": round(sum(unsettled), 3),
        }
        if share is not None:
            row["goodput"] = share
        return row
