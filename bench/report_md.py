"""The markdown text of a report: setup, claims, and one table per scenario group.

This module owns the report's text only (tables through `bench.render`); numbers
come from the run records and `bench.claims.evaluate`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bench.common import human_bytes
from bench.render import claims_table, num, pct, table


def render(
    meta: Mapping[str, Any], records: Mapping[str, Mapping[str, Any]], summary: Mapping[str, Any]
) -> str:
    """The report as markdown.

    Args:
        meta: command, date, machine, budget and link description.
        records: run records by scenario name.
        summary: `bench.claims.evaluate` output.

    Returns:
        Markdown text.
    """
    budget, link = meta["budget"], meta["link"]
    lines = [
        "# decoupled-diloco: benchmark report",
        "",
        f"`{meta['command']}` on {meta['date']} ({meta['machine']}); {meta['elapsed_s']:.0f} s.",
        "",
        f"Model `{budget['model']}` ({meta.get('params', '?')} parameters), {budget['islands']} "
        f"islands, batch {budget['batch_size']} x {budget['seq_len']} bytes, H = "
        f"{budget['inner_steps']} inner steps per round, {budget['steps_per_island']} steps per "
        f"island ({budget['tokens']} tokens per run), {budget['shards']} shards. WAN link per "
        f"island: {link['rate_mbit_per_direction']} Mbit/s each way, "
        f"{link['one_way_delay_ms']} ms one way; shaping: {link['shaping']}.",
        "",
        "DDP = the same islands exchanging full fp32 gradients every step through a reducer "
        "(`ddp` on loopback for the loss at equal tokens, `ddp-wan` on the WAN link for its step "
        "time); sync = synchronous DiLoCo; quorum = this system (quorum + grace window, tokens x "
        "staleness weighting unless `uniform`).",
        "",
        "## Claims",
        "",
    ]
    lines += claims_table(summary["claims"])
    target = summary.get("target_loss")
    lines += [
        f"Target loss for time-to-target: {num(target)} nats/byte (the worst final loss of "
        "ddp, sync and quorum, so each of them reaches it).",
        "",
    ]
    groups = {
        "methods": "Methods (homogeneous islands)",
        "codecs": "Delta codecs (quorum, homogeneous islands)",
        "slow": "One island 2x slower",
        "mix": "v6e/v5p-like mix (one island 1.2x slower, 10% step-time jitter)",
        "comm": "Communication at equal tokens (600 steps per island, H in the run name)",
    }
    for group, title in groups.items():
        names = [n for n, r in records.items() if r["group"] == group]
        if group == "codecs":
            names = [n for n in ("quorum", *names) if n in records]
        if not names:
            continue
        lines += [f"## {title}", ""]
        rows = []
        for n in names:
            rec, s = records[n], summary["runs"][n]
            islands = list(rec["islands"].values())
            up = sum(i["up_per_round"] for i in islands) / len(islands)
            down = sum(i["down_per_round"] for i in islands) / len(islands)
            goodput = " / ".join(pct(g) for g in s["goodput"].values())
            rows.append(
                [
                    n,
                    rec["codec"],
                    num(rec["duration_s"], "{:.0f}"),
                    str(rec["tokens_total"]),
                    f"{num(rec['eval_initial'])} -> {num(rec['eval_final'])}",
                    pct(s["loss_vs_ddp"]),
                    num(s["time_to_target_s"], "{:.0f}")
                    + (" (extrap.)" if s["time_to_target_extrapolated"] else ""),
                    f"{human_bytes(up)} / {human_bytes(down)}",
                    human_bytes(s.get("bytes_per_island")),
                    num(s.get("ddp_over_this"), "{:.0f}x"),
                    goodput,
                    pct(s["uptime"]),
                ]
            )
        lines += table(
            ["run", "codec", "time (s)", "tokens", "eval loss", "vs DDP", "time to target (s)",
             "up / down per round", "bytes per island", "DDP bytes / these", "goodput per island",
             "uptime"],
            rows,
        )  # fmt: skip
    lines += _projection_lines(summary.get("projection"))
    lines += [
        "Bytes are counted at the sockets (frame bytes of every message, heartbeats and the "
        "join snapshot included; 'per round' is the steady state after the join). 'DDP bytes / "
        "these' compares with the DDP run's measured bytes per token for the same tokens. "
        "Goodput (Decoupled DiLoCo's): the share of an island's wall time spent on inner steps "
        "whose work entered the model: the tokens the shards merged after the final merges "
        "(staleness not counted: it shows in the loss; rejected or never-merged deltas count "
        "0) over the tokens it could have trained in its wall time at its own step rate; "
        "waiting (sync barrier, back-pressure) counts as lost. "
        "Final eval loss: the global model read from the shards once every island flushed and "
        "every acked delta was merged, on the common held-out set (DDP: rank 0's final "
        "parameters), at equal tokens. "
        "Uptime: share of windows (one median round of a full-speed island) in which some "
        "fragment's version advanced, from the shards' versions polled every second.",
        "",
        "Caveats: runs share 2 CPU cores with whatever else the machine does, so wall-clock "
        "figures of different runs are noisy (+-30% or worse); token-based figures and bytes are "
        "not. Islands and DDP ranks compile before they start, so no run is charged its "
        "compile time; DDP's WAN time to target is extrapolated from its measured step time.",
        "",
        "Plots: loss_vs_wallclock.png, loss_vs_tokens.png, bytes_per_round.png, goodput.png. "
        "One JSON per run in runs/, everything in report.json.",
        "",
    ]
    return "\n".join(lines)


def _projection_lines(proj: Mapping[str, Any] | None) -> list[str]:
    """The bandwidth projection for a 12B model (`bench.projection`), inputs first."""
    if not proj or not proj.get("rows"):
        return []
    inp = proj["inputs"]
    lines = [
        "## Projection: bandwidth per island for a 12B-parameter model",
        "",
        f"Inputs: {inp['projected_params']:.3g} parameters, one inner step per "
        f"{inp['step_s']:g} s, bytes per parameter per round measured on this report's model "
        f"({inp['measured_params']} parameters; up + down, steady state). Formula: "
        f"{inp['formula']}. For comparison: {inp['seed_figure']}.",
        "",
    ]
    rows = [
        [r["run"], str(r["codec"]), str(r["H"]), num(r["bytes_per_param_round"], "{:.4f}"),
         num(r["gbit_per_s"], "{:.3f}")]
        for r in proj["rows"]
    ]  # fmt: skip
    ddp = proj.get("ddp")
    if ddp:
        rows.append(["ddp", "fp32 gradients", "1 (every step)",
                     num(ddp["bytes_per_param_step"], "{:.4f}"), num(ddp["gbit_per_s"], "{:.1f}")])  # fmt: skip
    lines += table(["run", "codec", "H", "bytes / param / round", "Gbit/s per island"], rows)
    return lines
