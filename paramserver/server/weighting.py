"""How much each island's work counts in an outer step: pure functions, no state.

This module owns the merge rule of one fragment's step (DESIGN.md, "The outer
merge, exactly"). Pending deltas are first grouped per island: an island sends
``anchor - local``, so its pushes are disjoint increments of work and are
**summed**, with their tokens and inner steps; the island's staleness is the
fragment's current version minus the oldest base version among them. Then,
across the islands i of the step::

    merged = sum_i  w_i * g(s_i) * delta_i
    w_i    = f(tokens_i, steps_i) / sum_j f(tokens_j, steps_j)
    g(s)   = (1 + s)^-a              (absolute: g(0) = 1, never renormalised)

`f` is the work weight (Decoupled DiLoCo's tokens^2/steps by default: more
tokens per inner step, bigger batches, count more) and `g` the staleness
factor (FedAsync's polynomial decay), so a lone stale delta moves the model
less, and a fast island's extra rounds add work instead of diluting everyone's.

Named weightings: ``default`` (f = tokens^2/steps, g polynomial), ``uniform``
(f = 1), ``tokens`` (f = tokens), ``no-staleness`` (f = tokens^2/steps, g = 1).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class Weighting:
    """A named weighting: the work weight f and the absolute staleness factor g.

    Attributes:
        name: one of WEIGHTINGS.
        staleness_exponent: a in g(s) = (1 + s)^-a (unused by "no-staleness").
    """

    name: str = "default"
    staleness_exponent: float = 0.5

    def __post_init__(self) -> None:
        if self.name not in WEIGHTINGS:
            raise WeightingError(f"unknown weighting {self.name!r}; choose one of {WEIGHTINGS}")
        a = self.staleness_exponent
        if not isinstance(a, numbers.Real) or isinstance(a, bool) or not math.isfinite(a) or a < 0:
            raise WeightingError(f"staleness_exponent={a!r} must be a finite number >= 0")

    def work(self, tokens: float, steps: float) -> float:
        """The work weight f of one island's contribution (before normalisation).

        Args:
            tokens: tokens of the island's pending deltas, > 0.
            steps: inner steps of the island's pending deltas, > 0.

        Returns:
            f(tokens, steps) > 0.
        """
        _check(tokens, steps, 0)
        if self.name == "uniform":
            return 1.0
        if self.name == "tokens":
            return float(tokens)
        return token_weight(tokens, steps)

    def staleness_factor(self, staleness: float) -> float:
        """The absolute staleness factor g, with g(0) = 1.

        Args:
            staleness: versions between the island's oldest base and now, >= 0.

        Returns:
            g(staleness) in (0, 1].
        """
        _check(1, 1, staleness)
        if self.name == "no-staleness":
            return 1.0
        return polynomial_staleness(staleness, self.staleness_exponent)


def make_weighting(name: str = "default", staleness_exponent: float = 0.5) -> Weighting:
    """Build a weighting by name.

    Args:
        name: one of WEIGHTINGS (see the module docstring).
        staleness_exponent: a >= 0 of g(s) = (1 + s)^-a.

    Returns:
        The validated Weighting.
    """
    return Weighting(name, staleness_exponent)


@dataclass(frozen=True)
class IslandShare:
    """One island's part of a step.

    Attributes:
        island: island id.
        tokens: tokens summed over the island's merged deltas.
        steps: inner steps summed over them.
        staleness: current version minus the oldest base version among them.
        weight: normalised work weight w_i (the weights of a step sum to 1).
        factor: staleness factor g(staleness).
    """

    island: str
    tokens: int
    steps: int
    staleness: int
    weight: float
    factor: float

    @property
    def coefficient(self) -> float:
        """w_i * g(s_i): what each of the island's deltas is multiplied by."""
        return self.weight * self.factor


def _fields(contribution: Any) -> tuple[str, float, float, int]:
    if isinstance(contribution, tuple) and not hasattr(contribution, "base_version"):
        island, tokens, steps, base_version = contribution
        return island, tokens, steps, base_version
    c = contribution
    return c.island, c.tokens, c.steps, c.base_version


def island_shares(
    weighting: Weighting, contributions: Sequence[Any], current_version: int
) -> list[IslandShare]:
    """Group a step's contributions per island and weigh each island.

    Args:
        weighting: from make_weighting.
        contributions: objects with island, tokens, steps, base_version
            attributes, or (island, tokens, steps, base_version) tuples.
        current_version: the fragment's version now; staleness = current - base.

    Returns:
        One IslandShare per distinct island, in order of first appearance.

    Raises:
        WeightingError: no contributions, a base newer than current, bad numbers.
    """
    if len(contributions) == 0:
        raise WeightingError("no contributions to weight")
    totals: dict[str, list[float]] = {}  # island -> [tokens, steps, oldest base]
    for i, c in enumerate(contributions):
        island, tokens, steps, base_version = _fields(c)
        if base_version > current_version:
            raise WeightingError(
                f"contribution {i}: base_version={base_version} is newer than "
                f"current_version={current_version}"
            )
        _check(tokens, steps, 0)
        t = totals.setdefault(island, [0, 0, base_version])
        t[0] += tokens
        t[1] += steps
        t[2] = min(t[2], base_version)
    work = {island: weighting.work(t[0], t[1]) for island, t in totals.items()}
    total = math.fsum(work.values())
    if not (math.isfinite(total) and total > 0):
        raise WeightingError(f"work weights {work} do not sum to a finite positive number")
    return [
        IslandShare(
            island=island,
            tokens=int(t[0]),
            steps=int(t[1]),
            staleness=int(current_version - t[2]),
            weight=work[island] / total,
            factor=weighting.staleness_factor(current_version - t[2]),
        )
        for island, t in totals.items()
    ]


def merge_coefficients(
    weighting: Weighting, contributions: Sequence[Any], current_version: int
) -> tuple[list[float], list[IslandShare]]:
    """The factor of each pending delta in the merged pseudo-gradient.

    Args:
        weighting: from make_weighting.
        contributions: as for `island_shares`.
        current_version: the fragment's version now.

    Returns:
        (one coefficient per contribution, w_i * g(s_i) of its island, so that
        merged = sum coefficient * delta; the island shares).
    """
    shares = island_shares(weighting, contributions, current_version)
    by_island = {s.island: s.coefficient for s in shares}
    return [by_island[_fields(c)[0]] for c in contributions], shares
