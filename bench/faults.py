"""Fault schedules as data, and the pure numbers a chaos run is judged by.

This module owns what a chaos run injects and how its outcome is computed,
with no processes, sockets or files: `make_schedule` turns (seed, count,
duration, cluster shape) into a list of `Fault`s; `recovery_s`,
`ack_keys` and `useful_tokens` compute the report's figures.

Fault kinds (who executes them):

- harness (bench.chaos): `kill_island` (kill -9, restart after `duration_s`),
  `pause_island` (SIGSTOP, SIGCONT after `duration_s`), `kill_shard`
  (kill -9, restart after `duration_s`: the shard recovers from its WAL and
  checkpoint);
- relay (bench.children.chaos_relay), for the messages between islands and shards
  within [at_s, at_s + duration_s]: `cut_link` (every message of one island,
  both ways, dropped), `slow_link` (every message of one island held
  `delay_ms`), `drop` / `duplicate` / `delay` / `corrupt` (each push or ack
  of one island dropped, sent twice, held up to `delay_ms`, or a payload
  byte flipped, with probability `prob`).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

HARNESS_KINDS = ("kill_island", "pause_island", "kill_shard")
RELAY_KINDS = ("cut_link", "slow_link", "drop", "duplicate", "delay", "corrupt")
KINDS = HARNESS_KINDS + RELAY_KINDS


@dataclasses.dataclass(frozen=True)
class Fault:
    """One injected fault: what, to whom, when (seconds after the start) and for how long."""

    kind: str
    target: str  # island name, or "shard-<i>"
    at_s: float
    duration_s: float
    prob: float = 1.0  # message faults: share of the target's messages hit
    delay_ms: float = 0.0  # slow_link / delay: how long a message is held

    def to_json(self) -> dict[str, Any]:
        """The fault as a JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Fault:
        """Inverse of `to_json`.

        Args:
            obj: a dict with the fields of Fault.

        Returns:
            The fault.

        Raises:
            ValueError: an unknown kind or a missing field.
        """
        try:
            fault = cls(**{f.name: obj[f.name] for f in dataclasses.fields(cls) if f.name in obj})
        except TypeError as exc:
            raise ValueError(f"bad fault {obj!r}: {exc}") from None
        if fault.kind not in KINDS:
            raise ValueError(f"bad fault kind {fault.kind!r}: use one of {', '.join(KINDS)}")
        return fault

    @property
    def end_s(self) -> float:
        """When the fault is over (restart issued, SIGCONT, window closed)."""
        return self.at_s + self.duration_s


def make_schedule(
    seed: int,
    count: int,
    duration_s: float,
    islands: Sequence[str],
    shards: int,
    kinds: Sequence[str] = KINDS,
    settle_s: float = 5.0,
) -> list[Fault]:
    """A deterministic fault schedule: same arguments, same faults.

    Faults start at evenly spaced instants in [settle_s, duration_s - settle_s)
    (with a seeded jitter of a quarter slot) and last min(slot / 2, 4 s), so
    each has time to end and be recovered from before the next: at least
    3/4 slot - its length passes between one fault's end and the next's start
    (18.5 s with 120 faults in an hour, 12.5 s with 27 in 10 minutes; an
    island's restart takes ~10 s on a loaded machine). Kinds cycle through a
    seeded shuffle of `kinds`, so every kind appears once `count` >= len(kinds)
    (count // len(kinds) times or one more); targets are drawn from the seed.

    Args:
        seed: the seed.
        count: number of faults (0 = an empty schedule: the fault-free run).
        duration_s: length of the run.
        islands: island names.
        shards: number of shards.
        kinds: fault kinds to draw from.
        settle_s: fault-free time at the start and the end.

    Returns:
        The faults, sorted by start.

    Raises:
        ValueError: an unknown kind, or no room for `count` faults.
    """
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"fault kinds {unknown or kinds!r}: use some of {', '.join(KINDS)}")
    if count < 0:
        raise ValueError(f"count={count}: must be >= 0")
    if count == 0:
        return []
    span = duration_s - 2 * settle_s
    slot = span / count if span > 0 else 0.0
    if slot < 2.0:
        raise ValueError(
            f"{count} faults do not fit in {duration_s:g}s (need >= 2 s each after "
            f"{settle_s:g}s settling at both ends): lengthen the run or inject fewer"
        )
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    faults = []
    for i in range(count):
        kind = order[i % len(order)]
        at = settle_s + i * slot + rng.uniform(0.0, slot / 4)
        length = min(slot / 2, 4.0)
        target = (
            f"shard-{rng.randrange(shards)}" if kind == "kill_shard" else rng.choice(list(islands))
        )
        prob = 0.5 if kind in ("drop", "duplicate", "delay", "corrupt") else 1.0
        delay_ms = {"slow_link": 300.0, "delay": 800.0}.get(kind, 0.0)
        faults.append(Fault(kind, target, round(at, 3), round(length, 3), prob, delay_ms))
    return faults


def active(faults: Iterable[Fault], t: float) -> list[Fault]:
    """The faults in effect at `t` seconds after the start.

    Args:
        faults: the schedule.
        t: seconds since the start.

    Returns:
        Faults with at_s <= t < end_s.
    """
    return [f for f in faults if f.at_s <= t < f.end_s]


def training_rate(rounds: Sequence[tuple[float, float]]) -> float | None:
    """An island's training rate: its tokens over its seconds, summed over rounds.

    A mean, not a median: goodput's time base is wall time, and on a loaded
    machine the median round is shorter than the mean one (by 15-20% at load
    6), so a median rate would charge the machine's noise as lost time. Pass
    only rounds no fault slowed (`bench.chaos_score` leaves out the rounds that
    overlap a fault's span).

    Args:
        rounds: (tokens, seconds) of each round (without the compiling first one).

    Returns:
        Tokens per second, or None without usable rounds.
    """
    seconds = sum(s for _t, s in rounds if s > 0)
    if seconds <= 0:
        return None
    return sum(t for t, s in rounds if s > 0) / seconds


def recovery_s(end: float, progress_times: Sequence[float]) -> float | None:
    """Seconds from the end of a fault until the target next made progress.

    Args:
        end: when the fault ended (same clock as the times).
        progress_times: when the target made progress (an ack delivered to the
            island, a version advance of the shard), any order.

    Returns:
        The delay to the first progress at or after `end`, or None if none came.
    """
    later = [t for t in progress_times if t >= end]
    return min(later) - end if later else None


def ack_keys(acks: Iterable[Sequence[Any]]) -> set[tuple[str, int, int]]:
    """Unique (island, fragment, round) keys of acked deltas.

    Args:
        acks: (island, fragment, round, ...) entries as the relay records them.

    Returns:
        The set of keys.
    """
    return {(str(a[0]), int(a[1]), int(a[2])) for a in acks}


def useful_tokens(
    keys: Iterable[tuple[str, int, int]], tokens: Mapping[tuple[str, int, int], int], fragments: int
) -> float:
    """Tokens that reached the model: each applied delta carries 1/fragments of its round's tokens.

    Args:
        keys: applied (island, fragment, round) keys.
        tokens: key -> tokens the push declared.
        fragments: fragments in the plan.

    Returns:
        The sum.
    """
    return sum(tokens.get(k, 0) for k in keys) / fragments
