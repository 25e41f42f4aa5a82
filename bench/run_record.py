"""A scenario run's JSON record, from the raw material `bench.runs` collected.

Pure: per-island bytes and goodput, the eval curve, uptime and the final loss,
all from the islands' metrics rows, the version timeline and the final eval.
The records are what `bench.claims`, `bench.projection` and the reports read.
"""

from __future__ import annotations

from typing import Any

from bench import analysis
from bench.scenarios import Budget, Scenario


def summarize(scenario: Scenario, budget: Budget, raw: dict[str, Any]) -> dict[str, Any]:
    """The run's JSON record from its raw material.

    Args:
        scenario: the run.
        budget: shared settings.
        raw: what `run_diloco` / `run_ddp` returned.

    Returns:
        JSON-ready dict: per-island bytes and goodput, eval curve, uptime, final loss.
    """
    rows = raw["rows"]
    t0 = analysis.start_time(rows)
    curve = analysis.eval_curve(rows)
    final = raw.get("final_eval") or {}
    server = raw.get("server") or {}
    credited = analysis.credited_tokens(server)
    islands = {}
    for (name, rs), (speed, jitter) in zip(
        rows.items(), scenario.speeds(budget.islands), strict=True
    ):
        last_goodput = next((r["goodput"] for r in reversed(rs) if "goodput" in r), None)
        if name in credited:  # the shards' word after the final merges
            last_goodput = analysis.final_goodput(rs, credited[name])
        islands[name] = {
            "speed": speed,
            "jitter": jitter,
            **analysis.island_bytes(rs),
            "bytes_per_token": analysis.bytes_per_token(rs),
            "goodput": last_goodput,
            "final_train_loss": next((r["loss"] for r in reversed(rs) if "loss" in r), None),
            "round_s_median": _median([r["round_s"] for r in rs if "round_s" in r]),
            "step_s": next((r["step_s"] for r in reversed(rs) if r.get("step_s")), None),
            "wait_s": next((r["wait_s"] for r in reversed(rs) if "wait_s" in r), 0.0),
        }
    timeline = [(w - t0, v) for w, v in raw["timeline"]]
    stopped = raw["stopped_at"] - t0
    tokens_total = sum(i["tokens"] for i in islands.values())
    if "eval_loss" in final:  # the final point: every acked delta merged, all tokens in
        curve.append((stopped, tokens_total, float(final["eval_loss"])))
    record: dict[str, Any] = {
        "name": scenario.name,
        "method": scenario.method,
        "group": scenario.group,
        "codec": scenario.codec if scenario.method != "ddp" else "float32 gradients",
        "downlink": scenario.downlink if scenario.method != "ddp" else "float32 mean gradient",
        "weighting": scenario.weighting if scenario.method == "quorum" else None,
        "wan": scenario.wan,
        "duration_s": stopped,
        "tokens_total": tokens_total,
        "eval_initial": curve[0][2] if curve else None,
        "eval_final": curve[-1][2] if curve else None,
        "eval_final_versions": final.get("version_sum"),
        "final_eval_error": final.get("error"),
        "eval_curve": [list(p) for p in curve],
        "islands": islands,
        "timeline": [list(p) for p in timeline],
    }
    speeds = dict(zip(rows, scenario.speeds(budget.islands), strict=True))
    window = _median(
        [
            r["round_s"]
            for n, rs in rows.items()
            if speeds[n][0] == 1.0
            for r in rs
            if "round_s" in r
        ]
    )
    if timeline and window:
        base = timeline[0][1]
        first = next((t for t, v in timeline if v > base), None)
        record["uptime_window_s"] = window
        record["uptime"] = (
            analysis.uptime(timeline, window, first, stopped) if first is not None else 0.0
        )
    if server.get("shards"):
        shards = [s for s in server["shards"] if "error" not in s]
        record["server"] = {
            "accepted": sum(s.get("accepted", 0) for s in shards),
            "rejected": sum(sum(s.get("rejected", {}).values()) for s in shards),
            "outer_steps": sum(s.get("steps", 0) for s in shards),
            "staleness_histogram": dict(
                sorted(
                    analysis.sum_counts([s.get("staleness_histogram", {}) for s in shards]).items(),
                    key=lambda kv: int(kv[0]),
                )
            ),
            "credited_tokens": credited,
        }
    return record


def _median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
