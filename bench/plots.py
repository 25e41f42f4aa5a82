"""PNG plots of a report (matplotlib, Agg backend): loss vs wall-clock and tokens, bytes, goodput.

This module owns drawing only; every number comes from the run records and
`bench.claims.evaluate`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

PLOTS = ("loss_vs_wallclock.png", "loss_vs_tokens.png", "bytes_per_round.png", "goodput.png")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _curves(ax, records: Mapping[str, Mapping[str, Any]], x: int, names: list[str]) -> None:
    for name in names:
        curve = records[name].get("eval_curve", [])
        if curve:
            ax.plot([p[x] for p in curve], [p[2] for p in curve], ".-", label=name, alpha=0.85)


def write_plots(
    records: Mapping[str, Mapping[str, Any]],
    summary: Mapping[str, Any],
    ddp_wan_tokens_per_s: float | None,
    out: Path,
) -> list[Path]:
    """Write the report's PNGs.

    Args:
        records: run records by scenario name.
        summary: `bench.claims.evaluate` output.
        ddp_wan_tokens_per_s: DDP's measured throughput on the WAN link (dashed projection).
        out: directory.

    Returns:
        The paths written.
    """
    plt = _pyplot()
    names = list(records)
    paths = [out / p for p in PLOTS]
    target = summary.get("target_loss")

    fig, ax = plt.subplots(figsize=(9, 5.5))
    _curves(ax, records, 0, [n for n in names if n != "ddp"])
    ddp = records.get("ddp", {}).get("eval_curve", [])
    if ddp and ddp_wan_tokens_per_s:
        ax.plot(
            [p[1] / ddp_wan_tokens_per_s for p in ddp], [p[2] for p in ddp], "k--", alpha=0.6,
            label="ddp on the WAN link (projected from its measured step time)",
        )  # fmt: skip
    if target is not None:
        ax.axhline(target, color="grey", ls=":", lw=1, label=f"target {target:.3f}")
    ax.set_xscale("symlog", linthresh=10)
    ax.set_xlabel("wall-clock seconds of training (emulated WAN unless named otherwise)")
    ax.set_ylabel("held-out loss of the global parameters (nats/byte)")
    ax.set_title("loss against wall-clock time")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 5.5))
    _curves(ax, records, 1, [n for n in names if n != "ddp-wan"])
    ax.set_xlabel("tokens trained by the whole cluster")
    ax.set_ylabel("held-out loss of the global parameters (nats/byte)")
    ax.set_title("loss against tokens (same model, data, seeds, budget)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 5.5))
    labels, up, down = [], [], []
    for name in names:
        islands = list(records[name]["islands"].values())
        if records[name]["method"] == "ddp":
            if name != "ddp":
                continue
            # DDP moves its gradient every step: bytes per H steps = one DiLoCo round
            steps = max(1, sum(i["steps"] for i in islands) // len(islands))
            h = islands[0]["steps"] / max(1, islands[0]["rounds"])
            up.append(sum(i["bytes_sent"] for i in islands) / len(islands) / steps * h)
            down.append(sum(i["bytes_received"] for i in islands) / len(islands) / steps * h)
        else:
            up.append(sum(i["up_per_round"] for i in islands) / len(islands))
            down.append(sum(i["down_per_round"] for i in islands) / len(islands))
        labels.append(name)
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], up, width=0.4, label="up (island -> server)")
    ax.bar([x + 0.2 for x in xs], down, width=0.4, label="down (server -> island)")
    ax.set_yscale("log")
    ax.set_xticks(list(xs), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("bytes per island per round (H inner steps), counted at the sockets")
    ax.set_title("bytes on the wire per round")
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[2], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 5.5))
    bars, heights = [], []
    for name in names:
        for island, value in summary["runs"][name]["goodput"].items():
            speed = records[name]["islands"][island]["speed"]
            bars.append(f"{name}\n{island} x{speed:g}")
            heights.append(100 * (value or 0.0))
    ax.bar(range(len(bars)), heights)
    ax.axhline(95, color="grey", ls=":", lw=1)
    ax.set_xticks(range(len(bars)), bars, rotation=60, ha="right", fontsize=6)
    ax.set_ylabel("goodput (% of the island's capacity that entered the model)")
    ax.set_ylim(0, 105)
    ax.set_title("goodput per island")
    fig.tight_layout()
    fig.savefig(paths[3], dpi=110)
    plt.close(fig)
    return paths
