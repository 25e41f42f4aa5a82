"""A fragment's round clock: completed rounds per version, and which islands count in a round.

Pure data and rules, no I/O. `paramserver.server.state` keeps one per owned
fragment (`FragmentState.clock`), advances it with every step it applies
(live or replayed) and saves it in the checkpoint.

A round is one delta from each island that pushes (DESIGN.md, "The outer
merge, exactly"). A step that merges n distinct islands when N islands push
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

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

HISTORY = 1024  # versions whose round count a fragment's clock keeps (checkpointed)
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
        if len(self.rounds) > HISTORY + 1:
            drop = len(self.rounds) - (HISTORY + 1)
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
