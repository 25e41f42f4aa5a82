"""Scoring the regions bench's faults over the WAN (pure): windows, training during them, recovery.

`bench.regions_fault_run` injects three faults into a regions run, one after
the other, each after every island has settled again:

- `kill_island`: an island killed with -9 while one of its rounds is being
  pushed, restarted `KILL_DOWN_S` later at its first round not fully acked;
- `cut_link`: every link of one region cut to a tenth of its rate for
  `CUT_S`;
- `partition`: one region cut off the WAN for `PARTITION_S`, then restored.

A fault's window runs from its start to its end (the restart, the rate's
restore, the link back up); its span runs on to the affected island's first
round settled after the end (its recovery; the run's end if none came).

Per fault, this module says:

- whether training went on: every island of another region settled at least
  one round inside the span (`trained_during`);
- whether round times recovered: per island, the median round time (first
  push to last ack) of its rounds that started after the span against the
  median of its rounds that ended before the fault started and after the
  previous fault's span; met when after <= `RECOVERY_FACTOR` x before +
  `RECOVERY_SLACK_S` for every island holding both.

And for the run: acked against applied (the islands' settled rounds against
the shards' per-island accepted counts: no acked delta lost, none applied
twice) and goodput per region (`worker.goodput.goodput`: the compute seconds
of rounds whose every delta was acked, over the island's wall time from its
first round's compute to its last settled round, down time included), also
before the first fault, as the fault-free reference of the same islands.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from worker.goodput import goodput

KINDS = ("kill_island", "cut_link", "partition")
CUT_S = 60.0  # the link cut to a tenth, at --fault-scale 1
CUT_FACTOR = 0.1
PARTITION_S = 30.0
KILL_DOWN_S = 5.0  # from the kill to the restart
RECOVERY_FACTOR = 1.5  # round time after the fault <= this x before (+ slack): recovered
# ... plus this: an island in a shard's own region settles a round in ~10 ms, where the
# scheduling noise of a loaded machine alone doubles it
RECOVERY_SLACK_S = 0.1


@dataclasses.dataclass(frozen=True)
class Round:
    """One settled round of an island (monotonic seconds)."""

    round: int
    started: float  # first push
    ended: float  # last ack
    acked: int  # fragments acked
    fragments: int

    @property
    def seconds(self) -> float:
        """First push to last ack."""
        return self.ended - self.started


@dataclasses.dataclass(frozen=True)
class FaultWindow:
    """One injected fault: what, where, and when (monotonic seconds)."""

    kind: str
    region: int
    start: float
    end: float


def span_end(window: FaultWindow, affected: Sequence[Round], run_end: float) -> float:
    """When the affected island settled its first round after the fault ended (its recovery).

    Args:
        window: the fault.
        affected: the affected region's rounds.
        run_end: the run's end (the span's end without such a round).

    Returns:
        Monotonic seconds.
    """
    later = [r.ended for r in affected if r.ended >= window.end]
    return min(later) if later else run_end


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def recovery(
    before: Sequence[float],
    after: Sequence[float],
    factor: float = RECOVERY_FACTOR,
    slack_s: float = RECOVERY_SLACK_S,
) -> dict[str, Any]:
    """Round time after a fault against before it: recovered when after <= factor x before + slack.

    Args:
        before: round seconds before the fault.
        after: round seconds after its span.
        factor: the most `after` may be, as a multiple of `before`, to count as recovered.
        slack_s: seconds allowed on top (the machine's noise on very short rounds).

    Returns:
        {"before_s", "after_s" (medians or None), "ratio", "met" (None without both)}.
    """
    b, a = _median(list(before)), _median(list(after))
    ratio = a / b if a is not None and b else None  # b > 0 always: a round takes time
    return {
        "before_s": None if b is None else round(b, 4),
        "after_s": None if a is None else round(a, 4),
        "n_before": len(before),
        "n_after": len(after),
        "ratio": None if ratio is None else round(ratio, 4),
        "met": None if a is None or b is None else a <= factor * b + slack_s,
    }


def all_known(flags: list[bool | None]) -> bool | None:
    """All of the known flags (None when none is known)."""
    known = [f for f in flags if f is not None]
    return all(known) if known else None


def score_faults(
    windows: Sequence[FaultWindow],
    rounds: Mapping[int, Sequence[Round]],
    names: Mapping[int, str],
    t0: float,
    run_end: float,
    factor: float = RECOVERY_FACTOR,
) -> list[dict[str, Any]]:
    """Per fault: its window and span, the other islands' rounds in the span, and recovery.

    Args:
        windows: the faults in the order they were injected.
        rounds: region -> its island's settled rounds (every instance).
        names: region -> name.
        t0: the run's start (times in the result are seconds after it).
        run_end: the run's end.
        factor: `RECOVERY_FACTOR`.

    Returns:
        One JSON-ready dict per fault: kind, region, at_s, end_s, span_end_s,
        recovery_s (end to span end), rounds_during (other region -> rounds
        settled in the span), trained_during (met flag), recovery (island ->
        `recovery`), recovered (met flag over the islands that have both figures).
    """
    out = []
    previous_span_end = t0
    for k, w in enumerate(windows):
        span = span_end(w, rounds.get(w.region, []), run_end)
        next_start = windows[k + 1].start if k + 1 < len(windows) else run_end
        during = {
            names[r]: sum(1 for x in rs if w.start <= x.ended <= span)
            for r, rs in sorted(rounds.items())
            if r != w.region
        }
        per_island = {}
        for r, rs in sorted(rounds.items()):
            before = [x.seconds for x in rs if previous_span_end <= x.ended < w.start]
            after = [x.seconds for x in rs if span <= x.started and x.ended <= next_start]
            per_island[names[r]] = recovery(before, after, factor)
        out.append(
            {
                "kind": w.kind,
                "region": names[w.region],
                "at_s": round(w.start - t0, 3),
                "end_s": round(w.end - t0, 3),
                "span_end_s": round(span - t0, 3),
                "recovery_s": round(span - w.end, 3) if span < run_end else None,
                "rounds_during": during,
                "trained_during": bool(during) and all(n >= 1 for n in during.values()),
                "recovery": per_island,
                "recovered": all_known([v["met"] for v in per_island.values()]),
            }
        )
        previous_span_end = span
    return out


def acked_count(rounds: Sequence[Round]) -> int:
    """Deltas an island saw acked: per distinct round, the fragments acked (a round settles once).

    Args:
        rounds: its settled rounds, every instance.

    Returns:
        The count (a round reported twice counts once, its larger figure).
    """
    best: dict[int, int] = {}
    for r in rounds:
        best[r.round] = max(best.get(r.round, 0), r.acked)
    return sum(best.values())


def acked_vs_applied(
    rounds: Mapping[int, Sequence[Round]],
    names: Mapping[int, str],
    applied: Mapping[str, int],
    duplicates: int,
) -> dict[str, Any]:
    """No acked delta lost, none applied twice: acked = applied per island.

    Args:
        rounds: region -> its island's settled rounds.
        names: region -> island name (as the shards know it).
        applied: island name -> deltas the shards accepted from it (summed over shards).
        duplicates: the shards' duplicate count (acked again, not applied).

    Returns:
        {"per_island": {name: {"acked", "applied"}}, "acked", "applied",
        "shard_duplicates", "acked_equals_applied" (met flag)}.
    """
    per = {
        names[r]: {"acked": acked_count(rs), "applied": int(applied.get(names[r], 0))}
        for r, rs in sorted(rounds.items())
    }
    return {
        "per_island": per,
        "acked": sum(v["acked"] for v in per.values()),
        "applied": sum(v["applied"] for v in per.values()),
        "shard_duplicates": duplicates,
        "acked_equals_applied": all(v["acked"] == v["applied"] for v in per.values()),
    }


def region_goodput(
    rounds: Sequence[Round], compute_s: float, until: float | None = None
) -> dict[str, Any]:
    """An island's goodput: compute of rounds whose every delta was acked, over its wall time.

    The wall time runs from the start of its first round's compute (its first
    round's first push less `compute_s`: the join and the process start are
    not training time) to its last settled round (or `until`), so a killed
    island's down time, re-join included, is in it. Only rounds settled by
    `until` count.

    Args:
        rounds: its settled rounds (every instance).
        compute_s: compute seconds of one round at its speed.
        until: the end of the window (default: its last settled round).

    Returns:
        {"useful_s", "wall_s", "goodput"} (goodput None without rounds).
    """
    if until is not None:
        rounds = [r for r in rounds if r.ended <= until]
    if not rounds:
        return {"useful_s": 0.0, "wall_s": 0.0, "goodput": None}
    done = {r.round for r in rounds if r.acked >= r.fragments}
    start = min(r.started for r in rounds) - compute_s
    end = until if until is not None else max(r.ended for r in rounds)
    useful = compute_s * len(done)
    wall = max(0.0, end - start)
    value = goodput(useful, wall)
    return {
        "useful_s": round(useful, 3),
        "wall_s": round(wall, 3),
        "goodput": None if value is None else round(value, 4),
    }
