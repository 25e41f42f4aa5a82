"""A data dir knows its kind, a server's or an island's, and the other daemon refuses it.

`diloco-server` and `diloco-worker` both keep a pid file, a log and a ready
file at the top of their `--data-dir`; given each other's dir they would mix
their files (and `stop` would signal the other daemon). So a daemon writes a
marker, ``<data_dir>/diloco-kind`` holding "server" or "island", once it is
ready (`mark`: a start that fails writes nothing), and every command that
takes a data dir checks it first (`check`). A dir of an older version without
the marker is known by what it holds (`infer`): ``shard-<i>`` folders are a
server's, an island's status, metrics, outbox or session token an island's.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from paramserver.plumbing.daemon import DaemonError

KIND_FILE = "diloco-kind"
SERVER = "server"
ISLAND = "island"
KINDS = (SERVER, ISLAND)
# what an island writes in its data dir (worker.island_files, worker.outbox, worker.session_token:
# named here because paramserver never imports worker)
ISLAND_FILES = ("status.json", "metrics.jsonl", "outbox.bin", "session.token")
_OWNER = {SERVER: "diloco-server", ISLAND: "diloco-worker"}


class DataDirKindError(DaemonError):
    """A data dir belongs to the other kind of daemon.

    Attributes:
        data_dir: the directory.
        kind: what it is ("server" or "island").
        wanted: what the command needs.
    """

    def __init__(self, data_dir: Path, kind: str, wanted: str, why: str) -> None:
        owner = _OWNER[kind]
        super().__init__(
            f"{data_dir} is {_an(kind)} data dir ({why}), not {_an(wanted)}: give "
            f"{_OWNER[wanted]} a --data-dir of its own (that one is for {owner})"
        )
        self.data_dir = data_dir
        self.kind = kind
        self.wanted = wanted


def _an(kind: str) -> str:
    return "an island's" if kind == ISLAND else "a server's"


def infer(data_dir: str | Path) -> tuple[str, str] | None:
    """What a data dir is, from its marker or else from what it holds.

    Args:
        data_dir: the directory (it need not exist).

    Returns:
        (kind, why: the file that says so), or None for a new, empty or
        unrecognised dir (or one that holds both kinds' files).
    """
    data_dir = Path(data_dir)
    with contextlib.suppress(OSError):
        marked = (data_dir / KIND_FILE).read_text().strip()
        if marked in KINDS:
            return marked, f"its {KIND_FILE} file says so"
    if not data_dir.is_dir():
        return None
    shards = sorted(p.name for p in data_dir.glob("shard-*") if p.is_dir() and p.name[6:].isdigit())
    island = [name for name in ISLAND_FILES if (data_dir / name).exists()]
    if shards and not island:
        return SERVER, f"it holds {shards[0]}/"
    if island and not shards:
        return ISLAND, f"it holds {island[0]}"
    return None


def check(data_dir: str | Path, wanted: str) -> None:
    """Refuse a data dir of the other kind (reads only; writes nothing).

    Args:
        data_dir: the directory a command was given.
        wanted: the kind the command needs ("server" or "island").

    Raises:
        DataDirKindError: it is the other kind's (one line naming the dir and what it is).
    """
    found = infer(data_dir)
    if found is not None and found[0] != wanted:
        raise DataDirKindError(Path(data_dir), found[0], wanted, found[1])


def mark(data_dir: str | Path, kind: str) -> None:
    """Write the kind marker of a data dir whose daemon is ready (no-op when it exists).

    Args:
        data_dir: the directory (exists).
        kind: "server" or "island".
    """
    path = Path(data_dir) / KIND_FILE
    if path.exists():
        return
    tmp = path.with_name(f".{KIND_FILE}.{os.getpid()}.tmp")
    try:
        tmp.write_text(f"{kind}\n")
        os.replace(tmp, path)
    except OSError:  # a marker is a convenience: a read-only dir still serves
        with contextlib.suppress(OSError):
            tmp.unlink()
