"""The regions comparison's arithmetic: the link scale that matches a 12B model, and the claims table (pure).

The scaling rule. DDP's communication time per step over its compute time
per step is what makes it slow on a WAN; the run keeps that ratio equal to
the one of a big model on the real links:

    ratio_big  = (ref_bytes_per_param  x P_big  x 8 / rate_real) / t_big
    ratio_run  = (run_bytes_per_param  x P_run  x 8 / rate_emul)  / t_run
    ratio_run == ratio_big  <=>
    scale = rate_emul / rate_real
          = (run_bytes_per_param x P_run / t_run) / (ref_bytes_per_param x P_big / t_big)

The reference is generous to DDP: bf16 gradients in a ring all-reduce, so
each rank sends (and receives) 2 (N-1)/N x 2 bytes per parameter per step
(3 for N = 4). The run's DDP (`bench.children.ddp_rank`) sends the fp32
gradient up to one reducer and gets the fp32 mean back: 8 bytes per
parameter per step over the same link. t is the compute time of one step
on the fastest chips (speed 1.0); the slower regions scale both alike.

The claims: each method's wall-clock time to a target held-out loss, its
speed-up over DDP, and its loss at DDP's final token count against DDP's
final loss. Every flag is `met` only when the measured figure is present and
on the right side of its target.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bench import analysis

SPEEDUP_TARGET = 20.0
LOSS_TOLERANCE = 0.01
RUN_BYTES_PER_PARAM = 8.0  # fp32 gradient up to the reducer, fp32 mean back
BIG_PARAMS = 12e9
BIG_STEP_S = 1.0
REFERENCE_GBIT = 2.0  # DDP's step waits for the slowest link to its reducer


def ring_bytes_per_param(world: int, bytes_per_value: float = 2.0) -> float:
    """Bytes per parameter each rank sends per step in a ring all-reduce.

    Args:
        world: ranks.
        bytes_per_value: bytes of one gradient entry (bf16: 2).

    Returns:
        2 (world - 1) / world x bytes_per_value.
    """
    return 2.0 * (world - 1) / world * bytes_per_value


def comm_compute_ratio(bytes_per_step: float, rate_mbit: float, step_s: float) -> float:
    """Communication time of one step over its compute time.

    Args:
        bytes_per_step: bytes one rank moves over its link per step.
        rate_mbit: the link's rate, Mbit/s.
        step_s: compute seconds per step.

    Returns:
        (bytes x 8 / rate) / step_s.
    """
    return bytes_per_step * 8.0 / (rate_mbit * 1e6) / step_s


def link_scale(
    run_params: float,
    run_step_s: float,
    world: int,
    big_params: float = BIG_PARAMS,
    big_step_s: float = BIG_STEP_S,
    run_bytes_per_param: float = RUN_BYTES_PER_PARAM,
) -> float:
    """The factor on every real link rate that gives the run the big model's comm/compute ratio.

    Args:
        run_params: parameters of the model the run trains.
        run_step_s: its compute seconds per step at speed 1.0.
        world: DDP ranks (the reference ring's size).
        big_params: the reference model's parameters.
        big_step_s: its compute seconds per step at speed 1.0 (the stated assumption).
        run_bytes_per_param: bytes per parameter the run's DDP moves per step.

    Returns:
        rate_emulated / rate_real.
    """
    run_rate = run_bytes_per_param * run_params / run_step_s
    big_rate = ring_bytes_per_param(world) * big_params / big_step_s
    return run_rate / big_rate


def method_summary(record: Mapping[str, Any], target_loss: float) -> dict[str, Any]:
    """One method's figures from its run record (`bench.run_record.summarize`).

    Args:
        record: the run record (eval_curve: [seconds, tokens, loss] points).
        target_loss: the held-out loss to reach.

    Returns:
        {"time_to_target_s", "tokens_to_target", "final_loss", "final_tokens", "duration_s"}.
    """
    curve = [tuple(p) for p in record.get("eval_curve", [])]
    reach = analysis.first_reach(curve, target_loss) if curve else None
    last = max(curve, key=lambda p: p[1]) if curve else None
    return {
        "time_to_target_s": None if reach is None else round(reach[0], 3),
        "tokens_to_target": None if reach is None else round(reach[1]),
        "final_loss": None if last is None else last[2],
        "final_tokens": None if last is None else last[1],
        "duration_s": record.get("duration_s"),
    }


def loss_at_tokens(curve: Sequence[Sequence[float]], tokens: float) -> float | None:
    """A curve's loss at `tokens`, interpolated; None when the curve stops short of them.

    Args:
        curve: [seconds, tokens, loss] points.
        tokens: the token count.

    Returns:
        Loss, or None.
    """
    if not curve or max(p[1] for p in curve) < tokens:
        return None
    return analysis.loss_at(curve, tokens, axis=1)


def target_from_ddp(ddp_final_loss: float, tolerance: float = LOSS_TOLERANCE) -> float:
    """The default target: DDP's final held-out loss relaxed by the quality tolerance."""
    return ddp_final_loss * (1.0 + tolerance)


def claims(
    records: Mapping[str, Mapping[str, Any]],
    target_loss: float,
    speedup_target: float = SPEEDUP_TARGET,
    loss_tolerance: float = LOSS_TOLERANCE,
) -> dict[str, Any]:
    """The claims table: per DiLoCo method, speed-up to target over DDP and loss at equal tokens.

    Args:
        records: run records by method ("ddp", "sync", "quorum").
        target_loss: the held-out loss every method trains to.
        speedup_target: required DDP time / method time to target.
        loss_tolerance: allowed relative excess of the method's loss over DDP's at equal tokens.

    Returns:
        {"target_loss", "methods": {name: summary}, "rows": [claim rows], "all_met"}.
        A row: {"method", "claim", "target", "measured", "met", "why"}.
    """
    summaries = {name: method_summary(rec, target_loss) for name, rec in records.items()}
    ddp = summaries.get("ddp")
    rows: list[dict[str, Any]] = []
    for name in (n for n in records if n != "ddp"):
        mine = summaries[name]
        t_ddp = ddp["time_to_target_s"] if ddp else None
        t_mine = mine["time_to_target_s"]
        speedup = t_ddp / t_mine if t_ddp is not None and t_mine else None
        why = None
        if ddp is None:
            why = "no DDP run"
        elif t_ddp is None:
            why = "DDP did not reach the target"
        elif t_mine is None:
            why = f"{name} did not reach the target"
        rows.append(
            {
                "method": name,
                "claim": f"time to loss {target_loss:.4f}: DDP / {name} >= {speedup_target:g}x",
                "target": speedup_target,
                "measured": None if speedup is None else round(speedup, 3),
                "met": speedup is not None and speedup >= speedup_target,
                "why": why,
            }
        )
        ddp_tokens = ddp["final_tokens"] if ddp else None
        at_equal = (
            loss_at_tokens(records[name].get("eval_curve", []), ddp_tokens)
            if ddp_tokens is not None
            else None
        )
        excess = (
            at_equal / ddp["final_loss"] - 1.0
            if at_equal is not None and ddp and ddp["final_loss"]
            else None
        )
        why = None
        if ddp is None or ddp["final_loss"] is None:
            why = "no DDP final loss"
        elif at_equal is None:
            why = f"{name} stopped short of DDP's {ddp_tokens:.0f} tokens"
        rows.append(
            {
                "method": name,
                "claim": f"loss at DDP's final tokens within {loss_tolerance:.0%} of DDP's",
                "target": loss_tolerance,
                "measured": None if excess is None else round(excess, 5),
                "loss_at_equal_tokens": at_equal,
                "ddp_final_loss": ddp["final_loss"] if ddp else None,
                "met": excess is not None and excess <= loss_tolerance,
                "why": why,
            }
        )
    return {
        "target_loss": target_loss,
        "methods": summaries,
        "rows": rows,
        "all_met": bool(rows) and all(r["met"] for r in rows),
    }


def render_markdown(compare: Mapping[str, Any]) -> str:
    """The comparison's claims table and per-method figures as Markdown.

    Args:
        compare: the report's "compare" part (`bench.regions_compare.compare`).

    Returns:
        Markdown text.
    """
    table = compare["claims"]
    scaling = compare["scaling"]
    lines = [
        "# Regions: DDP vs synchronous DiLoCo vs this system over the emulated WAN",
        "",
        f"Target held-out loss: {_num(compare['target_loss'])} ({compare['target_rule']}).",
        f"Link scale {scaling['scale_after_probe']:.4g} "
        f"(slowest DDP link {scaling['slowest_ddp_link_mbit']:g} Mbit/s); "
        f"target DDP comm/compute at 2 Gbit/s {scaling['target_ratio_at_2gbit']:g}, "
        f"measured {_num((compare.get('ddp_measured') or {}).get('comm_over_compute'))}.",
        "",
        "| claim | method | target | measured | met |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in table["rows"]:
        why = f" ({row['why']})" if row.get("why") else ""
        lines.append(
            f"| {row['claim']} | {row['method']} | {row['target']:g} | "
            f"{_num(row['measured'])}{why} | {'met' if row['met'] else 'not met'} |"
        )
    lines += ["", "| method | time to target s | tokens to target | final loss | final tokens |",
              "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, s in table["methods"].items():
        lines.append(
            f"| {name} | {_num(s['time_to_target_s'])} | {_num(s['tokens_to_target'])} | "
            f"{_num(s['final_loss'])} | {_num(s['final_tokens'])} |"
        )
    return "\n".join(lines) + "\n"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"
