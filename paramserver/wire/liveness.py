"""Liveness decisions (Paranoid Pirate style): pure functions of time.

This module owns when a peer counts as dead (silent for more than `liveness`
heartbeat intervals) and the capped exponential back-off of reconnects. When an
unacked delta is sent again is the ack timer of `paramserver.client.ledger` (an adaptive timeout).
Callers pass a monotonic clock's `now`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping


class LivenessError(ValueError):
    """An invalid time, interval, or attempt number."""


def _number(name: str, value: object, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise LivenessError(f"{name}={value!r} must be a finite number")
    if positive and value <= 0:
        raise LivenessError(f"{name}={value!r} must be > 0")
    return float(value)


def is_silent(now: float, last_heard: float, interval_s: float, liveness: float) -> bool:
    """Whether a peer has been silent too long.

    Args:
        now: current time, seconds.
        last_heard: when anything was last received from the peer.
        interval_s: heartbeat interval, > 0.
        liveness: intervals of silence tolerated, > 0.

    Returns:
        True once now - last_heard exceeds liveness * interval_s.
    """
    now = _number("now", now)
    last_heard = _number("last_heard", last_heard)
    budget = _number("interval_s", interval_s, positive=True) * _number(
        "liveness", liveness, positive=True
    )
    return now - last_heard > budget


def live_islands(
    now: float, last_seen: Mapping[str, float], interval_s: float, liveness: float
) -> frozenset[str]:
    """The islands that are not silent.

    Args:
        now: current time, seconds.
        last_seen: island -> when it was last heard from.
        interval_s: heartbeat interval, > 0.
        liveness: intervals of silence tolerated, > 0.

    Returns:
        The live island ids.
    """
    _number("interval_s", interval_s, positive=True)
    _number("liveness", liveness, positive=True)
    return frozenset(
        island for island, t in last_seen.items() if not is_silent(now, t, interval_s, liveness)
    )


def next_backoff(attempt: int, base_s: float, cap_s: float) -> float:
    """Capped exponential back-off.

    Args:
        attempt: attempts already made, >= 0.
        base_s: delay for attempt 0, > 0.
        cap_s: upper bound, >= base_s.

    Returns:
        min(cap_s, base_s * 2**attempt).
    """
    if isinstance(attempt, bool) or not isinstance(attempt, numbers.Integral) or attempt < 0:
        raise LivenessError(f"attempt={attempt!r} must be an int >= 0")
    base_s = _number("base_s", base_s, positive=True)
    cap_s = _number("cap_s", cap_s, positive=True)
    if cap_s < base_s:
        raise LivenessError(f"cap_s={cap_s} < base_s={base_s}; raise cap_s")
    # 2**attempt beyond the cap would overflow a float for huge attempts.
    if attempt >= math.log2(cap_s / base_s) + 1:
        return cap_s
    return min(cap_s, base_s * 2.0 ** int(attempt))
