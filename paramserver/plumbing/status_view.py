"""The human-readable view of `diloco-server status`: one rich table row per shard.

This module owns formatting only; the numbers come from `probe.cluster_status`.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.table import Table


def _bytes(n: object) -> str:
    value = float(n) if isinstance(n, int | float) else 0.0
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _pairs(mapping: object, limit: int = 6) -> str:
    if not isinstance(mapping, dict) or not mapping:
        return "-"
    items = [f"{k}:{v}" for k, v in mapping.items()]
    more = f" +{len(items) - limit}" if len(items) > limit else ""
    return " ".join(items[:limit]) + more


def _checkpoint(shard: dict[str, Any]) -> str:
    """The last checkpoint: generation, outer step, UTC time, size, seconds; writing / failures."""
    last = shard.get("last_checkpoint")
    parts = []
    if isinstance(last, dict):
        at = last.get("time")
        when = time.strftime("%H:%M:%SZ", time.gmtime(at)) if isinstance(at, int | float) else "?"
        took = last.get("seconds")
        took_s = f" {took:.2f} s" if isinstance(took, int | float) else ""
        gen, step = last.get("generation"), last.get("step")
        parts.append(f"#{gen} step {step} {when} {_bytes(last.get('bytes'))}{took_s}")
    if shard.get("checkpoint_writing"):
        parts.append("writing")
    if shard.get("checkpoint_failures"):
        parts.append(f"[red]{shard['checkpoint_failures']} failed[/red]")
    return ", ".join(parts) or "-"


def render_status(result: dict[str, Any], console: Console | None = None) -> None:
    """Print the cluster status as a table.

    Args:
        result: the dict `probe.cluster_status` returns.
        console: where to print (default: stdout).
    """
    if console is None:
        console = Console()
        if not console.is_terminal:  # piped: do not squeeze the table into 80 columns
            console = Console(width=200)
    table = Table(title=f"diloco-server at {result.get('connect')}", title_justify="left")
    for column in (
        "shard",
        "endpoint",
        "versions (fragment:version)",
        "live islands",
        "accepted",
        "dup",
        "rejected",
        "steps",
        "in",
        "out",
        "staleness (s:count)",
        "last checkpoint",
    ):
        table.add_column(column)
    for shard in result.get("shards", []):
        if "error" in shard:
            table.add_row(
                str(shard.get("shard")), shard.get("endpoint", "?"), f"[red]{shard['error']}[/red]"
            )
            continue
        live = shard.get("islands_live", [])
        rejected = shard.get("rejected", {})
        table.add_row(
            str(shard.get("shard")),
            str(shard.get("endpoint")),
            _pairs(shard.get("versions")) if shard.get("initialized", True) else "not initialized",
            f"{len(live)} {', '.join(map(str, live[:4]))}{' ...' if len(live) > 4 else ''}",
            str(shard.get("accepted", 0)),
            str(shard.get("duplicates", 0)),
            f"{sum(rejected.values())} {_pairs(rejected, 3)}" if rejected else "0",
            str(shard.get("steps", 0)),
            _bytes(shard.get("bytes_in", 0)),
            _bytes(shard.get("bytes_out", 0)),
            _pairs(shard.get("staleness_histogram")),
            _checkpoint(shard),
        )
    console.print(table)
