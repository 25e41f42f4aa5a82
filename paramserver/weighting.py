"""Merge weights of deltas: pure, composable functions of (tokens, steps, staleness).

This module owns how much each contribution counts in a merge. A weighting is
`f(tokens, steps) * g(staleness)`: Decoupled DiLoCo's tokens^2/steps by default
(more tokens per inner step: larger batches, more useful work), times a
polynomial staleness decay (1 + staleness)^-a (FedAsync-style).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

Weighting = Callable[[float, float, float], float]
"""A weighting maps (tokens, steps, staleness) to a non-negative weight."""

WEIGHTINGS = ("default", "uniform", "tokens", "no-staleness")


class WeightingError(ValueError):
    """Unknown weighting name, bad exponent, or invalid contribution numbers."""


def _check(tokens: float, steps: float, staleness: float) -> None:
    for name, value in (("tokens", tokens), ("steps", steps), ("staleness", staleness)):
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise WeightingError(f"{name}={value!r} must be a finite number")
    if tokens <= 0:
        raise WeightingError(f"tokens={tokens!r} must be > 0")
    if steps <= 0:
        raise WeightingError(f"steps={steps!r} must be > 0")
    if staleness < 0:
        raise WeightingError(f"staleness={staleness!r} must be >= 0")


def token_weight(tokens: float, steps: float) -> float:
    """Decoupled DiLoCo's work weight.

    Args:
        tokens: tokens consumed since the base version, > 0.
        steps: inner steps since the base version, > 0.

    Returns:
        tokens^2 / steps.
    """
    _check(tokens, steps, 0)
    return float(tokens) * float(tokens) / float(steps)


def polynomial_staleness(staleness: float, exponent: float) -> float:
    """Polynomial staleness decay.

    Args:
        staleness: versions between base and current, >= 0.
        exponent: decay exponent a >= 0 (0: no decay).

    Returns:
        (1 + staleness)^-exponent, in (0, 1].
    """
    _check(1, 1, staleness)
    return float((1.0 + staleness) ** -exponent)


def make_weighting(name: str = "default", staleness_exponent: float = 0.5) -> Weighting:
    """Build a weighting by name.

    Args:
        name: "default" (tokens^2/steps * (1+staleness)^-a), "uniform" (1),
            "tokens" (tokens only) or "no-staleness" (tokens^2/steps).
        staleness_exponent: a >= 0, used by "default".

    Returns:
        A callable (tokens, steps, staleness) -> float that validates its inputs.
    """
    if name not in WEIGHTINGS:
        raise WeightingError(f"unknown weighting {name!r}; choose one of {WEIGHTINGS}")
    a = staleness_exponent
    if not isinstance(a, numbers.Real) or not math.isfinite(a) or a < 0:
        raise WeightingError(f"staleness_exponent={a!r} must be a finite number >= 0")

    def default(tokens: float, steps: float, staleness: float) -> float:
        _check(tokens, steps, staleness)
        return token_weight(tokens, steps) * polynomial_staleness(staleness, a)

    def uniform(tokens: float, steps: float, staleness: float) -> float:
        _check(tokens, steps, staleness)
        return 1.0

    def tokens_only(tokens: float, steps: float, staleness: float) -> float:
        _check(tokens, steps, staleness)
        return float(tokens)

    def no_staleness(tokens: float, steps: float, staleness: float) -> float:
        _check(tokens, steps, staleness)
        return token_weight(tokens, steps)

    return {
        "default": default,
        "uniform": uniform,
        "tokens": tokens_only,
        "no-staleness": no_staleness,
    }[name]


def _fields(contribution: Any) -> tuple[float, float, int]:
    if isinstance(contribution, tuple) and not hasattr(contribution, "base_version"):
        tokens, steps, base_version = contribution
        return tokens, steps, base_version
    return contribution.tokens, contribution.steps, contribution.base_version


def normalized_weights(
    weighting: Weighting, contributions: Sequence[Any], current_version: int
) -> np.ndarray:
    """Normalized merge weights of the pending contributions of one fragment.

    Args:
        weighting: from make_weighting.
        contributions: objects with tokens, steps, base_version attributes, or
            (tokens, steps, base_version) tuples.
        current_version: the fragment's version now; staleness = current - base.

    Returns:
        float64 weights, one per contribution, summing to 1.
    """
    if len(contributions) == 0:
        raise WeightingError("no contributions to weight")
    raw = np.empty(len(contributions), dtype=np.float64)
    for i, c in enumerate(contributions):
        tokens, steps, base_version = _fields(c)
        staleness = current_version - base_version
        if staleness < 0:
            raise WeightingError(
                f"contribution {i}: base_version={base_version} is newer than "
                f"current_version={current_version}"
            )
        raw[i] = weighting(tokens, steps, staleness)
    total = raw.sum()
    if not (math.isfinite(total) and total > 0):
        raise WeightingError(f"weights {raw.tolist()} do not sum to a finite positive number")
    return raw / total
