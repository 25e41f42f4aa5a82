"""The records a shard's state is made of: events, outcomes, updates, per-fragment state.

Plain data and the counters' arithmetic: `paramserver.server.state` owns every rule
that creates or changes them, `paramserver.server.durable` their on-disk forms.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from paramserver.server.policy import ArrivalStats, PendingDelta


class StateError(RuntimeError):
    """An event that cannot be applied (a corrupted or foreign log), or misuse of the state."""


@dataclass(frozen=True)
class Contribution:
    """One accepted delta waiting to be merged into its fragment."""

    island: str
    round: int
    fragment: int
    base_version: int
    tokens: int
    steps: int
    arrived: float  # wall-clock seconds
    delta: np.ndarray  # 1-D float32, the fragment's size

    @property
    def key(self) -> tuple[str, int, int]:
        """The idempotency key (island, round, fragment)."""
        return (self.island, self.round, self.fragment)


@dataclass(frozen=True)
class InitEvent:
    """The shard got its plan and initial values (fragment -> 1-D float32)."""

    plan_wire: dict
    values: dict[int, np.ndarray]


@dataclass(frozen=True)
class AcceptEvent:
    """A delta was accepted into its fragment's pending set.

    `frames` are the codec frames the delta was decoded from, when known: the
    log keeps those (compressed) bytes instead of the float32 delta, and
    decoding is deterministic, so replay gets the same delta bit for bit.
    """

    contribution: Contribution
    frames: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class StepEvent:
    """An outer step of `fragment` merged exactly the pending deltas `keys` ((island, round))."""

    fragment: int
    keys: tuple[tuple[str, int], ...]
    at: float


Event = InitEvent | AcceptEvent | StepEvent


@dataclass(frozen=True)
class Outcome:
    """The answer to a request: status accepted / duplicate / rejected, reason and detail.

    `event` is the applied event when the request changed durable state.
    `version` is the fragment's version after the request (pushes), else 0.
    `merged_version` (pushes accepted or duplicate) is the first version of the
    fragment that includes the delta: a step merges every pending delta, so a
    delta still pending is in the next version.
    """

    status: str
    reason: str | None = None
    detail: str = ""
    event: Event | None = None
    version: int = 0
    merged_version: int | None = None


@dataclass(frozen=True)
class StepUpdate:
    """A new fragment version to publish: the values after the step (1-D float32).

    `frames` is None for the float32 downlink (publish `values`, mode "full"),
    else the codec frames of the quantized update (publish them, mode "increment").
    """

    fragment: int
    version: int
    values: np.ndarray
    frames: tuple[Any, ...] | None = None
    credited: dict[str, float] = field(default_factory=dict)  # merged islands: cumulative


@dataclass
class FragmentState:
    """Mutable state of one owned fragment (params and opt_state live in JAX)."""

    params: jax.Array  # 1-D float32
    opt_state: Any
    version: int = 0
    pending: list[Contribution] = field(default_factory=list)
    stats: ArrivalStats = field(default_factory=ArrivalStats)
    residual: np.ndarray | None = None  # int8 downlink: quantization error carried forward
    norms: list[float] = field(default_factory=list)  # recent (clipped) delta norms: robust.py

    def waiting(self) -> list[PendingDelta]:
        """The pending deltas as the merge policy sees them (island, arrival time)."""
        return [PendingDelta(c.island, c.arrived) for c in self.pending]


@dataclass
class DedupEntry:
    """Per (island, fragment): newest accepted round, accepted rounds within the window."""

    newest: int
    rounds: set[int]


@dataclass
class Counters:
    """What `status` reports; `accepted`, `staleness` and `steps` are rebuilt by replay."""

    accepted: int = 0
    duplicates: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    bytes_in: int = 0
    bytes_out: int = 0
    staleness: dict[int, int] = field(default_factory=dict)
    steps: int = 0
    clipped: int = 0  # deltas scaled down by robust aggregation (clip_norm_multiple)
    # requests from islands the shard does not know (answered unknown_island: "say
    # hello"); expected after a restart or before an island's first hello here, so
    # they are not rejections
    hello_requests: int = 0
    # island -> tokens that entered the model: tokens * g(staleness) * fragment share
    credited: dict[str, float] = field(default_factory=dict)

    def count_rejection(self, reason: str) -> None:
        """Count a refused request: `unknown_island` as a hello request, the rest by reason.

        Args:
            reason: one of paramserver.wire.protocol.REASONS.
        """
        if reason == "unknown_island":
            self.hello_requests += 1
        else:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def add_step(self, staleness: list[int], credits: dict[str, float]) -> None:
        """Count one outer step.

        Args:
            staleness: the staleness of each delta it merged.
            credits: island -> tokens that entered the model in this step.
        """
        self.steps += 1
        for s in staleness:
            self.staleness[s] = self.staleness.get(s, 0) + 1
        for island, credit in credits.items():
            self.credited[island] = self.credited.get(island, 0.0) + credit

    def report(self) -> dict[str, Any]:
        """The counters as status fields (JSON-ready, str keys).

        Returns:
            accepted, duplicates, rejected (reason -> count), hello_requests,
            bytes_in, bytes_out, staleness_histogram, steps, clipped and credited_tokens (island ->
            tokens * g(staleness) * fragment share, rounded to 3 decimals).
        """
        return {
            "accepted": self.accepted,
            "duplicates": self.duplicates,
            "rejected": dict(sorted(self.rejected.items())),
            "hello_requests": self.hello_requests,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "staleness_histogram": {str(k): v for k, v in sorted(self.staleness.items())},
            "steps": self.steps,
            "clipped": self.clipped,
            "credited_tokens": {k: round(v, 3) for k, v in sorted(self.credited.items())},
        }
