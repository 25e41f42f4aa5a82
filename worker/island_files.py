"""An island's progress files: the one home of their names and format.

Two files in an island's data directory:

- ``metrics.jsonl``: one JSON object per line, appended (one per round, the
  round-0 evaluation and a final row); a reader tolerates a torn last line
  (the writer may be in the middle of appending it).
- ``status.json``: one JSON object, rewritten atomically (a temporary file,
  then `os.replace`), so a reader never sees a torn file.

Written by `worker.session.Session` (metrics) and the island daemon (status);
read by `diloco-worker status`, the bench and the demo. Imports no JAX.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
STATUS_FILE = "status.json"


def metrics_path(data_dir: str | Path) -> Path:
    """The metrics file of a data directory.

    Args:
        data_dir: the island's data directory.

    Returns:
        ``<data_dir>/metrics.jsonl``.
    """
    return Path(data_dir) / METRICS_FILE


def status_path(data_dir: str | Path) -> Path:
    """The status file of a data directory.

    Args:
        data_dir: the island's data directory.

    Returns:
        ``<data_dir>/status.json``.
    """
    return Path(data_dir) / STATUS_FILE


def append_row(data_dir: str | Path, row: dict[str, Any]) -> None:
    """Append one metrics row (one JSON line) to the data directory's metrics file.

    Args:
        data_dir: the island's data directory (must exist).
        row: a JSON-serialisable mapping.
    """
    with metrics_path(data_dir).open("a") as f:
        f.write(json.dumps(row) + "\n")


def read_rows(data_dir: str | Path) -> list[dict[str, Any]]:
    """Every complete metrics row of a data directory, in file order.

    Args:
        data_dir: the island's data directory.

    Returns:
        The rows; [] when there is no file. A last line that does not parse
        (a row being written) is left out; a bad line before it raises.

    Raises:
        ValueError: a line other than the last is not a JSON object.
    """
    try:
        lines = metrics_path(data_dir).read_text().splitlines()
    except FileNotFoundError:
        return []
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break  # torn: the writer is appending it
            raise ValueError(
                f"{metrics_path(data_dir)} line {number} is not JSON: {line[:80]!r}"
            ) from None
        if not isinstance(row, dict):
            raise ValueError(f"{metrics_path(data_dir)} line {number} is not a JSON object")
        rows.append(row)
    return rows


def write_status(data_dir: str | Path, status: dict[str, Any]) -> None:
    """Replace the data directory's status file atomically.

    Args:
        data_dir: the island's data directory (must exist).
        status: a JSON-serialisable mapping.
    """
    path = status_path(data_dir)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(status))
    os.replace(tmp, path)


def read_status(data_dir: str | Path) -> dict[str, Any] | None:
    """The data directory's status, or None when there is none.

    Args:
        data_dir: the island's data directory.

    Returns:
        The status mapping, or None when the file is absent.

    Raises:
        ValueError: the file is not a JSON object.
    """
    path = status_path(data_dir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        status = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"{path} is not JSON") from None
    if not isinstance(status, dict):
        raise ValueError(f"{path} is not a JSON object")
    return status
