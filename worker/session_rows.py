"""A session's metrics rows: one per round and a final one, and the training report.

`SessionRows` is a part of `worker.session.Session` (a base class that holds no
state of its own): at each round's end `Session.step` writes the round's row
(``<data_dir>/metrics.jsonl`` on process 0, `worker.island_files`) with the
goodput `worker.goodput` derives, then tells the shards the round's train loss,
step rate and goodput; `close` writes the final row.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from paramserver.client import Client
from worker import island_files
from worker.deltas import DeltaLedger
from worker.goodput import RoundClock
from worker.leader_sync import LeaderSync


class SessionRows:
    """The metrics rows of a `Session` (whose state the annotations below name)."""

    island: str
    sizes: list[int]
    data_dir: Path | None
    leader_sync: LeaderSync
    client: Client | None
    ledger: DeltaLedger
    goodput_clock: RoundClock
    row_fields: Callable[[int], dict[str, Any]] | None
    row_tags: dict[str, Any]
    last_row: dict[str, Any]
    inner_steps: int
    round: int
    steps: int
    tokens: int
    adopted: int
    _round_losses: list[Any]
    stats: dict[str, Any]  # `Session.stats`, a property

    @property
    def goodput(self) -> float | None:
        """Share of the session's wall time spent on inner steps whose work entered the model.

        `worker.goodput` defines it: waits, back-pressure, the exchange's time in
        `step` and rejected work are lost, staleness is not; deltas in flight and
        the caller's own time the session is told of (the row hook, `caller_time`)
        are left out. It is the figure of the newest metrics row (each round's end, and
        the final row at close), the one `diloco-worker status` shows and the
        shards and their page get: one goodput everywhere.

        Returns:
            The share, or None before any time settled.
        """
        return self.last_row.get("goodput")

    def log_row(self, row: dict[str, Any]) -> dict[str, Any]:
        """Append a metrics row with the session's common fields (process 0, with a data dir).

        Args:
            row: the row's own fields.

        Returns:
            The row as written (common fields first).
        """
        full = {
            "island": self.island,
            "params": sum(self.sizes),
            **self.row_tags,
            "time_s": round(time.monotonic() - self.goodput_clock.started, 3),
            "wall": time.time(),
            **row,
        }
        if self.data_dir is not None and self.leader_sync.leader:
            island_files.append_row(self.data_dir, full)
        self.last_row = full
        return full

    def stats_fields(self, final: bool = False) -> dict[str, Any]:
        """The counters a metrics row carries and the goodput they imply.

        Args:
            final: the client has closed: acked deltas count as merged, unacked ones
                and unpushed work as lost, and the wall time ends with the last
                `step` (the flush and the caller's own epilogue are not island time).

        Returns:
            The row's fields (`RoundClock.fields`).
        """
        shares = [size / sum(self.sizes) for size in self.sizes]
        if final:
            self.ledger.settle_final()
            self.goodput_clock.drop_unpushed(shares)
        now = time.monotonic()
        if final and self.goodput_clock.last_end is not None:
            now = self.goodput_clock.last_end
        return self.goodput_clock.fields(self.stats, self.tokens, self.steps, now, shares)

    def _round_row(self) -> None:
        extra = {}
        if self.row_fields is not None:  # the caller's own time (its evaluation): not lost
            t0 = time.monotonic()
            extra = self.row_fields(self.round)
            self.goodput_clock.caller_time(time.monotonic() - t0, between_steps=False)
        # the client keeps ack latencies until taken: take the round's (bounded memory)
        latencies = self.client.ack_latencies() if self.client is not None else []
        if latencies:
            extra = {"ack_latency_s": round(float(np.median(latencies)), 4), **extra}
        self.log_row(
            {
                "round": self.round,
                "round_s": self.goodput_clock.round_done(time.monotonic()),
                "versions_adopted": self.adopted,
                **self.stats_fields(),
                **extra,
            }
        )
        self.adopted = 0

    def _report_training(self) -> None:
        """Tell the shards the round's train loss (`step`'s, else the row's), step rate, goodput."""
        losses, self._round_losses = self._round_losses, []
        if self.client is None:
            return
        row = self.last_row
        loss, round_s, share = row.get("loss"), row.get("round_s"), row.get("goodput")
        if losses:
            loss = float(np.mean([float(x) for x in losses]))
        finite = isinstance(loss, int | float) and math.isfinite(loss)
        self.client.report_training(
            inner_loss=float(loss) if finite else None,
            steps_per_s=self.inner_steps / round_s if round_s else None,
            goodput=min(1.0, max(0.0, float(share))) if share is not None else None,
        )
