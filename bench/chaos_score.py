"""Scoring a chaos run (pure): goodput, uptime, acked vs applied deltas, recovery, lost time.

`bench.chaos` runs the daemons and collects raw material (relay statistics,
shard status, metrics rows, every fragment's polled versions); this module
turns it into the report's numbers.

Goodput is the share of the islands' time spent on inner steps whose work
entered the model (`worker.goodput`): the tokens the shards credited after the
final merges (staleness not counted), less what the islands trained before the
measured window, over what they could have trained from the window's start
to their stop at their own pace (`Pace`: tokens per inner-step second of
their rounds in the window clear of every fault span, a fault's start to its
end plus its recovery and one round, within 30 s of each time). Inner-step
seconds are the island's `work_s`, the caller's time between `step` calls, so
the session's own time (exchange, outbox, pushes, back-pressure, merge waits)
is lost time, not pace. A mean over rounds, not the median round: the time
base is wall time, and the median round of a loaded machine is 15-20% shorter
than the mean one; local, because the machine's speed drifts with the work
beside the run. `lost_island_s` says where the
rest went: island-seconds lost in each fault's span, outside them, and work
trained but never credited.

Uptime is `bench.analysis.step_uptime` (our figure: the share of the window in
which no fragment stood still past its due step), and `uptime_windowed` the
earlier fixed-window figure (`bench.analysis.uptime`).
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence
from typing import Any

from bench import faults as fl
from bench import soak
from bench.analysis import credited_tokens, step_uptime, sum_counts, typical_round_s, uptime
from worker.goodput import goodput

Rows = list[dict[str, Any]]


def summarize(
    raw: dict[str, Any],
    faults: list[fl.Fault],
    setup: Any,
    window_s: float,
) -> dict[str, Any]:
    """The report of one run from its raw material (pure).

    Args:
        raw: what `ChaosRun.run` returned.
        faults: the run's schedule.
        setup: the run's shape (bench.chaos.Setup: shards, duration_s).
        window_s: the fixed window of `uptime_windowed`.

    Returns:
        JSON-ready dict with goodput, uptime, deltas_acked, deltas_applied,
        final_eval_loss, recovery and lost island-seconds per fault, and the fault counts.
    """
    relay = raw["relay"]
    acked = fl.ack_keys(relay.get("acked_by_shard", []))
    delivered = fl.ack_keys(relay.get("acked_delivered", []))
    tokens = {(str(i), int(f), int(r)): int(n) for i, f, r, n in relay.get("tokens", [])}
    fragments = 2 * setup.shards
    t0, end = raw["t0"], raw["t0"] + setup.duration_s
    in_window = fl.ack_keys(a for a in relay.get("acked_by_shard", []) if t0 <= float(a[-1]) <= end)
    status = raw["status"]
    applied = sum(st.get("accepted", 0) for st in status)
    recovery = _recovery(raw, faults, t0)
    rounds = sorted(r for rows in raw["rows"].values() for r in round_ends(rows))
    typical = typical_round_s(rounds, t0 + setup.duration_s / 2)
    spans = [  # a fault never recovered from spans the rest of the run
        (
            t0 + r["at_s"],
            (end if r["recovery_s"] is None else t0 + r["end_s"] + r["recovery_s"]) + typical,
        )
        for r in recovery
    ]
    lost = lost_time(raw["rows"], credited_tokens({"shards": status}), t0, end, spans)
    for entry, seconds in zip(recovery, lost["faults"], strict=True):
        entry["lost_island_s"] = seconds
    # a shard's outage (kill to its first step after the restart) stops its fragments by
    # design; uptime under the island and link faults is judged outside those spans
    outages = [
        (t0 + r["at_s"], t0 + r["end_s"] + (r["recovery_s"] or 0.0))
        for r in recovery
        if r["kind"] == "kill_shard"
    ]
    quorum = raw.get("settings", {}).get("quorum", 1)
    versions = {int(f): [tuple(p) for p in ps] for f, ps in raw.get("fragments", {}).items()}
    pushes: dict[int, dict[str, list[float]]] = {}
    for island, fragment, _round, t in sorted(relay.get("pushed", []), key=lambda p: p[-1]):
        pushes.setdefault(int(fragment), {}).setdefault(str(island), []).append(float(t))
    timeline = raw.get("timeline", [])
    return {
        "goodput": goodput(lost["useful_tokens"], lost["capacity_tokens"]),
        "capacity_tokens": lost["capacity_tokens"],
        "uptime": step_uptime(versions, pushes, rounds, t0, end, quorum),
        "uptime_outside_shard_outages": step_uptime(
            versions, pushes, rounds, t0, end, quorum, exclude=outages
        ),
        "uptime_windowed": uptime(timeline, window_s, t0, end) if timeline else None,
        "uptime_windowed_outside_shard_outages": (
            uptime(timeline, window_s, t0, end, exclude=outages) if timeline else None
        ),
        "deltas_acked": len(acked),
        "deltas_applied": applied,
        "deltas_acked_delivered": len(delivered),
        "deltas_acked_in_window": len(in_window),
        "acked_equals_applied": len(acked) == applied,
        "shard_duplicates": sum(st.get("duplicates", 0) for st in status),
        "shard_rejected": sum_counts([st.get("rejected", {}) for st in status]),
        "shard_errors": [st["error"] for st in status if "error" in st],
        "useful_tokens": lost["useful_tokens"],
        "acked_tokens_in_window": fl.useful_tokens(in_window, tokens, fragments),
        "trained_tokens_in_window": lost["trained_tokens"],
        "island_rates": lost["rates"],
        "lost_island_s": {
            "total": lost["total"],
            "in_faults": round(sum(lost["faults"]), 3),
            "by_kind": _by_kind(recovery),
            "outside_faults": round(lost["total"] - sum(lost["faults"]), 3),
            "trained_not_credited": lost["not_credited"],
        },
        "final_eval_loss": raw["final_eval_loss"],
        "soak": soak.soak_summary(
            {
                n: [tuple(p) for p in ps]
                for n, ps in raw.get("resources", {}).get("rss", {}).items()
            },
            {
                n: [tuple(p) for p in ps]
                for n, ps in raw.get("resources", {}).get("dirs", {}).items()
            },
            t0,
            setup.duration_s,
        ),
        "faults": recovery,
        "faults_fired": sum(1 for r in recovery if r["fired"]),
        "errors": [e["error"] for e in raw["events"] if "error" in e],
    }


def report(
    raw_free: dict[str, Any] | None,
    raw_chaos: dict[str, Any],
    schedule: list[fl.Fault],
    setup: Any,
) -> dict[str, Any]:
    """The chaos report of both runs, with the issue's targets (pure).

    Args:
        raw_free: the fault-free run's raw material; None when only the faulted run
            ran (`--faulted-only`, a soak): the uptime window is then the faulted
            run's own two median rounds, and the figures that compare the runs (the
            loss ratio, the fault-free goodput) are None.
        raw_chaos: the faulted run's.
        schedule: the faulted run's faults.
        setup: the runs' shape.

    Returns:
        JSON-ready dict: setup, uptime_window_s, schedule, runs (fault_free, faulted:
        `summarize`; faulted only without `raw_free`), final_loss_ratio, targets.
    """
    window = round_window((raw_free or raw_chaos)["rows"])
    free = summarize(raw_free, [], setup, window) if raw_free is not None else None
    chaos = summarize(raw_chaos, schedule, setup, window)
    ratio = (
        chaos["final_eval_loss"] / free["final_eval_loss"]
        if free and chaos["final_eval_loss"] and free["final_eval_loss"]
        else None
    )
    runs = (free, chaos) if free is not None else (chaos,)
    return {
        "setup": dict(setup.__dict__),
        "uptime_window_s": window,
        "schedule": [f.to_json() for f in schedule],
        "runs": {"fault_free": free, "faulted": chaos} if free else {"faulted": chaos},
        "final_loss_ratio": ratio,
        "targets": {
            "uptime_1_with_island_faults": chaos["uptime_outside_shard_outages"],
            "acked_equals_applied": all(r["acked_equals_applied"] for r in runs),
            "goodput_at_least_0.9": (chaos["goodput"] or 0) >= 0.9,
            "goodput_at_least_0.95": (chaos["goodput"] or 0) >= 0.95,
            "fault_free_goodput_at_least_0.98": None
            if free is None
            else (free["goodput"] or 0) >= 0.98,
            "final_loss_within_1pct": None if free is None else ratio is not None and ratio <= 1.01,
            # None: the run was too short to fit (see bench.soak)
            "rss_slope_under_1mb_per_10min": _all([r["soak"]["rss_met"] for r in runs]),
            "wal_and_checkpoints_bounded": _all([r["soak"]["dirs_bounded"] for r in runs]),
        },
    }


def _all(flags: list[bool | None]) -> bool | None:
    return None if None in flags else all(flags)


def _recovery(raw: dict[str, Any], faults: list[fl.Fault], t0: float) -> list[dict[str, Any]]:
    """Each fault as JSON with whether it fired and its recovery time."""
    relay = raw["relay"]
    deliveries: dict[str, list[float]] = {}
    for island, _f, _r, t in relay.get("acked_delivered", []):
        deliveries.setdefault(str(island), []).append(float(t))
    out = []
    for f in faults:
        if f.kind == "kill_shard":
            progress = raw["advances"].get(int(f.target.split("-")[1]), [])
            progress = progress or raw["advances"].get(f.target.split("-")[1], [])
        else:
            progress = deliveries.get(f.target, [])
        rec = fl.recovery_s(t0 + f.end_s, progress)
        key = f"{f.kind}@{f.at_s}"
        fired = (
            raw["fired_harness"].get(key, False)
            if f.kind in fl.HARNESS_KINDS
            else relay.get("fired", {}).get(key, 0) > 0
        )
        out.append(
            {
                **f.to_json(),
                "end_s": f.end_s,
                "fired": fired,
                "recovery_s": None if rec is None else round(rec, 3),
            }
        )
    return out


def _by_kind(recovery: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in recovery:
        out[r["kind"]] = round(out.get(r["kind"], 0.0) + r["lost_island_s"], 3)
    return out


def round_ends(rows: Rows) -> list[tuple[float, float]]:
    """(end time, seconds) of every round an island's processes recorded.

    Args:
        rows: the island's metrics rows (restarts included), in the order written.

    Returns:
        The rounds, sorted by end time.
    """
    return sorted((float(r["wall"]), float(r["round_s"])) for r in rows if "round_s" in r)


def cumulative_tokens(rows: Rows) -> list[tuple[float, float]]:
    """(time, tokens trained so far) of an island over its restarts.

    A restarted process counts its tokens from 0 again; its rows are added to
    what the earlier processes trained.

    Args:
        rows: the island's metrics rows, in the order written.

    Returns:
        (wall, cumulative tokens) per row that carries tokens.
    """
    out, before, prev = [], 0.0, 0.0
    for r in rows:
        if "tokens" not in r:
            continue
        if r["tokens"] < prev:  # a restarted process
            before += prev
        prev = float(r["tokens"])
        out.append((float(r["wall"]), before + prev))
    return out


def _tokens_at(curve: list[tuple[float, float]], t: float) -> float:
    i = bisect.bisect_right(curve, (t, float("inf")))
    return curve[i - 1][1] if i else 0.0


def training_rounds(rows: Rows) -> list[tuple[float, float, float, float]]:
    """(end time, seconds, tokens, inner-step seconds) of each training round (not a process's first).

    A process's first round compiles and is left out. The inner-step seconds are
    the round's part of the island's `work_s` (the caller's time between `step`
    calls: not the session's exchange, pushes or waits inside `step`); rows
    without `work_s` (older islands) count the whole round.

    Args:
        rows: the island's metrics rows (restarts included).

    Returns:
        One entry per round row after each process's first round.
    """
    out, prev, prev_work = [], 0, 0.0
    for r in rows:
        if "round_s" not in r or "tokens" not in r:
            continue
        restarted = r["tokens"] < prev
        tokens = r["tokens"] if restarted else r["tokens"] - prev
        prev = r["tokens"]
        work = r.get("work_s")
        if work is None:
            work_s = float(r["round_s"])
        else:
            work_s = float(work) if restarted else float(work) - prev_work
            prev_work = float(work)
        if r.get("round", 0) > 1:
            out.append((float(r["wall"]), float(r["round_s"]), float(tokens), work_s))
    return out


PACE_WINDOW_S = 30.0  # an island's pace at t: its clean rounds ending within this of t
PACE_MIN_ROUNDS = 5  # fewer there: its pace over the whole run
STEP_S = 0.5  # integration step of the capacity


class Pace:
    """An island's training pace around a time, from its rounds clear of the faults.

    The machine's speed drifts (other work beside the run), so the tokens an
    island could have trained during a fault are counted at its pace around
    that time: tokens over inner-step seconds of its clean rounds ending within
    `window_s` of it (at least PACE_MIN_ROUNDS of them, else its pace over the
    whole run).
    """

    def __init__(self, clean: Sequence[tuple[float, float, float]], window_s: float) -> None:
        """Args:
        clean: (end time, inner-step seconds, tokens) of the island's rounds no fault
            slowed, sorted.
        window_s: half-width of the window around a time.
        """
        self.ends = [e for e, _s, _n in clean]
        self.window_s = window_s
        self.seconds, self.tokens = [0.0], [0.0]
        for _e, s, n in clean:
            self.seconds.append(self.seconds[-1] + s)
            self.tokens.append(self.tokens[-1] + n)
        whole = fl.training_rate([(n, s) for _e, s, n in clean])
        self.overall = whole or 0.0

    def at(self, t: float) -> float:
        """Tokens per second around `t`."""
        i = bisect.bisect_left(self.ends, t - self.window_s)
        j = bisect.bisect_right(self.ends, t + self.window_s)
        seconds = self.seconds[j] - self.seconds[i]
        if j - i < PACE_MIN_ROUNDS or seconds <= 0:
            return self.overall
        return (self.tokens[j] - self.tokens[i]) / seconds

    def tokens_between(self, a: float, b: float) -> float:
        """Tokens the island could have trained over [a, b] at its pace (midpoint rule)."""
        if b <= a:
            return 0.0
        steps = max(1, round((b - a) / STEP_S))
        width = (b - a) / steps
        return sum(self.at(a + (k + 0.5) * width) * width for k in range(steps))


def lost_time(
    rows: dict[str, Rows],
    credited: dict[str, float],
    t0: float,
    end: float,
    spans: Sequence[tuple[float, float]],
    window_s: float = PACE_WINDOW_S,
) -> dict[str, Any]:
    """Goodput's terms and where the islands' time went (pure).

    An island's capacity is what it could have trained over [t0, its stop] (its
    last row, at least `end`) at its `Pace` (its rounds ending after t0 clear of
    `spans`); its useful tokens are its credit less what it trained before t0.

    Args:
        rows: island -> its metrics rows.
        credited: island -> tokens the shards credited after the final merges.
        t0: the window's start.
        end: the window's end.
        spans: (from, to) of each fault, extended by its recovery and a round.
        window_s: the pace's half-window.

    Returns:
        dict: useful_tokens, capacity_tokens, trained_tokens (in the window), rates
        (island -> tokens/s over its clean rounds), total (island-seconds of the
        window not spent on useful work), faults (island-seconds lost in each span:
        its length times the share of its capacity there not trained; negative when
        an island ran faster while another was down) and not_credited
        (island-seconds of work trained but never credited).
    """
    useful = capacity = trained = total = not_credited = 0.0
    rates: dict[str, float] = {}
    per_fault = [0.0] * len(spans)
    for island, island_rows in rows.items():
        every = [r for r in training_rounds(island_rows) if r[0] > t0]  # not the warm-up's
        clean = [r for r in every if not any(r[0] - r[1] < b and r[0] > a for a, b in spans)]
        # the pace is tokens per inner-step second: time inside `step` (exchange, pushes,
        # back-pressure, merge waits) is not training, so it counts as lost, not as pace
        pace = Pace([(end, work, n) for end, _s, n, work in clean or every], window_s)
        curve = cumulative_tokens(island_rows)
        if not pace.overall or not curve:
            continue
        rates[island] = round(pace.overall, 1)
        stop = max(end, curve[-1][0])
        before = _tokens_at(curve, t0)
        mine = max(0.0, credited.get(island, 0.0) - before)
        done = curve[-1][1] - before
        could = pace.tokens_between(t0, stop)
        useful += mine
        capacity += could
        trained += done
        total += (stop - t0) * (1.0 - mine / could)
        not_credited += (stop - t0) * max(0.0, done - mine) / could
        for k, (a, b) in enumerate(spans):
            there = pace.tokens_between(max(a, t0), min(b, stop))
            got = _tokens_at(curve, b) - _tokens_at(curve, a)
            per_fault[k] += (min(b, stop) - max(a, t0)) * (1.0 - got / there) if there else 0.0
    return {
        "useful_tokens": useful,
        "capacity_tokens": capacity,
        "trained_tokens": trained,
        "rates": rates,
        "total": round(total, 3),
        "faults": [round(x, 3) for x in per_fault],
        "not_credited": round(not_credited, 3),
    }


def round_window(rows: dict[str, list[dict[str, Any]]]) -> float:
    """The fixed window of `uptime_windowed`: two median rounds of `rows` (2 s without rounds).

    The fault-free run's rows; the faulted run's own when it ran alone (`--faulted-only`).
    """
    times = [r["round_s"] for rs in rows.values() for r in rs if "round_s" in r]
    return 2.0 * statistics.median(times) if times else 2.0
