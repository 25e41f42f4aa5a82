"""fidelity.md of `diloco-bench fidelity`: text only (its PNGs: `bench.plots`).

Every number comes from `bench.fidelity_claims`; this module formats it through
`bench.render`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bench.common import human_bytes
from bench.render import claims_table, num, pct, table

FMT = "{:.4f}"

DEFINITIONS = """\
- **final eval loss**: held-out loss of the global model read from the shards after
  every island stopped and every acked delta was merged (DDP: rank 0's final
  parameters), mean over seeds; spread = max - min over seeds.
- **goodput**: tokens the shards credited to an island (each delta's tokens x its
  staleness factor g(s) = (1+s)^-0.5 x the fragment's share of the model) over its
  capacity (wall time x its own step rate, padding included); mean over islands.
  Staleness costs goodput here, not only waiting.
- **utilization**: share of wall time an island trained instead of waiting for a
  merge (the paper's goodput: only synchronous islands wait).
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
    lines += ["## Definitions", "", DEFINITIONS]
    return "\n".join(lines)
