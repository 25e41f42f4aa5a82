"""The seed's claims, computed from the run records of one report (pure functions).

This module owns the comparisons: bytes against DDP at equal tokens, final
loss against DDP, time to a target loss on the WAN link, goodput with a slow
island, weighting against plain averaging. Each claim comes back with its
target, the measured value and whether it was met; a claim whose runs were not
made (e.g. in --quick) says so instead of guessing.

Records are what `bench.run_record.summarize` returns, keyed by scenario name.
DDP's loss trajectory does not depend on the link (every rank applies the same
mean gradient), so its time to target on the WAN is measured when its capped
WAN run got there, and otherwise extrapolated from the loopback run's tokens
to target and the WAN run's measured step time (marked "extrapolated").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bench import analysis, render

Records = Mapping[str, Mapping[str, Any]]
DILOCO_METHODS = ("sync", "quorum")


def ddp_bytes_per_token(records: Records) -> float | None:
    """Bytes per token and island of the DDP run at equal tokens (loopback run).

    Args:
        records: run records by name.

    Returns:
        Bytes per token, or None without a "ddp" run.
    """
    ddp = records.get("ddp")
    if not ddp:
        return None
    return analysis.mean([i["bytes_per_token"] for i in ddp["islands"].values()])


def ddp_wan_tokens_per_s(records: Records) -> float | None:
    """Cluster tokens per second of DDP on the WAN link, from its measured median step time.

    Args:
        records: run records by name.

    Returns:
        Tokens per second, or None without a "ddp-wan" run that finished two steps.
    """
    run = records.get("ddp-wan")
    if not run:
        return None
    steps = [i["step_s"] for i in run["islands"].values() if i.get("step_s")]
    if not steps:
        return None
    per_step = sum(i["tokens"] / max(i["steps"], 1) for i in run["islands"].values())
    return per_step / max(steps)


def bytes_vs_ddp(record: Mapping[str, Any], ddp_per_token: float) -> dict[str, float]:
    """A run's bytes per island against DDP's for the same tokens.

    Args:
        record: a DiLoCo run record.
        ddp_per_token: DDP bytes (sent + received) per token and island.

    Returns:
        dict: bytes per island (mean, totals with the join), DDP bytes for the
        same tokens, their ratio, and the steady-state ratio without the join.
    """
    islands = list(record["islands"].values())
    actual = analysis.mean([i["bytes_sent"] + i["bytes_received"] for i in islands]) or 0.0
    ddp = analysis.mean([ddp_per_token * i["tokens"] for i in islands]) or 0.0
    steady = analysis.mean(
        [
            ddp_per_token * i["tokens"] / i["rounds"] / (i["up_per_round"] + i["down_per_round"])
            for i in islands
            if i["rounds"] and i["up_per_round"] + i["down_per_round"] > 0
        ]
    )
    return {
        "bytes_per_island": actual,
        "ddp_bytes_same_tokens": ddp,
        "ddp_over_this": ddp / actual if actual else None,
        "ddp_over_this_steady": steady,
    }


def target_loss(records: Records) -> float | None:
    """The target eval loss: the worst final loss among DDP, sync and quorum (all reach it).

    Args:
        records: run records by name.

    Returns:
        The loss, or None when none of those runs was made.
    """
    finals = [
        records[n]["eval_final"]
        for n in ("ddp", "sync", "quorum")
        if n in records and records[n].get("eval_final") is not None
    ]
    return max(finals) if finals else None


def time_to_target(records: Records, target: float) -> dict[str, dict[str, Any]]:
    """Seconds and tokens to reach `target` for every run (DDP on WAN possibly extrapolated).

    Args:
        records: run records by name.
        target: the eval loss.

    Returns:
        name -> {"seconds", "tokens", "extrapolated"} (seconds None if never reached).
    """
    out: dict[str, dict[str, Any]] = {}
    for name, rec in records.items():
        hit = analysis.first_reach([tuple(p) for p in rec.get("eval_curve", [])], target)
        out[name] = {
            "seconds": hit[0] if hit else None,
            "tokens": hit[1] if hit else None,
            "extrapolated": False,
        }
    wan = out.get("ddp-wan")
    lan = out.get("ddp")
    rate = ddp_wan_tokens_per_s(records)
    if wan is not None and wan["seconds"] is None and lan and lan["tokens"] is not None and rate:
        out["ddp-wan"] = {
            "seconds": lan["tokens"] / rate,
            "tokens": lan["tokens"],
            "extrapolated": True,
        }
    return out


def evaluate(records: Records) -> dict[str, Any]:
    """Every comparison of the report.

    Args:
        records: run records by scenario name.

    Returns:
        JSON-ready dict: target loss, time to target per run, bytes against DDP
        per DiLoCo run, loss against DDP, goodput and uptime per run, and the
        list of claims with target / measured / met.
    """
    per_token = ddp_bytes_per_token(records)
    target = target_loss(records)
    ttt = time_to_target(records, target) if target is not None else {}
    ddp_final = records["ddp"]["eval_final"] if "ddp" in records else None
    runs: dict[str, Any] = {}
    for name, rec in records.items():
        row: dict[str, Any] = {
            "eval_final": rec.get("eval_final"),
            "loss_vs_ddp": render.rel(rec.get("eval_final"), ddp_final),
            "time_to_target_s": ttt.get(name, {}).get("seconds"),
            "time_to_target_extrapolated": ttt.get(name, {}).get("extrapolated", False),
            "goodput": {n: i["goodput"] for n, i in rec["islands"].items()},
            "uptime": rec.get("uptime"),
        }
        if rec["method"] in DILOCO_METHODS and per_token:
            row.update(bytes_vs_ddp(rec, per_token))
        runs[name] = row
    claims = []
    q, wan = runs.get("quorum"), ttt.get("ddp-wan")
    if q and "ddp_over_this" in q:
        ratio, loss = q["ddp_over_this"], q["loss_vs_ddp"]
        claims.append(
            render.claim(
                "bytes vs DDP at equal tokens (quorum, int8), eval loss within 1%",
                ">= 1000x fewer, loss diff within 1%",
                {"ddp_over_this": ratio, "steady_state": q["ddp_over_this_steady"],
                 "loss_vs_ddp": loss},
                bool(ratio and ratio >= 1000 and loss is not None and abs(loss) <= 0.01),
            )
        )  # fmt: skip
    if q and wan and wan["seconds"] and q["time_to_target_s"]:
        speedup = wan["seconds"] / q["time_to_target_s"]
        claims.append(
            render.claim(
                "time to target loss vs DDP on the WAN link",
                ">= 20x faster",
                {"speedup": speedup, "ddp_wan_s": wan["seconds"], "quorum_s": q["time_to_target_s"]},
                speedup >= 20,
                "DDP time extrapolated from its measured WAN step time" if wan["extrapolated"] else "",
            )
        )  # fmt: skip
    slow, sync_slow = runs.get("quorum-slow"), runs.get("sync-slow")
    if slow:
        gp = [g for g in slow["goodput"].values() if g is not None]
        claims.append(
            render.claim(
                "goodput with one island 2x slower (quorum)",
                ">= 95% on every island",
                {"quorum_slow": slow["goodput"],
                 "sync_slow": sync_slow["goodput"] if sync_slow else None},
                bool(gp) and min(gp) >= 0.95,
            )
        )  # fmt: skip
    if q and q["loss_vs_ddp"] is not None:
        claims.append(
            render.claim(
                "final eval loss vs DDP (quorum, equal tokens)",
                "within 2%",
                q["loss_vs_ddp"],
                abs(q["loss_vs_ddp"]) <= 0.02,
            )
        )
    uniform = runs.get("quorum-slow-uniform")
    if slow and uniform and slow["eval_final"] is not None and uniform["eval_final"] is not None:
        claims.append(
            render.claim(
                "token x staleness weighting vs plain averaging (2x-slower island)",
                "final loss <= plain averaging's",
                {"weighted": slow["eval_final"], "uniform": uniform["eval_final"]},
                slow["eval_final"] <= uniform["eval_final"],
            )
        )
    claims += _comm_claims(runs) + _sparseloco_claims(runs)
    return {"target_loss": target, "runs": runs, "claims": claims}


def _sparseloco_claims(runs: Mapping[str, Mapping[str, Any]]) -> list[dict]:
    """The issue-22 top-k claim: sync, H=30, 20 rounds, topk within 3% of int8 and >= 1000x."""
    topk, int8 = runs.get("h30-topk"), runs.get("h30-int8")
    if not topk or not int8 or "ddp_over_this" not in topk:
        return []
    ratio, loss = topk["ddp_over_this"], render.rel(topk["eval_final"], int8["eval_final"])
    measured = {
        "ddp_over_this": ratio,
        "steady_state": topk["ddp_over_this_steady"],
        "loss_vs_int8_h30": loss,
        "int8_h30_ddp_over_this": int8.get("ddp_over_this"),
    }
    return [
        render.claim(
            "topk (2%, 2-bit) at H=30, sync: bytes vs DDP over the run, eval loss vs int8",
            ">= 1000x fewer over the run (join included), loss <= int8's + 3%",
            measured,
            bool(ratio and ratio >= 1000 and loss is not None and loss <= 0.03),
            "the whole-run ratio counts the join snapshot; steady_state is per round",
        )
    ]


def _comm_claims(runs: Mapping[str, Mapping[str, Any]]) -> list[dict]:
    """The H=100 communication claim: topk against DDP's bytes and int8's loss at the same H."""
    topk, int8, int4 = runs.get("h100-topk"), runs.get("h100-int8"), runs.get("h100-int4")
    if not topk or "ddp_over_this" not in topk:
        return []
    ratio = topk["ddp_over_this"]
    loss = render.rel(topk["eval_final"], int8["eval_final"]) if int8 else None
    measured = {
        "ddp_over_this": ratio,
        "steady_state": topk["ddp_over_this_steady"],
        "loss_vs_int8_h100": loss,
        "int8_h100_ddp_over_this": int8.get("ddp_over_this") if int8 else None,
        "int4_h100_ddp_over_this": int4.get("ddp_over_this") if int4 else None,
        "int4_h100_loss_vs_int8": render.rel(int4["eval_final"], int8["eval_final"])
        if int4 and int8
        else None,
    }
    met = bool(ratio and ratio >= 1000 and loss is not None and loss <= 0.01)
    return [
        render.claim(
            "bytes vs DDP at equal tokens (topk, H=100), eval loss within 1% of int8 at H=100",
            ">= 1000x fewer over the run, loss <= int8's + 1%",
            measured,
            met,
            "the whole-run ratio counts the join snapshot; steady_state is per round",
        )
    ]
