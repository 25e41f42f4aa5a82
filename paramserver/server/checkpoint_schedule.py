"""When a shard begins a checkpoint and what a written one covered; pure bookkeeping.

`CheckpointSchedule` counts the durable events (log records, and the outer
steps among them) since the last written checkpoint; `ShardCore.settle` adds
each batch's (`stored`). A checkpoint is due every `checkpoint_every_steps` steps or,
with events unsaved, every `checkpoint_every_s` seconds; never while one is
being written, while a step is under way (a checkpoint copies the state at a
step boundary), before the model is initialised, or within
`CHECKPOINT_RETRY_S` of a failed attempt. A checkpoint written in the
background covers what had happened when it began (`started`); events served
meanwhile stay counted for the next one. Nothing here reads a clock: `now`
(wall-clock seconds) is an argument.
"""

from __future__ import annotations

import dataclasses
from typing import Any

CHECKPOINT_RETRY_S = 10.0  # a failed checkpoint is tried again after this long


@dataclasses.dataclass
class CheckpointSchedule:
    """One shard's checkpoint clock and counts (see the module docstring)."""

    every_steps: int  # ShardConfig.checkpoint_every_steps (0: not by steps)
    every_s: float  # ShardConfig.checkpoint_every_s (0: not by time)
    last_at: float  # when the last one was written (or the shard started)
    records_since: int = 0  # durable events since the last written checkpoint
    steps_since: int = 0  # outer steps among them
    retry_at: float = 0.0  # no attempt before this (after a failure)
    writing: bool = False  # one is being written
    covered: tuple[int, int] = (0, 0)  # (records, steps) the one being written covers
    last: dict[str, Any] | None = None  # the last written (or loaded) one, for status
    failures: int = 0  # failed attempts since the last written one
    error: str | None = None  # the last failure

    @property
    def unsaved(self) -> bool:
        """Whether durable events happened since the last checkpoint."""
        return self.records_since > 0

    def stored(self, records: int, steps: int) -> None:
        """Count a batch of durable events.

        Args:
            records: log records that became durable.
            steps: outer steps among them.
        """
        self.records_since += records
        self.steps_since += steps

    def due(self, now: float, stepping: bool, initialized: bool) -> bool:
        """Whether to begin a checkpoint now.

        Args:
            now: wall-clock seconds.
            stepping: a step is under way.
            initialized: the shard holds a model.

        Returns:
            True when due by steps or by time and nothing forbids one.
        """
        if self.writing or now < self.retry_at or stepping or not initialized:
            return False
        by_steps = self.every_steps and self.steps_since >= self.every_steps
        by_time = self.every_s and self.unsaved and now - self.last_at >= self.every_s
        return bool(by_steps or by_time)

    def started(self) -> None:
        """A checkpoint of the state as it is now is being written."""
        self.writing = True
        self.covered = (self.records_since, self.steps_since)

    def done(self, now: float, written: bool, summary: dict[str, Any] | None, error: str) -> None:
        """The end of an attempt (begun with `started` or written in one go).

        Args:
            now: wall-clock seconds.
            written: whether it is durable (False: try again after CHECKPOINT_RETRY_S).
            summary: a written one's status entry.
            error: why a failed one failed (one line).
        """
        if not self.writing:  # written in one go: it covers everything so far
            self.covered = (self.records_since, self.steps_since)
        self.writing = False
        if written:
            self.records_since -= self.covered[0]
            self.steps_since -= self.covered[1]
            self.last_at, self.last = now, summary
            self.failures, self.error = 0, None
        else:
            self.retry_at = now + CHECKPOINT_RETRY_S
            self.failures += 1
            self.error = error or "not written"

    def report(self) -> dict[str, Any]:
        """The checkpoint fields of status (JSON-ready).

        Returns:
            last_checkpoint (None or generation, step, versions, time, bytes,
            seconds; seconds None for the one loaded at start),
            checkpoint_writing, checkpoint_failures (since the last written
            one) and checkpoint_error (the last failure, or None).
        """
        return {
            "last_checkpoint": self.last,
            "checkpoint_writing": self.writing,
            "checkpoint_failures": self.failures,
            "checkpoint_error": self.error,
        }
