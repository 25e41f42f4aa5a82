"""A shard's data per fragment: its state and update, the events of its history, a cut tensor's groups.

Plain data: `paramserver.server.state` owns every rule that changes it,
`paramserver.server.storage.checkpoint` its checkpoint form.

Params, the optimizer state's vectors and the downlink residual are host
buffers that each outer step updates in place (`paramserver.server.step.fragment_step`):
whatever must outlive the next step of its fragment (a snapshot, a checkpoint,
a StepUpdate's values) copies them first.

What a shard's history is made of: the events its write-ahead log holds.

Plain data: `paramserver.server.state` builds and applies them,
`paramserver.server.storage.wal` gives their on-disk records. Replaying
the same events through `ShardState.apply` on a fresh state gives the same
parameters bit for bit.

RDA across the fragments of one shard: a cut tensor's other pieces, for whole-tensor norms.

This module owns what a fragment's RDA step learns from the tensor's other
pieces on the same shard. RDA's factors need each tensor's islands' Gram
matrix over the whole tensor (`paramserver.server.step.merge`); where the plan
cuts a tensor across fragments (on one shard, `paramserver.wire.plan` keeps
such runs together), the step of one piece adds the Grams of the others.

What a step gets, for each tensor it holds a piece of that another fragment
of this shard also holds (`siblings`; embeddings, merged by the mean, are
left out): per sibling piece, the raw inner products <d_k, d_l> over that
piece of the pushes the step merges (`PieceGram`, keys (island, round) in the
step's order, the robust clip factor applied), taken

1. from the Gram of that piece kept here (`TensorGroups.last`: the newest
   one computed of each piece, at its own step or a sibling's) when it
   covers every one of the step's keys (same island and round: the same
   pushes; its submatrix), else
2. from the sibling's pending deltas when it holds every one of the keys
   (computed, and kept for 1.), else
3. not at all: that piece is left out, so the tensor is normalised over the
   pieces that have the step's pushes (with none, its own piece only, as
   before). Pieces on other shards are always left out.

The step (`paramserver.server.step.fragment_step`) turns them into RDA partial sums
with its own coefficients (`partials`: Gram_ij = sum c_k c_l <d_k, d_l> over
island i's keys k and island j's keys l). In sync mode a due fragment waits
while a sibling holds some of a round but is not due yet (`ready`, asked by
`ShardState.due_fragments`), so the group's first step finds the round
pending in every piece (2.) and the later ones find the Grams it kept (1.):
every piece is normalised over the whole tensor, as if the plan had not cut
it. In quorum and async modes the pieces step when each is due: a piece is
whole where its siblings hold or merged the same pushes, else rule 3. (One
island's step has factor 1 whatever the norms.) Cost: one extra pass over
each cut piece's deltas per set of pushes (its Gram, computed once), and
M x M floats per sibling piece logged with the step.

Determinism: the PieceGrams a live step used are part of its `StepEvent`
(logged with it), and replay uses the logged ones, so a replayed step gives
the same bits whatever this module's cache holds. The cache (1.) is soft: it
starts empty after a restart, so a sibling that stepped before the restart
is then left out (3.); the live step logs what it used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from codec.coded import CodedTensor, from_array
from paramserver.server.step.merge import MEAN_LEAF_MARK, PIECE, TensorPartial, pieces, scaled
from paramserver.server.step.policy import ArrivalStats, PendingDelta
from paramserver.server.step.weighting import RoundClock
from paramserver.wire.plan import Fragment, Plan


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


class StateError(RuntimeError):
    """An event that cannot be applied (a corrupted or foreign log), or misuse of the state."""


class MomentumDtypeError(StateError):
    """A checkpoint or logged step kept the outer momentum in another dtype than this shard's.

    A shard never mixes the two (`ShardConfig.momentum_dtype`): its data dir is
    refused at start, naming both dtypes; restart with the one it was written
    with (`saved`), or from an empty data dir.
    """

    def __init__(self, saved: str, configured: str, where: str) -> None:
        """Name the mismatch.

        Args:
            saved: the dtype the data dir kept the momentum in.
            configured: this shard's `momentum_dtype`.
            where: what holds `saved` (a checkpoint, a log record).
        """
        self.saved, self.configured, self.where = saved, configured, where
        super().__init__(
            f"{where} keeps the outer momentum in {saved}, this shard is set to "
            f"momentum_dtype={configured}: restart with --momentum-dtype {saved} (the dtype "
            "is never converted silently), or start from an empty data dir"
        )


SPARSE_SCHEMES = ("topk",)  # codec schemes whose deltas list a subset of the entries


def is_sparse(contributions: Sequence) -> bool:
    """Whether a step's pending deltas are all sparse-coded (merge per entry, no momentum).

    Args:
        contributions: the step's `Contribution`s (their `delta` kept coded).

    Returns:
        True when there is at least one and every delta's scheme is in SPARSE_SCHEMES
        (`paramserver.server.step.sparse_merge` merges those).
    """
    return bool(contributions) and all(
        getattr(c.delta, "scheme", None) in SPARSE_SCHEMES for c in contributions
    )


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

    What an RDA step of a cut tensor's other piece used (`paramserver.server.step.policy`).
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
    push and the merged ones, `paramserver.server.step.weighting`;
    `weighting.round_share`); 0 (a log written before it was recorded) counts
    the merged islands, a whole round. Replay advances the fragment's round
    clock by that share. `momentum_dtype` is the dtype the step kept the
    momentum in (`ShardConfig.momentum_dtype`): replay refuses another one.
    """

    fragment: int
    keys: tuple[tuple[str, int], ...]
    at: float
    outside: tuple[PieceGram, ...] = ()
    expected: int = 0
    momentum_dtype: str = "float32"


Event = InitEvent | InitBeginEvent | InitPieceEvent | AcceptEvent | StepEvent


Key = tuple[str, int]


def siblings(plan: Plan, shard: int) -> dict[int, dict[str, tuple[int, ...]]]:
    """Per owned fragment, its RDA tensors that other fragments of this shard hold pieces of.

    Args:
        plan: the cluster's plan.
        shard: this shard's index.

    Returns:
        fragment -> {tensor path -> the other owned fragments holding a piece, in
        index order}; fragments with no such tensor are absent.
    """
    holders: dict[str, list[int]] = {}
    for frag in plan.fragments_of(shard):
        for piece in frag.slices:
            if MEAN_LEAF_MARK not in piece.path:
                holders.setdefault(piece.path, []).append(frag.index)
    out: dict[int, dict[str, tuple[int, ...]]] = {}
    for path, held in holders.items():
        for index in held if len(held) > 1 else ():
            out.setdefault(index, {})[path] = tuple(i for i in held if i != index)
    return out


def _slice_range(frag: Fragment, path: str) -> tuple[int, int]:
    offset = 0
    for piece in frag.slices:
        if piece.path == path:
            return offset, offset + piece.size
        offset += piece.size
    raise KeyError(path)


def piece_gram(frag: Fragment, path: str, contributions: Sequence[Contribution]) -> np.ndarray:
    """<d_k, d_l> over the fragment's piece of `path`, in float64, each delta times its clip.

    Args:
        frag: the plan fragment the contributions are deltas of.
        path: a tensor the fragment holds a piece of.
        contributions: the deltas, in key order.

    Returns:
        The len x len Gram matrix.
    """
    lo, hi = _slice_range(frag, path)
    count = len(contributions)
    gram = np.zeros((count, count))
    narrow = np.empty(min(PIECE, hi - lo), np.float32)
    rows = np.empty((count, narrow.shape[0]))
    sources = [scaled(c.delta, c.clip) for c in contributions]
    for a, b in pieces(lo, hi):
        for k, source in enumerate(sources):
            source.decode_into(a, b, narrow[: b - a])
            np.copyto(rows[k, : b - a], narrow[: b - a])
        block = rows[:, : b - a]
        gram += block @ block.T
    return gram


class TensorGroups:
    """The PieceGrams of a live RDA step, and the newest Gram of each cut piece (the cache)."""

    def __init__(self, merge: str) -> None:
        """An empty cache; the siblings are computed per plan (by its hash).

        Args:
            merge: the shard's merge rule; only "rda" looks at other pieces.
        """
        self.merge = merge
        self._plan_hash: str | None = None
        self._siblings: dict[int, dict[str, tuple[int, ...]]] = {}
        # (fragment, path) -> (keys, Gram): the newest Gram computed of each cut piece
        self.last: dict[tuple[int, str], tuple[tuple[Key, ...], np.ndarray]] = {}

    def step_event(
        self,
        plan: Plan | None,
        shard: int,
        fragments: Mapping[int, FragmentState],
        fragment: int,
        at: float,
        expected: int = 0,
    ) -> StepEvent:
        """The StepEvent of a live step of `fragment` merging all its pending deltas.

        Args:
            plan: the shard's plan (None before init: no Grams).
            shard: this shard's index.
            fragments: the shard's fragment states (before the step).
            fragment: an owned fragment with pending deltas.
            at: the step's wall-clock time.
            expected: the islands the step's round expected (`StepEvent.expected`).

        Returns:
            The event, with the PieceGrams of `outside` under rda.
        """
        keys = tuple((c.island, c.round) for c in fragments[fragment].pending)
        outside: tuple[PieceGram, ...] = ()
        if self.merge == "rda" and plan is not None:
            outside = self.outside(plan, shard, fragments, fragment, keys)
        return StepEvent(fragment, keys, at, outside, expected)

    def ready(
        self,
        plan: Plan | None,
        shard: int,
        mode: str,
        fragments: Mapping[int, FragmentState],
        due: Sequence[int],
    ) -> list[int]:
        """The due fragments that may step now: in sync mode under rda, a cut tensor's pieces together.

        A due fragment waits while a sibling (`siblings`) holds pending deltas but
        is not due yet (its round's pushes are still arriving), so that the
        group's first step finds the round in every piece (rule 1); a sibling
        with nothing pending is not waited for. Other modes and rules: `due`.

        Args:
            plan: the shard's plan (None before init).
            shard: this shard's index.
            mode: the merge policy's mode (sync, quorum, async).
            fragments: the shard's fragment states.
            due: the fragments its merge policy says to step now.

        Returns:
            Those of `due` to step now, in order.
        """
        if self.merge != "rda" or mode != "sync" or plan is None:
            return list(due)
        cut = self._cut(plan, shard)
        waiting = {f for f, s in fragments.items() if s.pending and f not in due}
        return [
            f
            for f in due
            if not any(g in waiting for others in cut.get(f, {}).values() for g in others)
        ]

    def _cut(self, plan: Plan, shard: int) -> dict[int, dict[str, tuple[int, ...]]]:
        """`siblings` of this plan (recomputed, and the cache dropped, when the plan changes)."""
        if plan.hash != self._plan_hash:
            self._plan_hash, self._siblings, self.last = plan.hash, siblings(plan, shard), {}
        return self._siblings

    def outside(
        self,
        plan: Plan,
        shard: int,
        fragments: Mapping[int, FragmentState],
        fragment: int,
        keys: Sequence[Key],
    ) -> tuple[PieceGram, ...]:
        """The sibling pieces' PieceGrams for a step of `fragment` merging `keys` (rules 1-3).

        Keeps every Gram it computes (the fragment's own pieces' too), for the
        group's later steps (rule 2) and so that no piece's is computed twice.

        Args:
            plan: the cluster's plan.
            shard: this shard's index.
            fragments: the shard's fragment states (before the step).
            fragment: the fragment about to step.
            keys: the (island, round) of the pending deltas it merges, in order.

        Returns:
            One PieceGram per (tensor, sibling) found, in tensor then sibling order.
        """
        cut = self._cut(plan, shard).get(fragment)
        if not cut:
            return ()
        keys = tuple(keys)
        for path in cut:  # this piece's own, for its siblings' later steps (rule 2)
            self._gram(plan, fragments[fragment], fragment, path, keys)
        found = []
        for path, others in cut.items():
            for other in others:
                gram = self._gram(plan, fragments[other], other, path, keys)
                if gram is not None:
                    found.append(PieceGram(path, other, keys, gram))
        return tuple(found)

    def _gram(
        self, plan: Plan, state: FragmentState, index: int, path: str, keys: tuple[Key, ...]
    ) -> np.ndarray | None:
        """A piece's Gram of `keys`: kept (any earlier step's), else from its pending, else None.

        Computed at most once per piece and set of pushes: the pending deltas of
        a key never change, so a kept Gram of more keys serves (its submatrix).
        """
        held_keys, gram = self.last.get((index, path), ((), None))
        if gram is not None and all(k in held_keys for k in keys):
            at = [held_keys.index(k) for k in keys]
            return gram[np.ix_(at, at)]
        pending = {(c.island, c.round): c for c in state.pending}
        if not all(k in pending for k in keys):
            return None
        gram = piece_gram(plan.fragments[index], path, [pending[k] for k in keys])
        self.last[(index, path)] = (keys, gram)
        return gram


def partials(
    outside: Sequence[PieceGram],
    merged_in: Sequence[Contribution],
    coefficients: Sequence[float],
) -> list[dict[str, TensorPartial]]:
    """RDA partial sums of the sibling pieces under a step's coefficients.

    Args:
        outside: the step's PieceGrams (keys in the step's order).
        merged_in: the step's pending deltas.
        coefficients: one c_k per delta (as `chunk_merge` takes).

    Returns:
        One {path: TensorPartial} per PieceGram, for `chunk_merge(..., outside=)`.
    """
    if not outside:
        return []
    islands = tuple(dict.fromkeys(c.island for c in merged_in))
    coef = {(c.island, c.round): float(x) for c, x in zip(merged_in, coefficients, strict=True)}
    out = []
    for piece in outside:
        weights = np.zeros((len(islands), len(piece.keys)))
        for k, key in enumerate(piece.keys):
            weights[islands.index(key[0]), k] = coef[key]
        gram = weights @ np.asarray(piece.gram, dtype=np.float64) @ weights.T
        out.append({piece.path: TensorPartial(islands, gram)})
    return out
