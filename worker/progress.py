"""An island's progress files: one home for their names and their format.

An island's data dir holds ``metrics.jsonl`` (one JSON object per line, one
line per round, appended) and ``status.json`` (one JSON object, replaced
atomically on every change). Whatever writes or reads them (the island, the
DDP baseline rank, the bench harnesses, the tests) goes through this module.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
STATUS_FILE = "status.json"


def metrics_path(data_dir: str | Path) -> Path:
    """The metrics file of a data dir.

    Args:
        data_dir: the island's data directory.

    Returns:
        ``data_dir / "metrics.jsonl"``.
    """
    return Path(data_dir) / METRICS_FILE


def status_path(data_dir: str | Path) -> Path:
    """The status file of a data dir.

    Args:
        data_dir: the island's data directory.

    Returns:
        ``data_dir / "status.json"``.
    """
    return Path(data_dir) / STATUS_FILE


def append_row(data_dir: str | Path, row: dict[str, Any]) -> None:
    """Append one metrics row (one JSON line) to the data dir's metrics file.

    Args:
        data_dir: the island's data directory (must exist).
        row: JSON-serialisable fields of the row.
    """
    with metrics_path(data_dir).open("a") as f:
        f.write(json.dumps(row) + "\n")


def read_rows(data_dir: str | Path) -> list[dict[str, Any]]:
    """Every metrics row of a data dir, oldest first.

    A line that is not a JSON object (a torn last line of a writer that is
    still appending, or was killed mid-write) is skipped.

    Args:
        data_dir: the island's data directory.

    Returns:
        One dict per complete line; [] when there is no metrics file yet.
    """
    try:
        text = metrics_path(data_dir).read_text()
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if isinstance(row, dict):
                rows.append(row)
    return rows


def write_status(data_dir: str | Path, status: dict[str, Any]) -> None:
    """Replace the data dir's status file atomically (a reader sees the old or the new one).

    Args:
        data_dir: the island's data directory (must exist).
        status: JSON-serialisable fields.
    """
    path = status_path(data_dir)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(status))
    os.replace(tmp, path)


def read_status(data_dir: str | Path) -> dict[str, Any] | None:
    """The data dir's latest status.

    Args:
        data_dir: the island's data directory.

    Returns:
        The status dict, or None when there is none yet (or it is unreadable).
    """
    try:
        status = json.loads(status_path(data_dir).read_text())
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) else None
