"""The text of a bench report, for `report` and `fidelity` alike: claims, numbers, tables.

A claim is one dict, built by `claim` and nowhere else; `claims_table` renders
a list of them and `table` every other markdown table. The plots have their
home in `bench.plots`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MET_TEXT = {True: "yes", False: "**no**", None: "not run"}


def claim(name: str, target: str, measured: Any, met: bool | None, note: str = "") -> dict:
    """One claim of a report.

    Args:
        name: what is claimed.
        target: the bound it must meet, as text.
        measured: what this run measured (a number, text or a dict of them).
        met: whether it holds (None: not measured in this run).
        note: how it was measured or why it was not.

    Returns:
        {"claim", "target", "measured", "met", "note"} (JSON keys the reports pin).
    """
    return {"claim": name, "target": target, "measured": measured, "met": met, "note": note}


def rel(value: float | None, ref: float | None) -> float | None:
    """Relative difference (value - ref) / ref; None when either is missing or ref is 0.

    Args:
        value: the measured figure.
        ref: the reference it is compared with.

    Returns:
        The difference as a fraction of `ref`, or None.
    """
    return None if value is None or ref is None or ref == 0 else (value - ref) / ref


def num(value: Any, fmt: str = "{:.3f}") -> str:
    """A table cell for a number: "-" for None, yes/no for a bool, else `fmt`."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return fmt.format(value)


def pct(value: float | None, digits: int = 1) -> str:
    """A fraction as a percentage cell ("-" for None)."""
    return "-" if value is None else f"{100 * value:.{digits}f}%"


def measured_text(value: Any) -> str:
    """A claim's measured value as text (dicts as "key: value, ...", floats to 4 digits)."""
    if isinstance(value, dict):
        return ", ".join(f"{k}: {measured_text(v)}" for k, v in value.items())
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None or value == "" else str(value)


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A markdown table (cells escaped), then an empty line.

    Args:
        header: column titles.
        rows: cells, one list per row, as text.

    Returns:
        The lines.
    """
    escaped = [[cell.replace("|", "\\|") for cell in row] for row in rows]
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(r) + " |" for r in escaped),
        "",
    ]


def claims_table(claims: Sequence[dict]) -> list[str]:
    """The claims of a report as one markdown table (met: yes, **no** or not run).

    Args:
        claims: dicts from `claim`.

    Returns:
        The lines.
    """
    rows = [
        [c["claim"], c["target"], measured_text(c["measured"]), MET_TEXT[c["met"]], c["note"]]
        for c in claims
    ]
    return table(["claim", "target", "measured", "met", "note"], rows)
