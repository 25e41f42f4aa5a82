"""Pure computations of the report: curves, byte accounting, uptime, time to target.

Everything here takes the rows the islands (or DDP ranks) wrote to their
``metrics.jsonl`` and the version timeline polled from the shards, and returns
plain numbers; nothing touches processes, files or sockets, so every piece is
unit-tested on hand-made rows.

Row fields used: ``wall`` (epoch seconds), ``time_s`` (seconds since that
process started training), ``round``, ``tokens``, ``steps``, ``bytes_sent``,
``bytes_received`` (cumulative, counted at the process's sockets),
``eval_global`` (held-out loss of the global parameters), ``loss``, ``goodput``,
``capacity_tokens``; and the shards' ``credited_tokens`` for the final goodput.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from typing import Any

from worker.goodput import goodput

Rows = Sequence[Mapping[str, Any]]


def start_time(rows_by_island: Mapping[str, Rows]) -> float:
    """The wall-clock instant the earliest island started training.

    Args:
        rows_by_island: island -> its metrics rows.

    Returns:
        Epoch seconds: min of ``wall - time_s`` over rows of rounds >= 1 (round 0 is the
        evaluation before training), over all rows when there are no others; 0.0 without rows.
    """
    rows = [r for rs in rows_by_island.values() for r in rs]
    trained = [r for r in rows if r.get("round", 0) >= 1] or rows
    return min((r["wall"] - r.get("time_s", 0.0) for r in trained), default=0.0)


def tokens_at(rows: Rows, wall: float) -> int:
    """An island's cumulative tokens as of `wall` (its latest row not after it).

    Args:
        rows: one island's rows, in the order written.
        wall: epoch seconds.

    Returns:
        Tokens (0 before the first row that carries them).
    """
    best = 0
    for r in rows:
        if r["wall"] <= wall and "tokens" in r:
            best = r["tokens"]
    return best


def eval_curve(rows_by_island: Mapping[str, Rows]) -> list[tuple[float, int, float]]:
    """Held-out loss of the global parameters over time and cluster tokens.

    Args:
        rows_by_island: island -> its metrics rows.

    Returns:
        Sorted list of (seconds since training started (evaluations before it at 0),
        tokens summed over islands, eval loss).
    """
    t0 = start_time(rows_by_island)
    points = []
    for rows in rows_by_island.values():
        for r in rows:
            if "eval_global" in r:
                tokens = sum(tokens_at(other, r["wall"]) for other in rows_by_island.values())
                points.append((max(0.0, r["wall"] - t0), tokens, float(r["eval_global"])))
    return sorted(points)


def first_reach(
    curve: Sequence[tuple[float, int, float]], target: float
) -> tuple[float, float] | None:
    """When a loss curve first reaches `target`, interpolated between the two points around it.

    Args:
        curve: (seconds, tokens, loss) points sorted by time.
        target: loss to reach.

    Returns:
        (seconds, tokens) at the crossing, or None if never reached.
    """
    prev = None
    for t, tokens, loss in curve:
        if loss <= target:
            if prev is None or prev[2] == loss:
                return float(t), float(tokens)
            frac = (prev[2] - target) / (prev[2] - loss)
            return prev[0] + frac * (t - prev[0]), prev[1] + frac * (tokens - prev[1])
        prev = (t, tokens, loss)
    return None


def loss_at_tokens(curve: Sequence[tuple[float, int, float]], tokens: float) -> float | None:
    """The eval loss at a token count, linearly interpolated (clamped at the ends).

    Args:
        curve: (seconds, tokens, loss) points.
        tokens: the token count.

    Returns:
        Loss, or None for an empty curve.
    """
    return loss_at(curve, tokens, axis=1)


def loss_at(curve: Sequence[Sequence[float]], value: float, axis: int) -> float | None:
    """The eval loss where one coordinate of the curve has `value`, linearly interpolated.

    Args:
        curve: (seconds, tokens, loss) points.
        value: the seconds (axis 0: equal wall time) or tokens (axis 1) to read at.
        axis: which coordinate `value` is; clamped at the ends of the curve.

    Returns:
        Loss, or None for an empty curve.
    """
    pts = sorted((p[axis], p[2]) for p in curve)
    if not pts:
        return None
    xs = [p[0] for p in pts]
    i = bisect.bisect_left(xs, value)
    if i == 0:
        return pts[0][1]
    if i == len(pts):
        return pts[-1][1]
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    return y0 if x1 == x0 else y0 + (y1 - y0) * (value - x0) / (x1 - x0)


def island_bytes(rows: Rows) -> dict[str, float]:
    """Bytes one island moved: totals, and per round in steady state (after the join).

    The first round's counters include the join (the fp32 snapshot of every
    fragment), so the per-round figures are taken between the first and the
    last round row; the join cost is what the first round moved beyond that.

    Args:
        rows: one island's rows.

    Returns:
        dict with rounds, steps, tokens, bytes_sent, bytes_received (totals),
        up_per_round, down_per_round (steady state) and join_bytes.
    """
    rounds = [r for r in rows if "bytes_sent" in r and r.get("round", 0) > 0]
    if not rounds:
        return {
            "rounds": 0, "steps": 0, "tokens": 0, "bytes_sent": 0, "bytes_received": 0,
            "up_per_round": 0.0, "down_per_round": 0.0, "join_bytes": 0.0,
        }  # fmt: skip
    first, last = rounds[0], rounds[-1]
    span = last["round"] - first["round"]
    up = (last["bytes_sent"] - first["bytes_sent"]) / span if span else float(first["bytes_sent"])
    down = (
        (last["bytes_received"] - first["bytes_received"]) / span
        if span
        else float(first["bytes_received"])
    )
    join = max(0.0, first["bytes_sent"] + first["bytes_received"] - first["round"] * (up + down))
    return {
        "rounds": last["round"],
        "steps": last.get("steps", 0),
        "tokens": last.get("tokens", 0),
        "bytes_sent": last["bytes_sent"],
        "bytes_received": last["bytes_received"],
        "up_per_round": up,
        "down_per_round": down,
        "join_bytes": join,
    }


def bytes_per_token(rows: Rows) -> float:
    """Bytes sent plus received per token trained, over the whole run.

    Args:
        rows: one island's (or rank's) rows.

    Returns:
        Bytes per token (0.0 before any token).
    """
    last = next((r for r in reversed(rows) if "bytes_sent" in r and r.get("tokens")), None)
    if last is None:
        return 0.0
    return (last["bytes_sent"] + last["bytes_received"]) / last["tokens"]


def uptime(
    timeline: Sequence[tuple[float, int]],
    window_s: float,
    start: float,
    end: float,
    exclude: Sequence[tuple[float, float]] = (),
) -> float | None:
    """Share of fixed time windows in which at least one fragment version advanced.

    The report's and fidelity's `uptime`, and chaos's `uptime_windowed`. A window
    shorter than the rounds of a loaded machine reads as downtime though nothing
    failed; chaos's `uptime` is `step_uptime`, which follows the islands' rounds.

    Args:
        timeline: (seconds, sum of every fragment's version) samples, sorted by
            time; versions never decrease, so "some fragment advanced" is "the
            sum grew".
        window_s: window length (e.g. the nominal round time).
        start: first window's start (seconds, same clock as the timeline).
        end: windows end at or before this.
        exclude: (from, to) intervals; a window overlapping one is not counted
            (e.g. a shard's outage, to judge uptime under island faults alone).

    Returns:
        Share in [0, 1], or None when no whole (counted) window fits.
    """
    if window_s <= 0 or not timeline:
        raise ValueError(f"uptime needs window_s > 0 and samples, got {window_s} and {timeline!r}")
    count = int((end - start) // window_s)
    if count <= 0:
        return None
    times = [t for t, _v in timeline]

    def version_at(t: float) -> int:
        i = bisect.bisect_right(times, t)
        return timeline[i - 1][1] if i else timeline[0][1]

    windows = [(start + k * window_s, start + (k + 1) * window_s) for k in range(count)]
    counted = [(a, b) for a, b in windows if not any(a < e and b > s for s, e in exclude)]
    if not counted:
        return None
    return sum(version_at(b) > version_at(a) for a, b in counted) / len(counted)


def typical_round_s(rounds: Sequence[tuple[float, float]], at: float, each_side: int = 10) -> float:
    """The median length of the rounds that ended nearest a time (the islands' pace then).

    Args:
        rounds: (end time, seconds) of every island's rounds, sorted by end time.
        at: the time.
        each_side: rounds taken on each side of `at`.

    Returns:
        The median seconds of up to `each_side` rounds ending before `at` and as many
        after; 0.0 without rounds.
    """
    i = bisect.bisect_left(rounds, (at, -math.inf))
    near = sorted(s for _e, s in rounds[max(0, i - each_side) : i + each_side])
    if not near:
        return 0.0
    mid = len(near) // 2
    return near[mid] if len(near) % 2 else (near[mid - 1] + near[mid]) / 2


def stuck_spans(
    samples: Sequence[tuple[float, int | None]],
    pushes: Mapping[str, Sequence[float]],
    rounds: Sequence[tuple[float, float]],
    quorum: int = 1,
    slack_rounds: float = 2.0,
) -> list[tuple[float, float]]:
    """When one fragment stood still although the islands' pushes should have moved it.

    After each advance of the fragment's version, its next step is due once
    deltas of `quorum` islands reached its shard, plus `slack_rounds` typical
    rounds (`typical_round_s`) for the merge rule's grace window, the step and
    the machine's noise. The fragment is stuck from then until the last sample
    before its next observed advance (the advance happened after that sample:
    the span is never longer than the real one). Islands that push nothing
    (paused, killed, blocked, or skipping while their last delta is unmerged)
    make no step due: an island's fault does not count here, the servers' do.

    Args:
        samples: (time, version) polls of the fragment, sorted by time; version None
            when its shard did not answer (not advanced then).
        pushes: island -> sorted times its pushes of this fragment reached the shard
            (each delta's first arrival).
        rounds: (end time, seconds) of every island's rounds, sorted (their pace).
        quorum: islands whose deltas a step needs (1 in async mode).
        slack_rounds: typical rounds allowed between the quorum's push and the step.

    Returns:
        Sorted, disjoint (from, to) spans.
    """
    times = [list(ts) for ts in pushes.values()]

    def due(after: float) -> float:
        firsts = sorted(ts[i] for ts in times if (i := bisect.bisect_right(ts, after)) < len(ts))
        if len(firsts) < quorum:
            return math.inf
        return firsts[quorum - 1] + slack_rounds * typical_round_s(rounds, after)

    spans: list[tuple[float, float]] = []
    known: int | None = None
    last_advance = prev_t = None
    for t, version in samples:
        if version is not None and known is not None and version > known:
            if last_advance is not None and prev_t is not None and prev_t > due(last_advance):
                spans.append((due(last_advance), prev_t))
            last_advance = t
        if version is not None:
            known = version if known is None else max(known, version)
        if last_advance is None:
            last_advance = t
        prev_t = t
    if last_advance is not None and prev_t is not None and prev_t > due(last_advance):
        spans.append((due(last_advance), prev_t))
    return spans


def _union(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def _overlap(spans: Sequence[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)


def step_uptime(
    fragments: Mapping[Any, Sequence[tuple[float, int | None]]],
    pushes: Mapping[Any, Mapping[str, Sequence[float]]],
    rounds: Sequence[tuple[float, float]],
    start: float,
    end: float,
    quorum: int = 1,
    exclude: Sequence[tuple[float, float]] = (),
    slack_rounds: float = 2.0,
) -> float | None:
    """Share of [start, end] in which no fragment was stuck (`stuck_spans`): our step uptime.

    Downtime is the time by which some fragment's version stood still beyond
    its due step (the quorum's next delta plus `slack_rounds` typical rounds),
    so uneven rounds on a loaded machine cost nothing, and a shard that is
    down while the islands keep pushing costs its outage less that allowance.

    Args:
        fragments: fragment -> its (time, version or None) polls, sorted by time.
        pushes: fragment -> island -> sorted arrival times of its deltas.
        rounds: (end time, seconds) of every island's rounds, sorted.
        start: the measured span's start (same clock).
        end: its end.
        quorum: islands whose deltas a step needs.
        exclude: (from, to) spans left out of both the downtime and the span
            (e.g. shard outages, to judge the island and link faults alone).
        slack_rounds: see `stuck_spans`.

    Returns:
        1 - downtime / counted time, in [0, 1]; None without samples, pushes or counted time.
    """
    if not fragments or not pushes or end <= start:
        return None
    gaps = _union(
        [
            span
            for f, samples in fragments.items()
            for span in stuck_spans(samples, pushes.get(f, {}), rounds, quorum, slack_rounds)
        ]
    )
    left_out = _union([(max(a, start), min(b, end)) for a, b in exclude if b > start and a < end])
    counted = (end - start) - _overlap(left_out, start, end)
    if counted <= 0:
        return None
    down = _overlap(gaps, start, end) - sum(_overlap(gaps, a, b) for a, b in left_out)
    return max(0.0, 1.0 - down / counted)


def mean(values: Sequence[float]) -> float | None:
    """Arithmetic mean, ignoring None.

    Args:
        values: numbers (None entries are skipped).

    Returns:
        The mean, or None for no values.
    """
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def credited_tokens(server: Mapping[str, Any]) -> dict[str, float]:
    """Tokens of each island that entered the model, summed over the shards.

    Args:
        server: a cluster status ({"shards": [status, ...]}), e.g. after the
            final merges.

    Returns:
        island -> credited tokens (each merged delta's tokens x its fragment's
        share of the model; staleness not counted).
    """
    total: dict[str, float] = {}
    for shard in server.get("shards", []):
        for island, tokens in shard.get("credited_tokens", {}).items():
            total[island] = total.get(island, 0.0) + float(tokens)
    return total


def final_goodput(rows: Rows, credited: float) -> float | None:
    """An island's goodput over its whole run, from the shards' final credit.

    The tokens that entered the model over those the island could have trained
    in its wall time at its own rate: the share of its time spent on inner steps
    whose work was merged (`worker.goodput`), counted by the shards after the
    island left, so work acked but never merged counts lost.

    Args:
        rows: the island's metrics rows (the last one carries capacity_tokens:
            wall time since the start x its median step rate).
        credited: the island's tokens credited by the shards after every
            acked delta was merged (no staleness factor).

    Returns:
        credited / capacity, or None without a capacity.
    """
    capacity = next((r["capacity_tokens"] for r in reversed(rows) if "capacity_tokens" in r), 0)
    return goodput(credited, capacity)


def sum_counts(counts: Sequence[Mapping[str, int]]) -> dict[str, int]:
    """Add up count dicts key by key (e.g. every shard's rejections by reason).

    Args:
        counts: dicts of key -> count.

    Returns:
        key -> total, keys in first-seen order.
    """
    total: dict[str, int] = {}
    for d in counts:
        for key, value in d.items():
            total[key] = total.get(key, 0) + value
    return total
