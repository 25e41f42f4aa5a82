"""Per-fragment state of a shard: parameters, optimizer state, pending deltas, dedup; its update.

Plain data: `paramserver.server.state` owns every rule that changes it,
`paramserver.server.storage.checkpoint_content` its checkpoint form.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from paramserver.server.events import Contribution
from paramserver.server.policy import ArrivalStats, PendingDelta


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
    coefficients: dict[str, float] = field(default_factory=dict)  # merged islands: this step


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
