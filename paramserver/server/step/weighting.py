"""How much each pushed delta counts in a step: work weights, staleness damping, robust clipping.

Pure functions, no state.

This module owns the merge rule of one fragment's step (docs/design.md, "The
merge of one step: weighting and staleness"). Pending deltas are first grouped per island: an island sends
``anchor - local``, so its pushes are disjoint increments of work and are
**summed**, with their tokens and inner steps, each increment k damped by its
own staleness. Then, across the n islands i of a step that the shard expected
N islands for (the islands that push, at least n: `RoundClock.expected` below)::

    merged = sum_i  c_i * sum_k g(s_ik) * delta_ik,   c_i = (n / N) * w_i
    w_i    = f(tokens_i, steps_i) / sum_j f(tokens_j, steps_j)
    f      = tokens^2 / steps per inner step = (tokens / steps)^2
    g(s)   = (1 + s)^-a                   (absolute: g(0) = 1, never renormalised)
    s_ik   = rounds completed since base_ik (the fragment's round clock)

`f` is the work weight: Decoupled DiLoCo's tokens^2/steps taken per inner
step, so more tokens per inner step (bigger batches) count more, while the
amount of work an island's summed increments (or one long delta, after
skipped pushes) hold counts once, through the summed delta's own size. The
whole tokens^2/steps counted it twice: an island with two increments of d
against one island with one got w = 2/3 and moved the model by
2/3 * 2d + 1/3 * d = 1.667 d, where weighing work once gives
1/2 * 2d + 1/2 * d = 1.5 d. For islands that push deltas of equal inner
steps the two are the same weights. `g` is the staleness factor (FedAsync's
polynomial decay), so a lone stale delta moves the model less, and a fast
island's extra rounds add work instead of diluting everyone's.

The step rule ("round", the default) makes the step per round independent of
the island count. A round is one delta from each of the N islands. A step
that merges n of them is n/N of a round: its merged delta is scaled by n/N
(sync: n = N, 1; async: 1/N per delta; a collapsed quorum: a smaller share,
never another optimizer), the fragment's round clock advances by n/N
(`paramserver.server.step.weighting`), and a delta's staleness is the
rounds the clock advanced since its base (the shares of the steps actually
taken, not the versions since the base times the current step's share), and
the outer momentum moves once per round
(`paramserver.server.step.outer.round_nesterov`, told each step's share), so K
islands pushing the same delta d in one round move the model by about one
step's worth for every K (lr * |d| without momentum): exactly with g = 1, and within
2 * (sqrt(2) - 1) = 0.83 of it as K grows (the k-th delta of the round is
(k - 1)/K rounds stale), where counting versions gave 0.70|d| sqrt(K).
Without a clock (`merge_coefficients(..., clock=None)`) the staleness is
approximated as the versions since the base times the step's share.
`diloco-bench step_rule` measures it against the other candidates:
``version`` (the rule before: no share, staleness in versions), ``share``
(share, staleness in versions) and ``round-staleness`` (staleness in rounds,
no share).

Named weightings: ``default`` (f = (tokens/steps)^2, g polynomial), ``uniform``
(f = 1), ``tokens`` (f = tokens: an ablation, which counts an island's amount
of work in its weight too), ``no-staleness`` (f = (tokens/steps)^2, g = 1).

Robust aggregation (`clip`): a delta's norm is clipped relative to the median
norm of recent deltas. This is the pure decision of how much to scale down one incoming
delta so that a single poisoned island (huge, or merely much larger than its
peers) cannot dominate a merge: a delta whose L2 norm exceeds `multiple` times
the median of the last accepted norms of its fragment is scaled to exactly
that bound. The shard applies it when a delta is accepted
(`ShardConfig.clip_norm_multiple`, off by default); the norms it keeps are the
clipped ones, so an attacker cannot raise the bound by repeating itself.
A delta's norm is read from its pending form (codes, a piece at a time:
`paramserver.server.step.merge.sum_squares`), never from a decoded copy.

A fragment's round clock: completed rounds per version, and which islands count in a round.

Pure data and rules, no I/O. `paramserver.server.state` keeps one per owned
fragment (`FragmentState.clock`), advances it with every step it applies
(live or replayed) and saves it in the checkpoint.

A round is one delta from each island that pushes (docs/design.md, "The
merge of one step: weighting and staleness"). A step that merges n distinct islands when N islands push
is n/N of a round (`weighting.round_share`), so the clock reads, at each
version v of the fragment, the rounds completed since version 0::

    rounds(v + 1) = rounds(v) + n_v / N_v

and a delta whose base is version b, merged at version v, is
``rounds(v) - rounds(b)`` rounds old: the shares of the steps actually taken
since b, not the versions since b times the current step's share (a delta 3
full rounds old is 3 rounds old whatever share the step merging it has; one
made stale by 4 quarter-round steps is 1 round old). The clock keeps the
round count of the newest HISTORY versions; a base older than that counts
each missing version as the mean share of the kept ones (1 when none is kept:
a checkpoint written before the clock existed).

N, the islands of a round (`expected`): the islands merged now, and the live
islands that pushed to this fragment within the last RECENT_ROUNDS rounds, so
an island heard but not pushing (compiling, an eval client) or one that
stopped pushing does not shrink every step's share. An island the clock has
never seen push counts for FIRST_SEEN_ROUNDS round from the first step that
sees it live: counting only islands that already pushed would make the first
round of a run, before every island pushed once, several rounds long (in
async mode with K islands, 1 + 1/2 + ... + 1/K rounds). The share of a step
is logged with it (`StepEvent.expected`), so replay never recomputes N.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from paramserver.server.step.merge import DeltaSource, as_source, sum_squares

WEIGHTINGS = ("default", "uniform", "tokens", "no-staleness")
# how a step's share of a round scales it and its staleness (module docstring)
STEP_RULES = ("round", "version", "share", "round-staleness")


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
        step_rule: one of STEP_RULES (the module docstring).
        max_weight_ratio: an island's work weight is capped at this times the
            largest of the others' in the step (`cap_work`); 0: no cap.
    """

    name: str = "default"
    staleness_exponent: float = 0.5
    step_rule: str = "round"
    max_weight_ratio: float = 0.0  # `cap_work`: 0 = no cap

    def __post_init__(self) -> None:
        if self.name not in WEIGHTINGS:
            raise WeightingError(f"unknown weighting {self.name!r}; choose one of {WEIGHTINGS}")
        a = self.staleness_exponent
        if not isinstance(a, numbers.Real) or isinstance(a, bool) or not math.isfinite(a) or a < 0:
            raise WeightingError(f"staleness_exponent={a!r} must be a finite number >= 0")
        if self.step_rule not in STEP_RULES:
            raise WeightingError(
                f"unknown step rule {self.step_rule!r}; choose one of {STEP_RULES}"
            )

    @property
    def scales_by_share(self) -> bool:
        """Whether a step's merged delta is scaled by its share n/N of a round."""
        return self.step_rule in ("round", "share")

    @property
    def staleness_in_rounds(self) -> bool:
        """Whether staleness counts rounds (versions times n/N) rather than versions."""
        return self.step_rule in ("round", "round-staleness")

    def work(self, tokens: float, steps: float) -> float:
        """The work weight f of one island's contribution (before normalisation).

        Args:
            tokens: tokens of the island's pending deltas (summed), > 0.
            steps: inner steps of the island's pending deltas (summed), > 0.

        Returns:
            f(tokens, steps) > 0: tokens^2/steps per inner step, (tokens/steps)^2,
            for default and no-staleness (the module docstring); 1 for
            uniform; tokens for tokens.
        """
        _check(tokens, steps, 0)
        if self.name == "uniform":
            return 1.0
        if self.name == "tokens":
            return float(tokens)
        return token_weight(tokens, steps) / float(steps)

    def staleness_factor(self, staleness: float) -> float:
        """The absolute staleness factor g, with g(0) = 1.

        Args:
            staleness: a delta's staleness (rounds or versions: the step rule), >= 0.

        Returns:
            g(staleness) in (0, 1].
        """
        _check(1, 1, staleness)
        if self.name == "no-staleness":
            return 1.0
        return polynomial_staleness(staleness, self.staleness_exponent)


def make_weighting(
    name: str = "default",
    staleness_exponent: float = 0.5,
    step_rule: str = "round",
    max_weight_ratio: float = 0.0,
) -> Weighting:
    """Build a weighting by name.

    Args:
        name: one of WEIGHTINGS (see the module docstring).
        staleness_exponent: a >= 0 of g(s) = (1 + s)^-a.
        step_rule: one of STEP_RULES.
        max_weight_ratio: cap of one island's work weight (`cap_work`); 0: none.

    Returns:
        The validated Weighting.
    """
    return Weighting(name, staleness_exponent, step_rule, max_weight_ratio)


@dataclass(frozen=True)
class IslandShare:
    """One island's part of a step.

    Attributes:
        island: island id.
        tokens: tokens summed over the island's merged deltas.
        steps: inner steps summed over them.
        staleness: current version minus the oldest base version among them.
        weight: normalised work weight w_i (the weights of a step sum to 1).
        factor: the tokens-weighted mean of g(s_ik) over its deltas.
        coefficient: sum_k c_i * g(s_ik): the sum of its deltas' coefficients.
    """

    island: str
    tokens: int
    steps: int
    staleness: int
    weight: float
    factor: float
    coefficient: float


def _fields(contribution: Any) -> tuple[str, float, float, int]:
    if isinstance(contribution, tuple) and not hasattr(contribution, "base_version"):
        island, tokens, steps, base_version = contribution
        return island, tokens, steps, base_version
    c = contribution
    return c.island, c.tokens, c.steps, c.base_version


def round_share(islands: int, expected: int | None) -> float:
    """The share of a round that a step merging `islands` distinct islands is.

    Args:
        islands: distinct islands the step merges, >= 1.
        expected: islands the shard expects per round (its live islands);
            None or fewer than `islands` counts as `islands`.

    Returns:
        n / max(n, N), in (0, 1].
    """
    return islands / max(islands, expected or 0)


class RoundsSince(Protocol):
    """What the staleness in rounds reads: a fragment's round clock (`round_clock.RoundClock`)."""

    def staleness(self, base: int, version: int | None = None) -> float:
        """Rounds completed between version `base` and `version`."""
        ...


def cap_work(work: dict[str, float], ratio: float) -> dict[str, float]:
    """Each island's work weight capped at `ratio` times the largest of the others' in the step.

    So that no island's claimed tokens make the others' deltas vanish from a
    merge (ShardConfig.max_weight_ratio). A step of one island is left as it is.

    Args:
        work: island -> f(tokens, steps) > 0.
        ratio: the cap (>= 1); 0: no cap.

    Returns:
        island -> min(f_i, ratio * max_{j != i} f_j).
    """
    if ratio <= 0 or len(work) < 2:
        return work
    ranked = sorted(work.values(), reverse=True)
    top, second = ranked[0], ranked[1]
    return {i: min(f, ratio * (second if f == top else top)) for i, f in work.items()}


def merge_coefficients(
    weighting: Weighting,
    contributions: Sequence[Any],
    current_version: int,
    expected: int | None = None,
    clock: RoundsSince | None = None,
    scale_by_share: bool = True,
) -> tuple[list[float], list[IslandShare]]:
    """The coefficient of each pending delta in the merged pseudo-gradient, and each island's share.

    Args:
        weighting: from make_weighting.
        contributions: objects with island, tokens, steps, base_version
            attributes, or (island, tokens, steps, base_version) tuples.
        current_version: the fragment's version now; staleness = current - base.
        expected: islands expected per round (the islands that push:
            `RoundClock`); None: the step's own islands (a whole round).
        clock: the fragment's round clock: staleness in rounds is the rounds
            it advanced since each base; None: (current - base) * the step's
            share (an approximation for callers without history).
        scale_by_share: False leaves the step's share out of the
            coefficients (the per-entry sparse merge: an entry is averaged
            over the islands that sent it, so the share must not dilute it).

    Returns:
        (c_ik = share * w_i * g(s_ik) per contribution, in order, so that
        merged = sum c_ik * delta_ik; one IslandShare per distinct island, in
        order of first appearance).

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
    work = cap_work(
        {island: weighting.work(t[0], t[1]) for island, t in totals.items()},
        weighting.max_weight_ratio,
    )
    total = math.fsum(work.values())
    if not (math.isfinite(total) and total > 0):
        raise WeightingError(f"work weights {work} do not sum to a finite positive number")
    share = round_share(len(totals), expected)
    unit = share if weighting.staleness_in_rounds else 1.0
    scale = share if weighting.scales_by_share and scale_by_share else 1.0
    coefficients, factors = [], {island: [0.0, 0.0] for island in totals}
    for c in contributions:
        island, tokens, _, base_version = _fields(c)
        if weighting.staleness_in_rounds and clock is not None:
            staleness = clock.staleness(base_version, current_version)
        else:
            staleness = (current_version - base_version) * unit
        g = weighting.staleness_factor(staleness)
        coefficients.append(scale * work[island] / total * g)
        factors[island][0] += tokens * g
        factors[island][1] += coefficients[-1]
    shares = [
        IslandShare(
            island=island,
            tokens=int(t[0]),
            steps=int(t[1]),
            staleness=int(current_version - t[2]),
            weight=work[island] / total,
            factor=factors[island][0] / t[0],
            coefficient=factors[island][1],
        )
        for island, t in totals.items()
    ]
    return coefficients, shares


# Accepted norms to see before clipping starts (the median of fewer is noise).
MIN_HISTORY = 4
# Norms kept per fragment.
HISTORY = 32


def clip_factor(
    norm: float, recent: Sequence[float], multiple: float, min_history: int = MIN_HISTORY
) -> float:
    """The scale in (0, 1] to apply to a delta of L2 norm `norm`.

    Args:
        norm: the delta's L2 norm (finite, >= 0).
        recent: norms of recently accepted deltas of the same fragment.
        multiple: allowed multiple of their median (> 0); 0 turns clipping off.
        min_history: fewer recent norms than this: no clipping yet.

    Returns:
        min(1, multiple * median(recent) / norm), or 1.0 when clipping is off,
        the history is short, or the norm is 0.
    """
    if multiple <= 0 or len(recent) < min_history or norm <= 0:
        return 1.0
    bound = multiple * float(np.median(np.asarray(recent, dtype=np.float64)))
    return 1.0 if norm <= bound else bound / norm


def l2_norm(delta: DeltaSource | np.ndarray) -> float:
    """L2 norm of a 1-D delta, accumulated in float64 (an int8 one from its codes: `merge.sum_squares`).

    Args:
        delta: the delta (a 1-D array, or a pending delta kept coded).

    Returns:
        The norm.
    """
    return float(np.sqrt(sum_squares(as_source(delta))))


def clip(
    delta: DeltaSource | np.ndarray, recent: Sequence[float], multiple: float
) -> tuple[float, float, list[float]]:
    """Judge one incoming delta against its fragment's recent norms.

    Args:
        delta: the delta (a 1-D array, or a pending delta kept coded).
        recent: the fragment's kept (clipped) norms, oldest first.
        multiple: allowed multiple of their median (> 0); 0 turns clipping off.

    Returns:
        (the delta's norm, its clip factor in (0, 1], the recent norms with its
        clipped norm appended, the newest HISTORY kept).
    """
    norm = l2_norm(delta)
    factor = clip_factor(norm, recent, multiple)
    return norm, factor, [*recent, norm * factor][-HISTORY:]


CLOCK_HISTORY = 1024  # versions whose round count a fragment's clock keeps (checkpointed)
RECENT_ROUNDS = 2.0  # an island counts in N while it pushed within this many rounds
FIRST_SEEN_ROUNDS = 1.0  # ... and one that never pushed, this long after it was first seen


class ClockError(ValueError):
    """A version the clock does not know, a bad share, or a malformed saved clock."""


@dataclass
class RoundClock:
    """Completed rounds at each recent version of one fragment, and each island's last push.

    Attributes:
        first_version: the version of `rounds[0]`.
        rounds: rounds completed at versions first_version, first_version + 1, ...
        pushed: island -> the round count when a step last merged its delta.
        seen: island -> the round count when a step first saw it live, for
            live islands that never pushed.
    """

    first_version: int = 0
    rounds: list[float] = field(default_factory=lambda: [0.0])
    pushed: dict[str, float] = field(default_factory=dict)
    seen: dict[str, float] = field(default_factory=dict)

    @property
    def version(self) -> int:
        """The newest version the clock knows (the fragment's version)."""
        return self.first_version + len(self.rounds) - 1

    @property
    def now(self) -> float:
        """Rounds completed at the newest version."""
        return self.rounds[-1]

    def rounds_at(self, version: int) -> float:
        """Rounds completed at `version`.

        Args:
            version: a version <= the clock's newest (older than the kept
                history: extrapolated with the mean share of the kept steps).

        Returns:
            The round count.

        Raises:
            ClockError: a version newer than the clock's.
        """
        if version > self.version:
            raise ClockError(f"version {version} is newer than the clock's {self.version}")
        if version >= self.first_version:
            return self.rounds[version - self.first_version]
        steps = len(self.rounds) - 1
        mean = (self.rounds[-1] - self.rounds[0]) / steps if steps else 1.0
        return self.rounds[0] - (self.first_version - version) * mean

    def staleness(self, base: int, version: int | None = None) -> float:
        """Rounds completed between a delta's base version and `version` (default: now).

        Args:
            base: the delta's base version.
            version: the version it is merged at (None: the newest).

        Returns:
            rounds(version) - rounds(base), >= 0.
        """
        version = self.version if version is None else version
        return max(0.0, self.rounds_at(version) - self.rounds_at(base))

    def expected(self, live: Iterable[str], merged: Iterable[str]) -> int:
        """N: the islands of a round at a step merging `merged` (module docstring).

        Live islands the clock has not seen are marked as first seen now (so
        this changes the clock's `seen`; the result is logged with the step).

        Args:
            live: the islands live at the step.
            merged: the islands whose deltas the step merges.

        Returns:
            |merged U {live islands that pushed within RECENT_ROUNDS, or never
            pushed and were first seen within FIRST_SEEN_ROUNDS}|.
        """
        live = set(live)
        for island in live - self.pushed.keys():
            self.seen.setdefault(island, self.now)
        counted = set(merged)
        for island in live:
            if island in self.pushed:
                recent = self.now - self.pushed[island] <= RECENT_ROUNDS
            else:
                recent = self.now - self.seen[island] <= FIRST_SEEN_ROUNDS
            if recent:
                counted.add(island)
        # forget islands gone (not live): they come back as first seen
        for island in [i for i in self.seen if i not in live]:
            del self.seen[island]
        for island in [i for i in self.pushed if i not in live]:
            if self.now - self.pushed[island] > RECENT_ROUNDS:
                del self.pushed[island]
        return len(counted)

    def advance(self, share: float, merged: Iterable[str]) -> None:
        """Record one step: the version grows by 1 and the round count by `share`.

        Args:
            share: the step's share of a round, in (0, 1].
            merged: the islands it merged (they pushed now).
        """
        if not 0.0 < share <= 1.0:
            raise ClockError(f"share={share!r} must be in (0, 1]")
        self.rounds.append(self.rounds[-1] + float(share))
        if len(self.rounds) > CLOCK_HISTORY + 1:
            drop = len(self.rounds) - (CLOCK_HISTORY + 1)
            del self.rounds[:drop]
            self.first_version += drop
        for island in merged:
            self.pushed[island] = self.now
            self.seen.pop(island, None)

    def to_wire(self) -> dict[str, Any]:
        """JSON/msgpack-ready form (the checkpoint's)."""
        return {
            "first_version": self.first_version,
            "rounds": list(self.rounds),
            "pushed": dict(sorted(self.pushed.items())),
            "seen": dict(sorted(self.seen.items())),
        }

    @classmethod
    def from_wire(cls, wire: Any, version: int) -> RoundClock:
        """The clock saved by `to_wire`, or a fresh one at `version` (None: an older checkpoint).

        Args:
            wire: `to_wire`'s dict, or None.
            version: the fragment's version (the clock must end there).

        Returns:
            The clock.

        Raises:
            ClockError: a malformed clock, or one that does not end at `version`.
        """
        if wire is None:
            return cls(first_version=version)
        try:
            clock = cls(
                int(wire["first_version"]),
                [float(r) for r in wire["rounds"]],
                {str(k): float(v) for k, v in wire["pushed"].items()},
                {str(k): float(v) for k, v in wire.get("seen", {}).items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ClockError(f"malformed round clock: {exc}") from None
        if not clock.rounds or clock.version != version:
            raise ClockError(f"the round clock ends at version {clock.version}, not {version}")
        return clock
