"""Every PNG of the bench (matplotlib, Agg backend): the report's, the fidelity run's, the demo's.

This module owns drawing only; every number comes from the run records,
`bench.claims.evaluate` or `bench.fidelity_claims`. `figure` is the one way a
plot is made and saved.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

PLOTS = ("loss_vs_wallclock.png", "loss_vs_tokens.png", "bytes_per_round.png", "goodput.png")


@contextlib.contextmanager
def figure(path: Path, cols: int = 1, size: tuple[float, float] = (9, 5.5)) -> Iterator[Any]:
    """A figure for the body of a `with`; saved to `path` (110 dpi) and closed on the way out.

    Args:
        path: the PNG to write.
        cols: axes side by side.
        size: inches.

    Yields:
        The axes (one, or a sequence of `cols`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, cols, figsize=size)
    try:
        yield axes
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def curves(ax: Any, named: Mapping[str, Sequence[Sequence[float]]], x: int, y: int = 2) -> None:
    """One line per name, x and y taken from the points' columns (e.g. eval curves).

    Args:
        ax: the axes.
        named: label -> points (tuples such as (seconds, tokens, loss)).
        x: the column on the x axis.
        y: the column on the y axis.
    """
    for name, points in named.items():
        if points:
            ax.plot([p[x] for p in points], [p[y] for p in points], ".-", label=name, alpha=0.85)


def _eval_curves(records: Mapping[str, Mapping[str, Any]], names: list[str]) -> dict[str, list]:
    return {n: records[n].get("eval_curve", []) for n in names}


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
    names = list(records)
    paths = [out / p for p in PLOTS]
    target = summary.get("target_loss")

    with figure(paths[0]) as ax:
        _wallclock(ax, records, names, ddp_wan_tokens_per_s, target)
    with figure(paths[1]) as ax:
        curves(ax, _eval_curves(records, [n for n in names if n != "ddp-wan"]), 1)
        ax.set_xlabel("tokens trained by the whole cluster")
        ax.set_ylabel("held-out loss of the global parameters (nats/byte)")
        ax.set_title("loss against tokens (same model, data, seeds, budget)")
        ax.legend(fontsize=7)
    with figure(paths[2]) as ax:
        _bytes_per_round(ax, records, names)
    with figure(paths[3]) as ax:
        _goodput(ax, records, summary, names)
    return paths


def _wallclock(ax, records, names, ddp_wan_tokens_per_s, target) -> None:
    curves(ax, _eval_curves(records, [n for n in names if n != "ddp"]), 0)
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


def _bytes_per_round(ax, records, names) -> None:
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


def _goodput(ax, records, summary, names) -> None:
    bars, heights = [], []
    for name in names:
        for island, value in summary["runs"][name]["goodput"].items():
            speed = records[name]["islands"][island]["speed"]
            bars.append(f"{name}\n{island} x{speed:g}")
            heights.append(100 * (value or 0.0))
    ax.bar(range(len(bars)), heights)
    ax.axhline(95, color="grey", ls=":", lw=1)
    ax.set_xticks(range(len(bars)), bars, rotation=60, ha="right", fontsize=6)
    ax.set_ylabel("goodput (% of the island's wall time on steps whose work was merged)")
    ax.set_ylim(0, 105)
    ax.set_title("goodput per island")


def write_fidelity_plots(
    groups: Sequence[Any], entries: Mapping[str, dict], out: Path
) -> list[Path]:
    """Loss against tokens per group, its staleness histograms, and each quorum table's bars.

    Args:
        groups: the fidelity_plan groups that ran.
        entries: scenario name -> `bench.fidelity_claims.summarize` output.
        out: directory.

    Returns:
        The paths written.
    """
    paths = []
    for group in groups:
        names = [s.name for s in group.scenarios if s.name in entries]
        if not names:
            continue
        path = out / f"loss_vs_tokens_{group.name}.png"
        with figure(path) as ax:
            curves(ax, {n: (entries[n]["eval_curves"] or [[]])[0] for n in names}, 1)
            ax.set(xlabel="tokens trained (cluster)", ylabel="held-out loss (seed 0)",
                   title=f"group {group.name}: {group.title}")  # fmt: skip
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
        paths.append(path)
        stale = {n: entries[n].get("staleness_histogram") for n in names}
        stale = {n: h for n, h in stale.items() if h}
        if stale:
            path = out / f"staleness_{group.name}.png"
            with figure(path) as ax:
                _staleness_bars(ax, stale)
                ax.set_title(f"merged deltas by staleness, group {group.name} (all seeds)")
            paths.append(path)
        table = [n for n in names if entries[n]["goodput"] is not None]
        if group.name == "A" or not table:
            continue
        path = out / f"quorum_table_{group.name}.png"
        with figure(path, cols=2, size=(12, 5)) as (left, right):
            left.bar(table, [entries[n]["goodput"] for n in table], color="tab:green")
            left.set(ylabel="goodput (share of wall time on merged work)", ylim=(0, 1.05),
                     title="goodput")  # fmt: skip
            right.bar(table, [entries[n]["final_eval_loss"] or 0 for n in table], color="tab:blue")
            losses = [entries[n]["final_eval_loss"] for n in table if entries[n]["final_eval_loss"]]
            if losses:
                right.set_ylim(min(losses) * 0.97, max(losses) * 1.02)
            right.set(ylabel="final eval loss", title="loss")
            for ax in (left, right):
                ax.tick_params(axis="x", rotation=60, labelsize=7)
            left.figure.suptitle(f"quorum table, group {group.name}: {group.title}")
        paths.append(path)
    return paths


def _staleness_bars(ax, hists: Mapping[str, Mapping[str, int]]) -> None:
    """Side-by-side bars: each scenario's share of merged deltas at each staleness."""
    levels = sorted({int(s) for h in hists.values() for s in h})
    width = 0.8 / len(hists)
    for i, (name, hist) in enumerate(hists.items()):
        total = sum(hist.values())
        shares = [hist.get(str(s), 0) / total for s in levels]
        offset = (i - (len(hists) - 1) / 2) * width
        ax.bar([s + offset for s in levels], shares, width, label=name)
    ax.set_xticks(levels)
    ax.set(xlabel="staleness (versions behind at merge)", ylabel="share of merged deltas")
    ax.legend(fontsize=7)


def write_demo_plot(
    rows: Mapping[str, Sequence[Mapping[str, Any]]],
    floor: float,
    path: Path,
    final: tuple[float, float] | None = None,
) -> None:
    """The demo's PNG: train loss per island and global eval loss against wall-clock time.

    Args:
        rows: island name -> its metrics rows.
        floor: the unigram entropy of the corpus (a dashed line).
        path: the PNG.
        final: (wall-clock time, loss) of the final eval of the merged global
            model, drawn as its own marker at the end; None = none.
    """
    t0 = min((r["wall"] for rs in rows.values() for r in rs), default=final[0] if final else 0.0)
    train = {
        f"{name} (train)": [(r["wall"] - t0, r["loss"]) for r in rs if "loss" in r]
        for name, rs in rows.items()
    }
    evals = sorted((r["wall"] - t0, r["eval_global"]) for rs in rows.values() for r in rs
                   if "eval_global" in r)  # fmt: skip
    with figure(path, size=(8, 5)) as ax:
        curves(ax, train, 0, 1)
        if evals:
            ax.plot(*zip(*evals, strict=True), "k.-", label="global params (held-out eval)")
        if final is not None:
            ax.plot([final[0] - t0], [final[1]], "r*", ms=14,
                    label=f"final eval of the merged model ({final[1]:.3f})")  # fmt: skip
        ax.axhline(floor, color="grey", ls="--", lw=1, label="unigram entropy")
        ax.set_xlabel("wall-clock time (s)")
        ax.set_ylabel("loss (nats/byte)")
        ax.set_title("decoupled-diloco demo: islands training through the sharded parameter server")
        ax.legend()


REGIONS_PLOTS = ("link_utilisation.png", "round_breakdown.png")
REGIONS_FAULT_PLOT = "round_times_faults.png"
FAULT_COLOURS = {"kill_island": "tab:red", "cut_link": "tab:orange", "partition": "tab:purple"}


def write_regions_plots(run: Mapping[str, Any], out: Path) -> dict[str, str]:
    """The regions run's PNGs: link use over time, the round-time breakdown, and the faults' rounds.

    Args:
        run: the report's "run" part (`bench.regions_run.run_islands` or
            `bench.regions_fault_run.run_faulted`).
        out: the directory (next to regions.json).

    Returns:
        Plot name -> path written (the fault plot only when the run has "faults").
    """
    paths = {name.removesuffix(".png"): out / name for name in REGIONS_PLOTS}
    with figure(paths["link_utilisation"]) as ax:
        _link_utilisation(ax, run.get("link_utilisation", []), run.get("faults", []))
    with figure(paths["round_breakdown"]) as ax:
        _round_breakdown(ax, run.get("islands", []))
    if "faults" in run:
        paths[REGIONS_FAULT_PLOT.removesuffix(".png")] = out / REGIONS_FAULT_PLOT
        with figure(out / REGIONS_FAULT_PLOT) as ax:
            _fault_rounds(ax, run["islands"], run["faults"])
    return {name: str(path) for name, path in paths.items()}


def _shade_faults(ax, faults: Sequence[Mapping[str, Any]]) -> None:
    for f in faults:
        colour = FAULT_COLOURS.get(f["kind"], "grey")
        ax.axvspan(f["at_s"], f["end_s"], color=colour, alpha=0.25,
                   label=f"{f['kind']} ({f['region']})")  # fmt: skip
        ax.axvspan(f["end_s"], f["span_end_s"], color=colour, alpha=0.08)


def _link_utilisation(ax, rows: Sequence[Mapping[str, Any]], faults) -> None:
    for row in rows:
        points = row["points"]
        if any(p[1] > 0 for p in points):
            ax.plot([p[0] for p in points], [100 * p[2] for p in points], lw=1,
                    label=f"{row['link']} towards {row['towards']}")  # fmt: skip
    _shade_faults(ax, faults)
    ax.set_xlabel("seconds since the islands started")
    ax.set_ylabel("% of the link's configured rate (htb bytes per second)")
    ax.set_title("link utilisation per link and direction (idle directions left out)")
    ax.legend(fontsize=6)


def _round_breakdown(ax, islands: Sequence[Mapping[str, Any]]) -> None:
    labels, compute, transfer, ideal = [], [], [], []
    for island in islands:
        rounds = island.get("rounds", [])
        if not rounds:
            continue
        labels.append(f"{island['region']} x{island['speed']:g}")
        compute.append(statistics.median(r.get("compute_s", 0.0) for r in rounds))
        transfer.append(statistics.median(r["seconds"] for r in rounds))
        ideals = [r["bytes_over_bandwidth_s"] for r in rounds if r.get("bytes_over_bandwidth_s")]
        ideal.append(statistics.median(ideals) if ideals else None)
    xs = list(range(len(labels)))
    ax.bar(xs, compute, label="compute (inner steps, emulated)")
    ax.bar(xs, transfer, bottom=compute, label="first push to last ack (median round)")
    for x, c, i in zip(xs, compute, ideal, strict=True):
        if i is not None:
            ax.plot([x - 0.4, x + 0.4], [c + i, c + i], "k--", lw=1)
    ax.plot([], [], "k--", lw=1, label="compute + bytes / bandwidth")
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_ylabel("seconds per round")
    ax.set_title("round time per island: compute and transfer (medians over its rounds)")
    ax.legend(fontsize=7)


def _fault_rounds(ax, islands: Sequence[Mapping[str, Any]], faults) -> None:
    for island in islands:
        rounds = island.get("rounds", [])
        ax.plot([r["started_s"] + r["seconds"] for r in rounds], [r["seconds"] for r in rounds],
                ".-", lw=1, label=island["region"])  # fmt: skip
    _shade_faults(ax, faults)
    ax.set_yscale("log")
    ax.set_xlabel("seconds since the islands started (round settled at)")
    ax.set_ylabel("round time: first push to last ack (s)")
    ax.set_title(
        "round times through the faults (dark: the fault, light: until its island recovered)"
    )
    ax.legend(fontsize=7)
