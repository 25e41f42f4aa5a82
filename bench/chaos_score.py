"""Scoring a chaos run (pure): goodput, uptime, acked vs applied deltas, recovery per fault.

`bench.chaos` runs the daemons and collects raw material (relay statistics,
shard status, metrics rows, the version timeline); this module turns it into
the report's numbers. Goodput is the share of the islands' time spent on inner
steps whose work entered the model: the tokens the shards credited after the
final merges (staleness not counted) over what the islands would have trained in
the window at their own median round rate.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench import faults as fl
from bench.analysis import credited_tokens, sum_counts, uptime
from worker.goodput import goodput


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
        window_s: uptime window.

    Returns:
        JSON-ready dict with goodput, uptime, deltas_acked, deltas_applied,
        final_eval_loss, recovery per fault and the fault counts.
    """
    relay = raw["relay"]
    acked = fl.ack_keys(relay.get("acked_by_shard", []))
    delivered = fl.ack_keys(relay.get("acked_delivered", []))
    tokens = {(str(i), int(f), int(r)): int(n) for i, f, r, n in relay.get("tokens", [])}
    fragments = 2 * setup.shards
    t0, end = raw["t0"], raw["t0"] + setup.duration_s
    in_window = fl.ack_keys(a for a in relay.get("acked_by_shard", []) if t0 <= float(a[-1]) <= end)
    acked_tokens = fl.useful_tokens(in_window, tokens, fragments)
    status = raw["status"]
    # tokens that entered the model: the shards' credit (merged tokens, staleness not
    # counted) after the final merges; a rejected or never-merged delta counts 0
    useful = sum(credited_tokens({"shards": status}).values())
    applied = sum(st.get("accepted", 0) for st in status)
    deliveries: dict[str, list[float]] = {}
    for island, _f, _r, t in relay.get("acked_delivered", []):
        deliveries.setdefault(str(island), []).append(float(t))
    recovery = []
    for f in faults:
        if f.kind == "kill_shard":
            progress = raw["advances"].get(int(f.target.split("-")[1]), [])
        else:
            progress = deliveries.get(f.target, [])
        rec = fl.recovery_s(t0 + f.end_s, progress)
        key = f"{f.kind}@{f.at_s}"
        fired = (
            raw["fired_harness"].get(key, False)
            if f.kind in fl.HARNESS_KINDS
            else relay.get("fired", {}).get(key, 0) > 0
        )
        recovery.append(
            {**f.to_json(), "fired": fired, "recovery_s": None if rec is None else round(rec, 3)}
        )
    up = uptime(raw["timeline"], window_s, t0, end) if raw["timeline"] else None
    # a shard's outage (kill to its first step after the restart) stops its fragments by
    # design; uptime under the island and link faults is judged outside those spans
    outages = [
        (t0 + r["at_s"], t0 + r["at_s"] + r["duration_s"] + (r["recovery_s"] or 0.0))
        for r in recovery
        if r["kind"] == "kill_shard"
    ]
    up_islands = (
        uptime(raw["timeline"], window_s, t0, end, exclude=outages) if raw["timeline"] else None
    )
    capacity = setup.duration_s * sum(
        fl.training_rate(_round_samples(rows)) or 0.0 for rows in raw["rows"].values()
    )
    return {
        "goodput": goodput(useful, capacity),
        "capacity_tokens": capacity,
        "uptime": up,
        "uptime_outside_shard_outages": up_islands,
        "deltas_acked": len(acked),
        "deltas_applied": applied,
        "deltas_acked_delivered": len(delivered),
        "deltas_acked_in_window": len(in_window),
        "acked_equals_applied": len(acked) == applied,
        "shard_duplicates": sum(st.get("duplicates", 0) for st in status),
        "shard_rejected": sum_counts([st.get("rejected", {}) for st in status]),
        "shard_errors": [st["error"] for st in status if "error" in st],
        "useful_tokens": useful,
        "acked_tokens_in_window": acked_tokens,
        "trained_tokens_in_window": trained_in_window(raw, setup),
        "final_eval_loss": raw["final_eval_loss"],
        "faults": recovery,
        "faults_fired": sum(1 for r in recovery if r["fired"]),
        "errors": [e["error"] for e in raw["events"] if "error" in e],
    }


def _round_samples(rows: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(tokens, seconds) of each training round an island recorded (restarts included)."""
    out, prev = [], 0
    for r in rows:
        if "round_s" not in r or "tokens" not in r:
            continue
        tokens = r["tokens"] - prev if r["tokens"] >= prev else r["tokens"]
        prev = r["tokens"]
        if r.get("round", 0) > 1:  # a process's first round includes compiling
            out.append((float(tokens), float(r["round_s"])))
    return out


def trained_in_window(raw: dict[str, Any], setup: Any) -> float:
    """Tokens the islands trained within the measured window (from their metrics rows).

    Args:
        raw: what `ChaosRun.run` returned.
        setup: the run's shape.

    Returns:
        Sum over islands of tokens at the window's end minus tokens at its start
        (a restarted island's counter starts again from 0: its rows after the
        restart are counted from there).
    """
    t0, end = raw["t0"], raw["t0"] + setup.duration_s
    total = 0.0
    for rows in raw["rows"].values():
        prev, start_tokens = 0, None
        for r in rows:
            if "tokens" not in r or r["wall"] > end:
                continue
            if r["tokens"] < prev:  # a restarted process
                total += prev - (start_tokens or 0)
                start_tokens = 0
            if r["wall"] <= t0:
                start_tokens = r["tokens"]
            prev = r["tokens"]
        total += prev - (start_tokens or 0)
    return total


def round_window(rows: dict[str, list[dict[str, Any]]]) -> float:
    """The uptime window: two median rounds of the fault-free run (2 s without rounds)."""
    times = [r["round_s"] for rs in rows.values() for r in rs if "round_s" in r]
    return 2.0 * statistics.median(times) if times else 2.0
