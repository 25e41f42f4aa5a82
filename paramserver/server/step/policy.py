"""The merge policy: when a fragment takes an outer step. Pure functions of (now, state, config).

This module owns the step decision and the arrival statistics it uses; the
shard's I/O loop calls `decide` after every arrival and at `wake_at`, and
never waits on an island that is not live.

Modes:
    sync:   step once every live island has a pending delta.
    quorum: once `min(quorum, live)` distinct islands are pending, wait a grace
            window, then step; step at once if every live island is already pending.
    async:  step on every pending delta.

Grace rules (quorum mode):
    fraction: `grace_fraction` x the EMA inter-arrival time of the fragment's deltas.
    eq3:      Decoupled DiLoCo's adaptive window (its Eq. 3), which spends only slack
              that exists anyway::

                  grace = gamma * (tau * t_step - t_quorum - t_sync)

              `tau` is the overlap: the inner steps an island trains on while its
              delta is merged before it needs the result (`grace_overlap_steps`, one
              step by default, as in the paper), `t_step` the EMA of the inner-step
              time a quorum island reports (the fastest island of the quorum counts),
              `t_quorum` the EMA of the time from the first pending delta's arrival
              to reaching the quorum, `t_sync` the EMA of a step's own time (logging
              it, merging, the outer step; the publish that follows is a send and is
              not counted). Each term is an EMA of its own samples, so the slack is
              the overlap left after the average quorum wait and step. The window
              used to take tau as the islands' H (a round, up to 30 s at the clamp),
              which made a quorum of 1 wait for nearly every island: 13 versions in
              12 rounds.
    Both are clamped to [grace_min_s, grace_max_s]; eq3 uses grace_min_s until an
    island of the quorum reported its step time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from paramserver.plumbing.validate import Checks

MODES = ("sync", "quorum", "async")
GRACE_RULES = ("fraction", "eq3")


class PolicyError(ValueError):
    """An invalid policy setting or argument."""


@dataclass(frozen=True)
class PolicyConfig:
    """Merge-policy settings.

    Attributes:
        mode: "sync", "quorum" or "async".
        quorum: distinct islands needed before the grace window starts (quorum mode).
        grace_rule: "fraction" or "eq3" (see the module docstring).
        grace_fraction: fraction rule: window as a fraction of the EMA inter-arrival time.
        grace_gamma: eq3 rule: the share of the slack spent waiting, in (0, 1).
        grace_overlap_steps: eq3 rule: tau, the inner steps of overlap (>= 1).
        grace_min_s: lower clamp of the grace window (and its value before any EMA).
        grace_max_s: upper clamp of the grace window.
        ema_alpha: EMA weight of the newest inter-arrival time, in (0, 1].
    """

    mode: str = "quorum"
    quorum: int = 2
    grace_rule: str = "eq3"
    grace_fraction: float = 0.5
    grace_gamma: float = 0.5
    grace_overlap_steps: int = 1
    grace_min_s: float = 0.05
    grace_max_s: float = 30.0
    ema_alpha: float = 0.3

    def __post_init__(self) -> None:
        check = Checks("PolicyConfig", PolicyError)
        check.choice("mode", self.mode, MODES)
        check.integer("quorum", self.quorum, 1)
        check.choice("grace_rule", self.grace_rule, GRACE_RULES)
        check.number("grace_gamma", self.grace_gamma, above=0.0, below=1.0)
        check.integer("grace_overlap_steps", self.grace_overlap_steps, 1)
        for name in ("grace_fraction", "grace_min_s", "grace_max_s"):
            check.number(name, getattr(self, name), low=0.0)
        check.require(
            self.grace_max_s >= self.grace_min_s,
            "grace_max_s",
            self.grace_max_s,
            f"must be >= grace_min_s={self.grace_min_s}: raise it or lower grace_min_s",
        )
        check.number("ema_alpha", self.ema_alpha, above=0.0, high=1.0)


def _check_time(name: str, value: object) -> float:
    # `validate.is_finite_number`, inline: it runs at every decision
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PolicyError(f"{name}={value!r} must be a finite time in seconds")
    return float(value)


@dataclass(frozen=True)
class ArrivalStats:
    """Arrival statistics of one fragment's deltas; `ArrivalStats()` is the empty state.

    Attributes:
        ema_interarrival_s: EMA of the time between deltas, None before two arrivals.
        last_arrival: time of the latest delta, None before any.
        count: deltas observed.
        ema_quorum_s: EMA of the time from the first pending arrival to the quorum.
        ema_sync_s: EMA of a step's own time (log append, merge, outer step).
    """

    ema_interarrival_s: float | None = None
    last_arrival: float | None = None
    count: int = 0
    ema_quorum_s: float | None = None
    ema_sync_s: float | None = None


def _ema(old: float | None, sample: float, alpha: float) -> float:
    return sample if old is None else alpha * sample + (1.0 - alpha) * old


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
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha <= 1:
        raise PolicyError(f"alpha={alpha!r} must be in (0, 1]")
    if stats.last_arrival is None:
        return ArrivalStats(None, now, stats.count + 1)
    gap = max(0.0, now - stats.last_arrival)
    ema = _ema(stats.ema_interarrival_s, gap, alpha)
    return replace(stats, ema_interarrival_s=ema, last_arrival=max(now, stats.last_arrival),
                   count=stats.count + 1)  # fmt: skip


def observe_step(
    stats: ArrivalStats, quorum_s: float | None, sync_s: float, alpha: float = 0.3
) -> ArrivalStats:
    """Record one outer step's timings (for the eq3 grace rule).

    Args:
        stats: the fragment's statistics so far.
        quorum_s: seconds from the first pending delta's arrival to reaching the
            quorum (`quorum_reached`), None when unknown; negative counts as 0.
        sync_s: seconds the step took (log append, merge, outer step), >= 0.
        alpha: EMA weight of the newest sample, in (0, 1].

    Returns:
        The updated statistics.
    """
    sync_s = _check_time("sync_s", sync_s)
    ema_quorum = stats.ema_quorum_s
    if quorum_s is not None:
        ema_quorum = _ema(ema_quorum, max(0.0, _check_time("quorum_s", quorum_s)), alpha)
    return replace(
        stats, ema_quorum_s=ema_quorum, ema_sync_s=_ema(stats.ema_sync_s, max(0.0, sync_s), alpha)
    )


@dataclass(frozen=True)
class IslandPace:
    """An island's reported pace: EMA of its inner-step time and its steps per round."""

    step_s: float
    steps: int | None = None

    @property
    def round_s(self) -> float | None:
        """steps * t_step: the island's round time (its latest push's inner steps), None before it."""
        return None if self.steps is None else self.step_s * self.steps

    def report(self) -> dict[str, float | int | None]:
        """JSON-ready: step_s, steps, round_s."""
        return {"step_s": self.step_s, "steps": self.steps, "round_s": self.round_s}


def pace_report(pace: IslandPace | None, header: Mapping[str, Any]) -> IslandPace | None:
    """An island's pace after one of its messages (`t_step`; a push's `steps`).

    Args:
        pace: the island's pace so far (None: nothing reported yet).
        header: a validated request header (push, heartbeat or any other kind).

    Returns:
        The updated pace (unchanged when the message reports nothing).
    """
    steps = header.get("steps") if header.get("kind") == "push" else None
    return observe_pace(pace, header.get("t_step"), steps)


def observe_pace(
    pace: IslandPace | None, t_step: float | None, steps: int | None, alpha: float = 0.3
) -> IslandPace | None:
    """Record an island's reported step time (push or heartbeat) and steps per round.

    Args:
        pace: the island's pace so far (None: nothing reported yet).
        t_step: the reported inner-step time in seconds (> 0), None if not reported.
        steps: inner steps of its latest push, None for a heartbeat.

    Returns:
        The updated pace (unchanged without a report).
    """
    if t_step is None:
        if pace is None or steps is None:
            return pace
        return replace(pace, steps=steps)
    t_step = _check_time("t_step", t_step)
    step_s = t_step if pace is None else _ema(pace.step_s, t_step, alpha)
    return IslandPace(step_s, steps if steps is not None else (pace.steps if pace else None))


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


def grace_window(stats: ArrivalStats, cfg: PolicyConfig, overlap_s: float | None = None) -> float:
    """The quorum grace window.

    Args:
        stats: the fragment's arrival and step statistics.
        cfg: policy settings.
        overlap_s: eq3 rule: tau * t_step of the fastest island of the quorum
            (tau = grace_overlap_steps), None when no island of the quorum
            reported its step time.

    Returns:
        fraction rule: clamp(grace_fraction * EMA inter-arrival, grace_min_s,
        grace_max_s), or grace_min_s before an EMA exists. eq3 rule:
        clamp(gamma * (overlap_s - t_quorum - t_sync), grace_min_s, grace_max_s)
        with unmeasured EMAs counted as 0, or grace_min_s without overlap_s.
    """
    if cfg.grace_rule == "eq3":
        if overlap_s is None:
            return cfg.grace_min_s
        slack = overlap_s - (stats.ema_quorum_s or 0.0) - (stats.ema_sync_s or 0.0)
        return min(cfg.grace_max_s, max(cfg.grace_min_s, cfg.grace_gamma * slack))
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


def quorum_needed(live_islands: frozenset[str], cfg: PolicyConfig) -> int:
    """Distinct pending islands that form the quorum: min(quorum, live), at least 1."""
    return min(cfg.quorum, max(1, len(live_islands)))


def quorum_reached(pending: Sequence[PendingDelta], needed: int) -> tuple[float, float] | None:
    """When the pending deltas first reached a quorum.

    Args:
        pending: deltas waiting for a fragment.
        needed: distinct islands that form the quorum (>= 1).

    Returns:
        (first arrival, arrival that completed the quorum), None if not reached.
    """
    times = sorted(_first_arrivals(pending).values())
    if len(times) < max(1, needed):
        return None
    return times[0], times[needed - 1]


def quorum_time(
    pending: Sequence[PendingDelta], live_islands: frozenset[str], cfg: PolicyConfig
) -> float | None:
    """The t_quorum sample of a step: first pending arrival to reaching the quorum.

    Args:
        pending: the deltas the step merges.
        live_islands: islands live at the step.
        cfg: policy settings.

    Returns:
        Seconds, or None when the quorum was not reached (a sync or async step,
        or every live island pending before the quorum).
    """
    reached = quorum_reached(pending, quorum_needed(live_islands, cfg))
    return None if reached is None else reached[1] - reached[0]


def decide(
    now: float,
    pending: Sequence[PendingDelta],
    live_islands: frozenset[str],
    stats: ArrivalStats,
    cfg: PolicyConfig,
    paces: Mapping[str, IslandPace] | None = None,
) -> Decision:
    """Decide whether a fragment steps now.

    Args:
        now: current time (same clock as the arrivals).
        pending: deltas waiting for this fragment (from any island, live or not).
        live_islands: islands currently live (see paramserver.wire.protocol.live_islands).
        stats: the fragment's arrival statistics.
        cfg: policy settings.
        paces: island -> reported pace (eq3 grace rule); None: none reported.

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
    needed = quorum_needed(live_islands, cfg)
    if len(first) < needed:
        return Decision(False, None, f"quorum: {len(first)} of {needed} islands pending")
    order = sorted(first, key=lambda island: (first[island], island))
    reached_at = first[order[needed - 1]]
    steps = [p.step_s for island in order[:needed] if (p := (paces or {}).get(island))]
    overlap = cfg.grace_overlap_steps * min(steps) if steps else None  # tau * t_step
    deadline = reached_at + grace_window(stats, cfg, overlap)
    if now >= deadline:
        return Decision(True, None, f"quorum: {len(first)} islands pending, grace window over")
    return Decision(False, deadline, f"quorum: {len(first)} islands pending, in grace window")
