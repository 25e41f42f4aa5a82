"""fidelity.md of `diloco-bench fidelity`: text only (its PNGs: `bench.plots`).

Every number comes from `bench.fidelity_claims`; this module formats it through
`bench.render`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bench import fidelity_staleness
from bench.common import human_bytes
from bench.render import claims_table, num, pct, table
from bench.render import rel as rel_of

FMT = "{:.4f}"

DEFINITIONS = """\
- **final eval loss**: held-out loss of the global model read from the shards after
  every island stopped and every acked delta was merged (DDP: rank 0's final
  parameters), mean over seeds; spread = max - min over seeds.
- **goodput** (Decoupled DiLoCo's): share of an island's wall time spent on inner
  steps whose work entered the model: the tokens its shards merged (no staleness
  factor) over its wall time x its own step rate (padding included); waiting,
  back-pressure, restarts and rejected or never-merged work are lost; mean over
  islands.
- **utilization**: share of wall time an island was not waiting for a sync merge
  (one part of what goodput counts as lost).
- **price of staleness**: goodput does not count staleness; its cost is measured as
  quality: each asynchronous scenario's eval loss at the tokens (and at the wall
  time) both runs reached, against its group's synchronous DiLoCo (same H if
  there is one) and DDP, mean over seeds, next to its shards' staleness
  histogram (merged deltas by versions behind, summed over seeds).
- **uptime**: share of time windows (one fast round long) in which a version advanced.
"""


def render(meta: Mapping[str, Any], claims: Sequence[dict], entries: Mapping[str, dict]) -> str:
    """The markdown report: claims first, then one table per group.

    Args:
        meta: command, date, elapsed_s and the groups with their budgets.
        claims: `fidelity_claims.evaluate` output.
        entries: scenario name -> `fidelity_claims.summarize` output.

    Returns:
        Markdown text.
    """
    lines = ["# Fidelity: the quorum table and parity with data parallel", ""]
    lines += [f"`{meta['command']}`, {meta['date']}, {meta['elapsed_s'] / 60:.0f} min.", ""]
    lines += ["## Claims", "", *claims_table(claims)]
    for group in meta["groups"]:
        b = group["budget"]
        lines += [f"## Group {group['name']}: {group['title']}", ""]
        lines += [
            f"Model `{b['model']}`, {b['islands']} islands, batch {b['batch_size']} x "
            f"{b['seq_len']} bytes, {b['steps_per_island']} steps per island "
            f"({b['tokens']:,} tokens), {b['eval_batches']} held-out batches.",
            "",
        ]
        rows = []
        for e in entries.values():
            if e["group"] != group["name"]:
                continue
            speeds = ", ".join(f"{s:.2f}" + (f"±{j:.0%}" if j else "") for s, j in e["speeds"])
            rows.append([
                e["name"], e["mode"], str(e["quorum"] or "-"), str(e["grace"] or "-"),
                str(e["merge"] or "-"), str(e["merge_rule"] or "-"), str(e["inner_steps"]), speeds,
                f"{num(e['final_eval_loss'], FMT)} ({num(e['final_eval_loss_spread'], FMT)})",
                pct(e["goodput"]), pct(e["utilization"]), pct(e["uptime"]),
                human_bytes(e["bytes_per_island"]),
            ])  # fmt: skip
        lines += table(
            ["scenario", "mode", "K", "grace", "merge", "fold", "H", "speeds", "loss (spread)",
             "goodput", "utilization", "uptime", "bytes/island"],
            rows,
        )  # fmt: skip
    lines += ["## Price of staleness", "", *staleness_table(fidelity_staleness.price(entries))]
    lines += ["## Definitions", "", DEFINITIONS]
    return "\n".join(lines)


def staleness_table(rows: Sequence[dict]) -> list[str]:
    """The price-of-staleness table: loss at equal tokens and wall time, the histogram.

    Args:
        rows: `fidelity_staleness.price` output.

    Returns:
        Markdown lines (a note when no asynchronous scenario ran).
    """
    if not rows:
        return ["No asynchronous scenario ran.", ""]

    def versus(v: dict | None, at: str) -> str:
        if v is None or v[f"ours_at_{at}"] is None or v[f"ref_at_{at}"] is None:
            return "-"
        ours, ref = v[f"ours_at_{at}"], v[f"ref_at_{at}"]
        rel = rel_of(ours, ref)
        return f"{num(ours, FMT)} vs {v['ref']} {num(ref, FMT)}" + (
            f" ({rel:+.2%})" if rel is not None else ""
        )

    table_rows = [
        [
            r["name"], r["group"], num(r["mean_staleness"], "{:.2f}"),
            " ".join(f"{s}:{c}" for s, c in r["staleness_histogram"].items()) or "-",
            versus(r["vs_sync"], "tokens"), versus(r["vs_sync"], "time"),
            versus(r["vs_ddp"], "tokens"), versus(r["vs_ddp"], "time"),
        ]
        for r in rows
    ]  # fmt: skip
    return table(
        ["scenario", "group", "mean staleness", "histogram (staleness:deltas)",
         "vs sync, equal tokens", "vs sync, equal time", "vs DDP, equal tokens",
         "vs DDP, equal time"],
        table_rows,
    )  # fmt: skip
