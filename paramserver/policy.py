"""The merge policy: when a fragment takes an outer step. Pure functions of (now, state, config).

This module owns the step decision and the arrival statistics it uses; the
shard's I/O loop calls `decide` after every arrival and at `wake_at`, and
never waits on an island that is not live.

Modes:
    sync:   step once every live island has a pending delta.
    quorum: once `min(quorum, live)` distinct islands are pending, wait a grace
            window (a fraction of the typical inter-arrival time, clamped), then
            step; step at once if every live island is already pending.
    async:  step on every pending delta.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MODES = ("sync", "quorum", "async")


class PolicyError(ValueError):
    """An invalid policy setting or argument."""


@dataclass(frozen=True)
class PolicyConfig:
    """Merge-policy settings.

    Attributes:
        mode: "sync", "quorum" or "async".
        quorum: distinct islands needed before the grace window starts (quorum mode).
        grace_fraction: grace window as a fraction of the EMA inter-arrival time.
        grace_min_s: lower clamp of the grace window (and its value before any EMA).
        grace_max_s: upper clamp of the grace window.
        ema_alpha: EMA weight of the newest inter-arrival time, in (0, 1].
    """

    mode: str = "quorum"
    quorum: int = 2
    grace_fraction: float = 0.5
    grace_min_s: float = 0.05
    grace_max_s: float = 30.0
    ema_alpha: float = 0.3

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise PolicyError(f"mode={self.mode!r} is unknown; choose one of {MODES}")
        if isinstance(self.quorum, bool) or not isinstance(self.quorum, int) or self.quorum < 1:
            raise PolicyError(f"quorum={self.quorum!r} must be an int >= 1")
        for name in ("grace_fraction", "grace_min_s", "grace_max_s"):
            value = getattr(self, name)
            if not _finite(value) or value < 0:
                raise PolicyError(f"{name}={value!r} must be a finite number >= 0")
        if self.grace_max_s < self.grace_min_s:
            raise PolicyError(
                f"grace_max_s={self.grace_max_s} < grace_min_s={self.grace_min_s}; "
                "raise grace_max_s or lower grace_min_s"
            )
        if not _finite(self.ema_alpha) or not 0 < self.ema_alpha <= 1:
            raise PolicyError(f"ema_alpha={self.ema_alpha!r} must be in (0, 1]")


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_time(name: str, value: object) -> float:
    if not _finite(value):
        raise PolicyError(f"{name}={value!r} must be a finite time in seconds")
    return float(value)


@dataclass(frozen=True)
class ArrivalStats:
    """Arrival statistics of one fragment's deltas; `ArrivalStats()` is the empty state.

    Attributes:
        ema_interarrival_s: EMA of the time between deltas, None before two arrivals.
        last_arrival: time of the latest delta, None before any.
        count: deltas observed.
    """

    ema_interarrival_s: float | None = None
    last_arrival: float | None = None
    count: int = 0


def observe(stats: ArrivalStats, now: float, alpha: float = 0.3) -> ArrivalStats:
    """Record one delta arrival.

    Args:
        stats: the statistics so far.
        now: arrival time (seconds, monotonic clock); an earlier time than the
            last arrival counts as a zero gap.
        alpha: EMA weight of the newest gap, in (0, 1]; pass PolicyConfig.ema_alpha.

    Returns:
        The updated statistics.
    """
    now = _check_time("now", now)
    if not _finite(alpha) or not 0 < alpha <= 1:
        raise PolicyError(f"alpha={alpha!r} must be in (0, 1]")
    if stats.last_arrival is None:
        return ArrivalStats(None, now, stats.count + 1)
    gap = max(0.0, now - stats.last_arrival)
    ema = (
        gap
        if stats.ema_interarrival_s is None
        else alpha * gap + (1.0 - alpha) * stats.ema_interarrival_s
    )
    return ArrivalStats(ema, max(now, stats.last_arrival), stats.count + 1)


@dataclass(frozen=True)
class PendingDelta:
    """A delta waiting to be merged: which island sent it and when it arrived."""

    island: str
    arrived: float


@dataclass(frozen=True)
class Decision:
    """Whether to step now; if not, when to ask again (None: on the next arrival)."""

    step: bool
    wake_at: float | None
    reason: str


def grace_window(stats: ArrivalStats, cfg: PolicyConfig) -> float:
    """The quorum grace window.

    Args:
        stats: the fragment's arrival statistics.
        cfg: policy settings.

    Returns:
        clamp(grace_fraction * EMA inter-arrival, grace_min_s, grace_max_s), or
        grace_min_s before an EMA exists.
    """
    if stats.ema_interarrival_s is None:
        return cfg.grace_min_s
    return min(cfg.grace_max_s, max(cfg.grace_min_s, cfg.grace_fraction * stats.ema_interarrival_s))


def _first_arrivals(pending: Iterable[PendingDelta]) -> dict[str, float]:
    first: dict[str, float] = {}
    for p in pending:
        t = _check_time("pending arrival", p.arrived)
        if p.island not in first or t < first[p.island]:
            first[p.island] = t
    return first


def decide(
    now: float,
    pending: Sequence[PendingDelta],
    live_islands: frozenset[str],
    stats: ArrivalStats,
    cfg: PolicyConfig,
) -> Decision:
    """Decide whether a fragment steps now.

    Args:
        now: current time (same clock as the arrivals).
        pending: deltas waiting for this fragment (from any island, live or not).
        live_islands: islands currently live (see paramserver.liveness).
        stats: the fragment's arrival statistics.
        cfg: policy settings.

    Returns:
        Decision(step, wake_at, reason); wake_at is the deadline to re-check
        when waiting on the grace window, else None.
    """
    now = _check_time("now", now)
    first = _first_arrivals(pending)
    if not first:
        return Decision(False, None, "nothing pending")
    if cfg.mode == "async":
        return Decision(True, None, "async: delta pending")
    missing = set(live_islands) - first.keys()
    if not missing:
        return Decision(True, None, f"{cfg.mode}: all {len(live_islands)} live islands pending")
    if cfg.mode == "sync":
        return Decision(False, None, f"sync: waiting for {len(missing)} live islands")
    needed = min(cfg.quorum, max(1, len(live_islands)))
    if len(first) < needed:
        return Decision(False, None, f"quorum: {len(first)} of {needed} islands pending")
    reached_at = sorted(first.values())[needed - 1]
    deadline = reached_at + grace_window(stats, cfg)
    if now >= deadline:
        return Decision(True, None, f"quorum: {len(first)} islands pending, grace window over")
    return Decision(False, deadline, f"quorum: {len(first)} islands pending, in grace window")
