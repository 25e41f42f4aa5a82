"""fidelity.md and the PNGs of `diloco-bench fidelity`: drawing and text only.

Every number comes from `bench.fidelity_claims`; this module formats it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.common import human_bytes

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


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _num(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


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
    lines += ["## Claims", "", "| claim | target | measured | met |", "|---|---|---|---|"]
    for c in claims:
        met = {True: "yes", False: "**no**", None: "not run"}[c["met"]]
        note = f" ({c['note']})" if c.get("note") else ""
        lines.append(f"| {c['claim']}{note} | {c['target']} | {c['measured'] or '-'} | {met} |")
    lines.append("")
    for group in meta["groups"]:
        b = group["budget"]
        lines += [f"## Group {group['name']}: {group['title']}", ""]
        lines += [
            f"Model `{b['model']}`, {b['islands']} islands, batch {b['batch_size']} x "
            f"{b['seq_len']} bytes, {b['steps_per_island']} steps per island "
            f"({b['tokens']:,} tokens), {b['eval_batches']} held-out batches.",
            "",
            "| scenario | mode | K | grace | merge | fold | H | speeds | loss (spread) | "
            "goodput | utilization | uptime | bytes/island |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for e in entries.values():
            if e["group"] != group["name"]:
                continue
            speeds = ", ".join(f"{s:.2f}" + (f"±{j:.0%}" if j else "") for s, j in e["speeds"])
            lines.append(
                f"| {e['name']} | {e['mode']} | {e['quorum'] or '-'} | {e['grace'] or '-'} | "
                f"{e['merge'] or '-'} | {e['merge_rule'] or '-'} | {e['inner_steps']} | {speeds} | "
                f"{_num(e['final_eval_loss'])} ({_num(e['final_eval_loss_spread'])}) | "
                f"{_pct(e['goodput'])} | {_pct(e['utilization'])} | {_pct(e['uptime'])} | "
                f"{human_bytes(e['bytes_per_island'])} |"
            )
        lines.append("")
    lines += ["## Definitions", "", DEFINITIONS]
    return "\n".join(lines)


def write_plots(groups: Sequence[Any], entries: Mapping[str, dict], out: Path) -> list[Path]:
    """Loss against tokens per group, and goodput/loss bars of each quorum table.

    Args:
        groups: the fidelity_plan groups that ran.
        entries: scenario name -> summary.
        out: directory.

    Returns:
        The paths written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for group in groups:
        names = [s.name for s in group.scenarios if s.name in entries]
        if not names:
            continue
        fig, ax = plt.subplots(figsize=(9, 5.5))
        for name in names:
            curve = entries[name]["eval_curves"][0] if entries[name]["eval_curves"] else []
            if curve:
                ax.plot([p[1] for p in curve], [p[2] for p in curve], ".-", label=name, alpha=0.8)
        ax.set(xlabel="tokens trained (cluster)", ylabel="held-out loss (seed 0)",
               title=f"group {group.name}: {group.title}")  # fmt: skip
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        path = out / f"loss_vs_tokens_{group.name}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
        table = [n for n in names if entries[n]["goodput"] is not None]
        if group.name == "A" or not table:
            continue
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
        left.bar(table, [entries[n]["goodput"] for n in table], color="tab:green")
        left.set(ylabel="goodput (credited / capacity)", ylim=(0, 1.05), title="goodput")
        right.bar(table, [entries[n]["final_eval_loss"] or 0 for n in table], color="tab:blue")
        losses = [entries[n]["final_eval_loss"] for n in table if entries[n]["final_eval_loss"]]
        if losses:
            right.set_ylim(min(losses) * 0.97, max(losses) * 1.02)
        right.set(ylabel="final eval loss", title="loss")
        for ax in (left, right):
            ax.tick_params(axis="x", rotation=60, labelsize=7)
        fig.suptitle(f"quorum table, group {group.name}: {group.title}")
        path = out / f"quorum_table_{group.name}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths
