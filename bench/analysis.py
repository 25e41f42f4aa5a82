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
    """Share of time windows in which at least one fragment version advanced.

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
