"""What a session measures and reports: step times, waits, goodput, and a model mismatch.

`RoundClock` keeps the times a session needs (its start, the caller's step
durations between two `Session.step` calls, sync-mode waits, the round's
start) and turns them and the client's counters into a metrics row's fields
(goodput as `worker.goodput` defines it). `cluster_difference` turns the
client's plan-mismatch error into one that names the first differing leaf.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from paramserver.client import ClientError
from paramserver.plumbing import probe
from paramserver.plumbing.model_diff import FRESH_CLUSTER, model_size
from worker.config import IslandConfig
from worker.goodput import goodput, step_rate
from worker.param_tree import TreeLayout


@dataclasses.dataclass
class RoundClock:
    """Times of one session (monotonic seconds); pure bookkeeping, the caller passes `now`."""

    started: float
    round_started: float = -1.0
    step_times: list[float] = dataclasses.field(default_factory=list)
    wait_s: float = 0.0
    last_end: float | None = None

    def __post_init__(self) -> None:
        if self.round_started < 0:
            self.round_started = self.started

    def step_started(self, now: float) -> None:
        """A `step` call began: the caller's step took the time since the last one ended."""
        if self.last_end is not None:
            self.step_times.append(now - self.last_end)
            del self.step_times[:-256]

    def step_ended(self, now: float) -> None:
        """A `step` call returns now."""
        self.last_end = now

    def waited(self, seconds: float) -> None:
        """Add time spent waiting for a merge."""
        self.wait_s += seconds

    def median_step_s(self, last: int) -> float:
        """Median of the last `last` step times (1 ms before any was measured)."""
        recent = self.step_times[-last:]
        return float(np.median(recent)) if recent and np.median(recent) > 0 else 1e-3

    def round_done(self, now: float) -> float:
        """Seconds the round that ends now took; starts the next one."""
        seconds, self.round_started = now - self.round_started, now
        return round(seconds, 3)

    def fields(self, stats: dict[str, Any], tokens: int, steps: int, now: float) -> dict[str, Any]:
        """The counters a metrics row carries and the goodput they imply.

        Args:
            stats: `Client.stats()` ({} on a process other than 0).
            tokens: tokens the session counted.
            steps: step calls so far.
            now: monotonic time.

        Returns:
            steps, tokens, version_lag, bytes, pushes, acked, rejected, pending,
            credited_tokens, capacity_tokens, wait_s, goodput.
        """
        rate = step_rate(self.step_times, round(tokens / steps) if steps else 0)
        capacity = (now - self.started) * rate if rate else 0.0
        credited = float(stats.get("credited_tokens", 0.0))
        return {
            "steps": steps,
            "tokens": tokens,
            "version_lag": max(0, stats.get("version_lag", 0)),
            "bytes_sent": stats.get("bytes_sent", 0),
            "bytes_received": stats.get("bytes_received", 0),
            "pushes": stats.get("pushes", 0),
            "acked": stats.get("acked", 0),
            "rejected": sum(stats.get("rejected", {}).values()),
            "pending": stats.get("pending", 0),
            "credited_tokens": round(credited, 1),
            "capacity_tokens": round(capacity, 1),
            "wait_s": round(self.wait_s, 3),
            "goodput": goodput(credited, capacity) or 0.0,
        }


def cluster_difference(exc: ClientError, cfg: IslandConfig, layout: TreeLayout) -> ClientError:
    """The join error to raise: a plan mismatch names the first differing leaf.

    Args:
        exc: the client's join error.
        cfg: the island's settings (endpoint, CURVE keys).
        layout: the session's parameter tree.

    Returns:
        `exc` itself, or for a plan mismatch a ClientError naming the leaf (path,
        shape or dtype) where `params` and the cluster's model first differ.
    """
    if "plan mismatch" not in str(exc) or "is not the cluster's" in str(exc):
        return exc  # not a mismatch, or the client named the models already (from the welcome)
    if cfg.curve_secret_key_file:
        return exc
    try:
        plan, _flat, _versions = probe.global_params(cfg.connect, timeout_s=5.0)
    except probe.ProbeError:
        return exc
    where = layout.first_difference(list(plan.leaves))
    if where is None:
        return exc  # the same leaves: the cluster was cut into other shards or fragments
    return ClientError(
        f"join: plan mismatch: params do not match the cluster's model "
        f"({model_size(plan.leaves)}): {where}; join with the model the cluster trains, "
        f"or {FRESH_CLUSTER}"
    )
