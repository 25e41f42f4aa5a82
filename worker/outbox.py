"""An island's outbox file: the deltas it could not deliver before it stopped, sent at its next start.

This module owns the file (``<data_dir>/outbox.bin``) and the rules around it.
When an island stops with deltas still unacked (the server is gone, say),
`save` writes them there: per delta its (fragment, round) key, base version,
tokens, steps and codec frames, with the island id and the plan hash, written
atomically (temporary file, fsync, rename, fsync of the directory). When the
island starts again with the same data dir, `resend` pushes them again with
their original round ids and base versions before any new round; the shards'
(island, round, fragment) dedup answers `duplicate` for a delta they had
accepted (its ack was lost), so every delta counts exactly once. The file is
removed once they are resolved (`save` of nothing). A file this island cannot
use (another island id or plan, or unreadable) is renamed aside, never deleted.

Layout: MAGIC, crc32 of the body (4 bytes, big-endian), body (msgpack map:
version, island, plan_hash, saved_at, deltas: list of maps with fragment,
round, base_version, tokens, steps, frames: list of bytes).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import msgpack

from paramserver.client import Client, PushRequest

logger = logging.getLogger(__name__)

OUTBOX_FILE = "outbox.bin"
MAGIC = b"DILOCO-OUTBOX\n"
FORMAT_VERSION = 1
_FIELDS = ("fragment", "round", "base_version", "tokens", "steps")


class OutboxFileError(RuntimeError):
    """The outbox file cannot be read; the message names the file and the fault."""


@dataclass(frozen=True)
class Saved:
    """What an outbox file holds: whose deltas, for which plan, and the deltas."""

    island: str
    plan_hash: str
    deltas: list[PushRequest]


def save(path: Path, island: str, plan_hash: str, deltas: list[PushRequest]) -> None:
    """Write `deltas` to `path` atomically and durably; with none, remove the file.

    Args:
        path: the outbox file.
        island: the island id the deltas were pushed as.
        plan_hash: the plan they were computed for.
        deltas: unacked deltas (`Client.unacked`), in push order.

    Raises:
        OSError: the file cannot be written.
    """
    if not deltas:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    body = msgpack.packb(
        {
            "version": FORMAT_VERSION,
            "island": island,
            "plan_hash": plan_hash,
            "saved_at": time.time(),
            "deltas": [
                {**{k: getattr(d, k) for k in _FIELDS}, "frames": [bytes(f) for f in d.frames]}
                for d in deltas
            ],
        },
        use_bin_type=True,
    )
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(MAGIC + zlib.crc32(body).to_bytes(4, "big") + body)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def keep(path: Path, island: str, plan_hash: str, unacked: list[PushRequest]) -> bool:
    """`save` at an island's stop, logging what was kept (or lost: the file cannot be written).

    Args:
        path: the outbox file.
        island: the island id.
        plan_hash: the cluster's plan hash.
        unacked: `Client.unacked()` after `close`.

    Returns:
        Whether the file now holds exactly `unacked` (False: the write failed).
    """
    try:
        save(path, island, plan_hash, unacked)
    except OSError as exc:
        logger.error(
            "island %s: %d unacked deltas lost: cannot write %s: %s",
            island,
            len(unacked),
            path,
            exc,
        )
        return False
    if unacked:
        logger.warning(
            "island %s stopped with %d unacked deltas: kept in %s, sent again at the next "
            "start with this data dir",
            island,
            len(unacked),
            path,
        )
    return True


def load(path: Path) -> Saved | None:
    """Read an outbox file.

    Args:
        path: the outbox file.

    Returns:
        Its content, or None when there is no file.

    Raises:
        OutboxFileError: it is truncated, corrupt or of an unknown format.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    head = len(MAGIC) + 4
    if not data.startswith(MAGIC) or len(data) < head:
        raise OutboxFileError(f"{path} is not an outbox file (bad magic)")
    body = data[head:]
    if zlib.crc32(body) != int.from_bytes(data[len(MAGIC) : head], "big"):
        raise OutboxFileError(f"{path} is corrupt (checksum mismatch)")
    try:
        obj = msgpack.unpackb(body, raw=False)
        if obj["version"] != FORMAT_VERSION:
            raise OutboxFileError(f"{path} has format version {obj['version']!r}, not 1")
        deltas = [
            PushRequest(*(int(d[k]) for k in _FIELDS), list(d["frames"])) for d in obj["deltas"]
        ]
        return Saved(str(obj["island"]), str(obj["plan_hash"]), deltas)
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        raise OutboxFileError(f"{path} is malformed: {exc}") from None


def set_aside(path: Path, why: str) -> Path:
    """Rename an outbox file this island cannot use, so that it is kept but not re-read.

    Args:
        path: the outbox file.
        why: what is wrong with it (logged).

    Returns:
        The new name.
    """
    aside = path.with_name(f"{path.name}.unused-{int(time.time())}")
    os.replace(path, aside)
    logger.warning("outbox file %s not used (%s); kept as %s", path, why, aside)
    return aside


def resend(client: Client, path: Path, island: str, plan_hash: str, stop: threading.Event) -> int:
    """Push the deltas a previous run of this island left in its outbox file.

    Call it right after `Client.join`, before pushing new rounds (a delta far
    older than the newest round a shard saw from the island is refused there
    as `replayed_round`). The file stays until `save` replaces or removes it.

    Args:
        client: the joined client.
        path: the outbox file.
        island: this island's id.
        plan_hash: the joined cluster's plan hash.
        stop: the island's stop event (a push never blocks once it is set).

    Returns:
        How many deltas were pushed again (0: no usable file).
    """
    try:
        saved = load(path)
    except OutboxFileError as exc:
        set_aside(path, str(exc))
        return 0
    if saved is None:
        return 0
    if saved.island != island or saved.plan_hash != plan_hash:
        set_aside(
            path,
            f"it holds deltas of island {saved.island!r} for plan {saved.plan_hash}; "
            f"this is island {island!r} with plan {plan_hash}",
        )
        return 0
    for d in saved.deltas:
        client.push(d.fragment, d.round, d.base_version, d.tokens, d.steps, d.frames, stop=stop)
    logger.info("island %s: re-sent %d deltas kept in %s", island, len(saved.deltas), path)
    return len(saved.deltas)
