"""Per-fragment state of a shard: parameters, optimizer state, pending deltas, dedup; its update.

Plain data: `paramserver.server.state` owns every rule that changes it,
`paramserver.server.storage.checkpoint` its checkpoint form.

Params, the optimizer state's vectors and the downlink residual are host
buffers that each outer step updates in place (`paramserver.server.step.fragment_step`):
whatever must outlive the next step of its fragment (a snapshot, a checkpoint,
a StepUpdate's values) copies them first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from paramserver.server.events import Contribution
from paramserver.server.step.policy import ArrivalStats, PendingDelta
from paramserver.server.step.round_clock import RoundClock


@dataclass(frozen=True)
class StepUpdate:
    """A new fragment version to publish: the values after the step (1-D float32).

    `values` is a read-only view of the fragment's params, valid until the
    fragment's next step (which updates them in place): publish it, or copy it.
    `frames` is None for the float32 downlink (publish `values`, mode "full"),
    else the codec frames of the quantized update (publish them, mode "increment").
    """

    fragment: int
    version: int
    values: np.ndarray
    frames: tuple[Any, ...] | None = None
    credited: dict[str, float] = field(default_factory=dict)  # merged islands: cumulative
    coefficients: dict[str, float] = field(default_factory=dict)  # merged islands: this step


@dataclass
class FragmentState:
    """Mutable state of one owned fragment (host buffers, updated in place by each step)."""

    params: np.ndarray  # 1-D float32, 64-byte aligned (fragment_step.host_vector)
    opt_state: Any  # the optax state, numpy leaves (fragment_step.host_state)
    version: int = 0
    pending: list[Contribution] = field(default_factory=list)
    stats: ArrivalStats = field(default_factory=ArrivalStats)
    residual: np.ndarray | None = None  # int8 downlink: quantization error carried (bfloat16)
    norms: list[float] = field(default_factory=list)  # recent (clipped) delta norms: weighting.clip
    param_norm: float | None = None  # L2 norm of params, None until computed after a change
    clock: RoundClock = field(default_factory=RoundClock)  # rounds per version (staleness, N)
    # the (island, round) keys of a step under way (its arrays belong to it), else None; live only
    in_step: frozenset[tuple[str, int]] | None = None

    def waiting(self) -> list[PendingDelta]:
        """The pending deltas as the merge policy sees them (island, arrival time)."""
        return [PendingDelta(c.island, c.arrived) for c in self.pending]


# Accepted rounds one (island, fragment) entry remembers at most (`floor`: DedupEntry.low).
DEDUP_MAX_ROUNDS = 4096


@dataclass
class DedupEntry:
    """Per (island, fragment): newest accepted round, accepted rounds not yet forgotten.

    `floor` is the highest `floor` its pushes carried (the island's lowest round
    it may still send), None when none did. Rounds below `low` are forgotten,
    and a round below it that is not remembered is refused `replayed_round`.
    """

    newest: int
    rounds: set[int]
    floor: int | None = None

    def low(self, window: int) -> int:
        """The lowest round still remembered: newest - window, or below it down to `floor`.

        Args:
            window: the shard's dedup_window.

        Returns:
            min(floor, newest - window) with a floor, else newest - window.
        """
        low = self.newest - window
        return low if self.floor is None else min(self.floor, low)
