"""Output directories of bench commands: never delete what a bench run did not create.

A directory a bench command writes to (`--out DIR`) carries a marker file,
`MARKER`, written when the command first takes the directory. `claim` gives a
command its directory:

- missing: created (with parents) and marked;
- empty: marked and used;
- marked: ours from an earlier run, so its contents are cleared (the directory
  itself stays; symlinks inside are unlinked, never followed) and it is
  marked again;
- anything else (a non-empty directory without the marker, a file): refused
  with `OutDirError`, and nothing is touched.
"""

from __future__ import annotations

import datetime
import json
import shutil
from pathlib import Path

MARKER = ".diloco-bench-out"


class OutDirError(Exception):
    """An output directory that a bench command may not use (one-line message)."""


def is_ours(out: Path) -> bool:
    """Whether `out` is a directory that a bench command created (it has the marker).

    Args:
        out: the directory.

    Returns:
        True when `out/MARKER` is a regular file (not a symlink).
    """
    marker = Path(out) / MARKER
    return marker.is_file() and not marker.is_symlink()


def claim(out: Path, command: str, keep: bool = False) -> Path:
    """Take `out` as the output directory of `command`, refusing anything not ours.

    Args:
        out: the directory (`--out`).
        command: the bench subcommand, recorded in the marker (e.g. "demo").
        keep: keep what an earlier run of ours left there (resuming it).

    Returns:
        `out`, now an existing, marked directory holding nothing but the marker
        (with `keep`: the marker and what was there).

    Raises:
        OutDirError: `out` is a file, or a non-empty directory without the
            marker, or cannot be created, cleared or marked.
    """
    out = Path(out)
    try:
        if out.exists() and not out.is_dir():
            raise OutDirError(f"--out {out} is not a directory; choose a new or empty directory")
        if out.is_dir() and not is_ours(out) and any(out.iterdir()):
            raise OutDirError(
                f"--out {out} is not empty and was not created by diloco-bench (no {MARKER} "
                f"file); choose a new or empty directory, or empty it yourself"
            )
        if out.is_dir() and not keep:
            _clear(out)
        out.mkdir(parents=True, exist_ok=True)
        created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        (out / MARKER).write_text(json.dumps({"command": command, "created": created}) + "\n")
    except OSError as exc:
        raise OutDirError(f"--out {out}: {exc.strerror or exc}") from exc
    return out


def _clear(out: Path) -> None:
    """Remove everything inside `out` (a marked directory), keeping `out` itself.

    Args:
        out: the directory; a symlink inside is removed as a link, its target untouched.
    """
    for entry in out.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
