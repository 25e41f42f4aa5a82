"""What a shard's history is made of: the events its write-ahead log holds.

Plain data: `paramserver.server.state` builds and applies them,
`paramserver.server.storage.wal` gives their on-disk records. Replaying
the same events through `ShardState.apply` on a fresh state gives the same
parameters bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from codec.decode import CodedTensor, from_array


class StateError(RuntimeError):
    """An event that cannot be applied (a corrupted or foreign log), or misuse of the state."""


@dataclass(frozen=True)
class Contribution:
    """One accepted delta waiting to be merged into its fragment.

    `delta` is kept as it arrived (`codec.decode`: int8/int4 codes and scales,
    topk entries, raw values), never decoded to float32 while pending; a 1-D
    array given here is kept as raw float32. `clip` is the robust clip factor
    (`paramserver.server.step.weighting`) the merge applies to its decoded values.
    """

    island: str
    round: int
    fragment: int
    base_version: int
    tokens: int
    steps: int
    arrived: float  # wall-clock seconds
    delta: CodedTensor  # the fragment's size, kept coded
    clip: float = 1.0
    floor: int | None = None  # the push's `floor` (its island's lowest round still to come)
    norm: float | None = None  # the delta's L2 norm, when known (not persisted)

    def __post_init__(self) -> None:
        if isinstance(self.delta, np.ndarray):
            object.__setattr__(self, "delta", from_array(self.delta))

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
class InitBeginEvent:
    """An island started an init in pieces with this plan (any unfinished one is dropped)."""

    plan_wire: dict
    island: str


@dataclass(frozen=True)
class InitPieceEvent:
    """Elements [offset, offset + len(values)) of an owned fragment of the init in progress."""

    fragment: int
    offset: int
    values: np.ndarray  # 1-D float32


@dataclass(frozen=True)
class AcceptEvent:
    """A delta was accepted into its fragment's pending set.

    `frames` are the codec frames the delta was read from, when known: the
    log keeps those (compressed) bytes, and reading is deterministic, so
    replay gets the same coded delta bit for bit.
    """

    contribution: Contribution
    frames: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class PieceGram:
    """<d_k, d_l> over `fragment`'s piece of tensor `path` of the pushes `keys` (float64).

    What an RDA step of a cut tensor's other piece used (`paramserver.server.step.tensor_groups`).
    """

    path: str
    fragment: int
    keys: tuple[tuple[str, int], ...]
    gram: np.ndarray


@dataclass(frozen=True)
class StepEvent:
    """An outer step of `fragment` merged exactly the pending deltas `keys` ((island, round)).

    `outside`: the other pieces' Grams its RDA merge added (logged: replay uses these).
    `expected` is the islands the shard expected that round (the islands that
    push and the merged ones, `paramserver.server.step.round_clock`;
    `weighting.round_share`); 0 (a log written before it was recorded) counts
    the merged islands, a whole round. Replay advances the fragment's round
    clock by that share.
    """

    fragment: int
    keys: tuple[tuple[str, int], ...]
    at: float
    outside: tuple[PieceGram, ...] = ()
    expected: int = 0


Event = InitEvent | InitBeginEvent | InitPieceEvent | AcceptEvent | StepEvent
