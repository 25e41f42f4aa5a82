"""Goodput: the share of an island's compute that became model progress. Pure functions.

DESIGN.md, "What counts as useful work": goodput is the tokens that entered
the model (each delta's tokens times its staleness factor g(s), as the shards
credit them; rejected or never-merged deltas count zero) over the tokens the
island could have trained in the same wall time at its own speed. Waiting (a
sync barrier, back-pressure, restarts) produces no tokens, so it shows as lost.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def step_rate(step_times_s: Sequence[float], tokens_per_step: int) -> float | None:
    """An island's training rate at its own speed: tokens per second of stepping.

    Args:
        step_times_s: durations of recent inner steps, padding to the emulated
            speed included (compile excluded: islands warm up first).
        tokens_per_step: tokens one inner step trains.

    Returns:
        tokens_per_step / median step time, or None without usable steps.
    """
    times = sorted(t for t in step_times_s if math.isfinite(t) and t > 0)
    if not times or tokens_per_step <= 0:
        return None
    mid = len(times) // 2
    median = times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2
    return tokens_per_step / median


def goodput(useful_tokens: float, capacity_tokens: float) -> float | None:
    """Share of a training capacity that reached the model.

    Args:
        useful_tokens: tokens credited by the shards (staleness-weighted).
        capacity_tokens: tokens the island(s) could have trained in the same
            wall time (seconds x training rate).

    Returns:
        useful / capacity (may exceed 1 a little on a noisy machine), or None
        without capacity.
    """
    return useful_tokens / capacity_tokens if capacity_tokens > 0 else None
