"""Emulating slower hardware: how long to idle after a step so it looks `speed` times as fast.

This module owns the pacing arithmetic (a pure function) and a thin stateful `Pacer`
that draws deterministic jitter and sleeps. An island with speed 0.5 pads each step so
that it takes twice its measured time; jitter multiplies the target time by a factor
drawn uniformly from [1 - jitter, 1 + jitter]. Padding is never negative: a step cannot
be made faster than it was.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np


class PaceError(ValueError):
    """A pacing argument is invalid."""


def _check_speed(speed: float) -> None:
    if not isinstance(speed, int | float) or not math.isfinite(speed) or speed <= 0:
        raise PaceError(f"speed must be a finite number > 0, got {speed!r}")


def _check_jitter(jitter: float) -> None:
    if not isinstance(jitter, int | float) or not 0 <= jitter < 1:
        raise PaceError(f"jitter must be in [0, 1), got {jitter!r}")


def padding_s(step_time_s: float, speed: float, jitter_draw: float = 1.0) -> float:
    """Seconds to idle after a step so that it takes step_time_s / speed * jitter_draw.

    Args:
        step_time_s: measured duration of the step, >= 0.
        speed: emulated speed relative to this hardware, > 0 (0.5 = half as fast).
        jitter_draw: multiplicative noise on the target time, > 0 (1.0 = none).

    Returns:
        The padding in seconds, >= 0 (0 when the target is not longer than the step).
    """
    if not isinstance(step_time_s, int | float) or not math.isfinite(step_time_s):
        raise PaceError(f"step_time_s must be a finite number, got {step_time_s!r}")
    if step_time_s < 0:
        raise PaceError(f"step_time_s must be >= 0, got {step_time_s!r}")
    _check_speed(speed)
    if (
        not isinstance(jitter_draw, int | float)
        or not math.isfinite(jitter_draw)
        or jitter_draw <= 0
    ):
        raise PaceError(f"jitter_draw must be a finite number > 0, got {jitter_draw!r}")
    return max(0.0, step_time_s / speed * jitter_draw - step_time_s)


class Pacer:
    """Pads steps to emulate a device `speed` times as fast, with seeded jitter."""

    def __init__(
        self,
        speed: float,
        jitter: float = 0.0,
        seed: int = 0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Validate and prepare the jitter stream.

        Args:
            speed: emulated speed, > 0 (1.0 = this hardware, 0.5 = half as fast).
            jitter: relative step-time noise in [0, 1); 0.1 gives factors in [0.9, 1.1].
            seed: seed of the jitter draws (the same seed gives the same sequence).
            sleep: the sleeping function (injectable for tests).
        """
        _check_speed(speed)
        _check_jitter(jitter)
        self.speed = float(speed)
        self.jitter = float(jitter)
        self._rng = np.random.default_rng(seed)
        self._sleep = sleep

    def draw(self) -> float:
        """Next jitter factor, uniform in [1 - jitter, 1 + jitter].

        Returns:
            The factor (exactly 1.0 when jitter is 0).
        """
        if self.jitter == 0:
            return 1.0
        return 1.0 + self.jitter * float(self._rng.uniform(-1.0, 1.0))

    def pad(self, step_time_s: float) -> float:
        """Sleep long enough that the step appears to run at this pacer's speed.

        Args:
            step_time_s: measured duration of the step just taken.

        Returns:
            The seconds slept.
        """
        seconds = padding_s(step_time_s, self.speed, self.draw())
        if seconds > 0:
            self._sleep(seconds)
        return seconds
