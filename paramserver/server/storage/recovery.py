"""Recovery of one shard's data directory: the newest good checkpoint plus the log after it.

This module owns how a shard state is rebuilt from ``<data_dir>/shard-<i>/``
(layout in `paramserver.server.storage.shard_storage`): remove unfinished
checkpoint writes, load the newest checkpoint that reads back intact (a
corrupted one is reported, renamed to ``*.corrupt`` and the previous one
used), replay every log segment from its generation on through
`ShardState.apply`, and find where the last segment's good records end (a torn
tail is cut off before appending again). Recovery never loses an acknowledged
delta silently: a log corrupted in the middle, or no usable checkpoint and no
log from the empty state, is a `DurabilityError` saying what to do.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paramserver.plumbing.private import private_dir
from paramserver.server.config import ShardConfig
from paramserver.server.fragment import StateError
from paramserver.server.state import ShardState
from paramserver.server.storage.checkpoint import (
    CheckpointError,
    checkpoint_summary,
    read_checkpoint,
    restore_state,
)
from paramserver.server.storage.wal import LogReader, WalError, record_to_event
from paramserver.wire.plan import PlanError

logger = logging.getLogger(__name__)

CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)\.ckpt$")
LOG_NAME = re.compile(r"^wal-(\d+)\.log$")


class DurabilityError(RuntimeError):
    """The data directory cannot be recovered without losing acknowledged data."""


@dataclass
class Recovered:
    """What recovery found: the state, and where appends go on."""

    state: ShardState
    checkpoint: int  # generation of the checkpoint loaded (0: none)
    segment: int  # generation of the log segment to append to
    truncate_to: int  # its good length when it has a torn tail, else 0 (keep it whole)
    replayed: int  # log records replayed
    skipped_corrupt: bool  # a corrupted checkpoint was set aside
    # the loaded checkpoint for status (step, versions, time, bytes, seconds None), if any
    loaded: dict[str, Any] | None = None


def numbered(directory: Path, pattern: re.Pattern) -> dict[int, Path]:
    """The files of `directory` whose names match `pattern`, by their generation.

    Args:
        directory: the shard's directory.
        pattern: CHECKPOINT_NAME or LOG_NAME.

    Returns:
        generation -> path.
    """
    found = {}
    for path in directory.iterdir():
        m = pattern.match(path.name)
        if m:
            found[int(m.group(1))] = path
    return found


def recover(
    cfg: ShardConfig,
    index: int,
    directory: Path,
    timer: Callable[[], float] | None = None,
    quiet: bool = False,
) -> Recovered:
    """Rebuild the shard state of `directory` (created when missing).

    Args:
        cfg: the settings to run with (must match the data's cluster shape).
        index: the shard's index.
        directory: ``<data_dir>/shard-<index>``.
        timer: the state's step timer (see ShardState).
        quiet: log the summary at DEBUG (a rebuild after a storage fault), not INFO.

    Returns:
        The recovered state and where to append.

    Raises:
        DurabilityError: recovery would lose acknowledged data, or the data
            belongs to another cluster shape; the message says which and what to do.
        OSError: the directory cannot be created or read.
    """
    try:
        return _recover(cfg, index, directory, timer, logging.DEBUG if quiet else logging.INFO)
    except (WalError, StateError, PlanError) as exc:
        hint = ""
        if isinstance(exc, PlanError) or isinstance(exc.__cause__, PlanError):
            hint = (
                " (its plan does not match this version's: a data dir written before shards "
                "owned contiguous runs of fragments cannot be resumed; start with an empty one)"
            )
        raise DurabilityError(f"shard {index} cannot recover {directory}: {exc}{hint}") from exc


# a checkpoint write cut short; a segment's creation cut short (it held no record)
_UNFINISHED = ((".checkpoint-*.tmp-*", "checkpoint"), (".wal-*.log.tmp-*", "log segment"))


def _recover(
    cfg: ShardConfig, index: int, directory: Path, timer: Callable[[], float] | None, level: int
) -> Recovered:
    private_dir(directory, tighten=True)  # 0700: the shard's own directory
    for pattern, what in _UNFINISHED:  # `wal.write_whole`'s temporaries a crash left
        for stale in directory.glob(pattern):
            logger.warning("shard %d: removing unfinished %s %s", index, what, stale.name)
            stale.unlink(missing_ok=True)
    checkpoints = numbered(directory, CHECKPOINT_NAME)
    skipped = False
    state, gen, loaded = None, 0, None
    for n in sorted(checkpoints, reverse=True):
        path = checkpoints[n]
        try:
            meta, arrays = read_checkpoint(path)
        except CheckpointError as exc:
            logger.error(
                "shard %d: checkpoint %s is unusable (%s); trying the previous one",
                index,
                path.name,
                exc,
                extra={"shard": index, "path": str(path)},
            )
            path.rename(path.with_name(path.name + ".corrupt"))
            skipped = True
            continue
        state, gen = restore_state(cfg, index, meta, arrays, timer), n
        loaded = {**checkpoint_summary(meta), "bytes": path.stat().st_size, "seconds": None}
        break
    segments = {n: p for n, p in numbered(directory, LOG_NAME).items() if n >= gen}
    if state is None:
        state = ShardState(cfg, index, timer)
        if checkpoints and 0 not in segments:
            raise DurabilityError(
                f"{directory}: no checkpoint reads back intact and the log from the empty "
                "state is gone; restore the data dir from a backup"
            )
    order = sorted(segments)
    replayed, truncate_to = 0, 0
    for n in order:
        reader = LogReader(segments[n])
        for record in reader:
            state.apply(record_to_event(record))
            replayed += 1
        if reader.torn_at is not None and n != order[-1]:
            raise WalError(
                f"{segments[n]}: torn at byte {reader.torn_at} but later segments exist; "
                "the log is corrupted in the middle"
            )
        truncate_to = reader.end_offset if reader.torn_at is not None else 0
    logger.log(
        level,
        "shard %d recovered: checkpoint %s, %d log records replayed, versions %s",
        index,
        gen or "none",
        replayed,
        state.versions(),
        extra={"shard": index, "checkpoint": gen, "replayed": replayed},
    )
    segment = order[-1] if order else gen
    return Recovered(state, gen, segment, truncate_to, replayed, skipped, loaded)
