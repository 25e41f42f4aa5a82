"""The init rules of a shard's state: the plan and initial values, whole or in pieces.

`ShardInit` is a part of `paramserver.server.state.ShardState` (a mixin: it
reads and sets the state's plan, fragments, partial init and counters): the
live requests (`initialize`, `begin_init`, `init_piece`) next to the replay of
the events they build (`_apply_init`, `_apply_init_piece`) and the one place
fragments are created from initial values (`_install`).

An init in pieces while it is under way (`PartialInit`): who sends it, which
elements are in, and the checks of a piece. These are the rules of `init_begin` / `init_piece` (docs/protocol.md
section 3.2) that need no more of the shard than its plan: `PartialInit`
holds the owner (the island whose `init_begin` started it), the plan, one
float32 buffer per owned fragment (the values are held once, written in place
as pieces arrive) and the exact pieces received; `piece_check` says whether a
piece is new, already in (a harmless re-send), or why it is refused. `paramserver.server.state`
applies the events and installs the fragments when nothing is missing. No I/O,
no clock: `now` is an argument.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import codec
from paramserver.server.admission import outcomes
from paramserver.server.admission.outcomes import Outcome, refused
from paramserver.server.fragment import (
    FragmentState,
    InitBeginEvent,
    InitEvent,
    InitPieceEvent,
    StateError,
)
from paramserver.server.step.fragment_step import host_vector
from paramserver.server.step.outer import aligned_float32
from paramserver.wire import protocol
from paramserver.wire.plan import Plan
from paramserver.wire.protocol import ACCEPTED, DUPLICATE

logger = logging.getLogger("paramserver.server.state")


class ShardInit:
    """Init requests and their replay; mixed into ShardState (see the module docstring)."""

    def initialize(self, plan_wire: Any, payload: Sequence[Any], now: float = 0.0) -> Outcome:
        """Take the plan and initial values from the first island to `init`.

        Args:
            plan_wire: the wire plan (Plan.to_wire()).
            payload: codec frames of the tree {"<fragment>": 1-D float32 vector}
                with exactly this shard's fragments.
            now: wall-clock seconds (an unfinished init in pieces gives way after
                ABANDON_S).

        Returns:
            accepted with an InitEvent, or rejected (already_initialized,
            malformed, plan_mismatch, codec_error, unknown_fragment, bad_shape,
            bad_dtype, non_finite), counted.
        """
        if self.initialized:
            return self.reject(
                "already_initialized", "this shard has parameters; request a snapshot"
            )
        if self.partial_init is not None and not self.partial_init.abandoned(now):
            return self.reject("already_initialized", self.partial_init.describe())
        read = outcomes.read_init(plan_wire, payload, self.cfg, self.index)
        if isinstance(read, Outcome):
            return outcomes.count(self.counters, read)
        plan, values = read
        event = InitEvent(plan.to_wire(), values)
        self.apply(event)
        logger.info(
            "shard %d initialized: plan %s, fragments %s",
            self.index,
            plan.hash[:12],
            sorted(values),
            extra={"shard": self.index, "plan_hash": plan.hash, "fragments": sorted(values)},
        )
        return Outcome(ACCEPTED, event=event)

    def begin_init(self, plan_wire: Any, island: str, now: float) -> Outcome:
        """Start (or resume) an init in pieces: the first island's `init_begin` owns it.

        Args:
            plan_wire: the wire plan.
            island: the asking island.
            now: wall-clock seconds.

        Returns:
            accepted (with an InitBeginEvent unless the owner resumes), or rejected
            (already_initialized, malformed, plan_mismatch), counted.
        """
        if self.initialized:
            return self.reject("already_initialized", "this shard has parameters; hello")
        plan = outcomes.read_plan(plan_wire, self.cfg)
        verdict = (
            plan if isinstance(plan, Outcome) else begin_check(self.partial_init, island, plan, now)
        )
        if isinstance(verdict, Outcome):
            return outcomes.count(self.counters, verdict)
        if verdict == RESUME:
            return Outcome(ACCEPTED)  # the pieces in stay
        event = InitBeginEvent(plan.to_wire(), island)
        self.apply(event)
        self.partial_init.heard = now
        return Outcome(ACCEPTED, event=event)

    def init_piece(self, header: Mapping[str, Any], payload: Sequence[Any], now: float) -> Outcome:
        """Take one piece of the init under way (the checks: piece_check).

        Args:
            header: an `init_piece` header that passed protocol.unpack.
            payload: codec frames of the tree {"values": 1-D float32 vector}.
            now: wall-clock seconds.

        Returns:
            accepted (with an InitPieceEvent; `initialized` is then True when it
            was the last piece), duplicate (a re-sent piece, or the owner's piece
            after its init completed), or rejected, counted.
        """
        if self.initialized:
            if self.init_owner == (header["island"], header["plan_hash"]):
                return Outcome(DUPLICATE)
            return self.reject("already_initialized", "this shard has parameters; hello")
        checked = piece_check(self.partial_init, header, payload, now)
        if isinstance(checked, Outcome):
            return outcomes.count(self.counters, checked)
        if isinstance(checked, str):  # ALREADY_IN
            return Outcome(DUPLICATE)
        event = InitPieceEvent(header["fragment"], header["offset"], checked)
        self.apply(event)
        return Outcome(ACCEPTED, event=event)

    def _apply_init(self, event: InitEvent) -> None:
        if self.initialized:
            raise StateError("init event on an initialized shard")
        self._install(Plan.from_wire(event.plan_wire), event.values)

    def _apply_init_piece(self, event: InitBeginEvent | InitPieceEvent) -> None:
        if self.initialized:
            raise StateError("init event on an initialized shard")
        if isinstance(event, InitBeginEvent):  # drops an unfinished init of another island
            self.partial_init = PartialInit.start(
                Plan.from_wire(event.plan_wire), event.island, self.index
            )
            return
        partial = self.partial_init
        if partial is None:
            raise StateError(f"init piece of fragment {event.fragment} without init_begin")
        try:
            partial.place(event.fragment, event.offset, event.values)
        except ValueError as exc:
            raise StateError(f"{exc} does not fit the init under way") from None
        if partial.missing == 0:
            self.init_owner = (partial.island, partial.plan.hash)
            self._install(partial.plan, partial.buffers, adopt=True)
            logger.info(
                "shard %d initialized in pieces by island %s: plan %s", self.index, partial.island,
                partial.plan.hash[:12], extra={"shard": self.index, "plan_hash": partial.plan.hash},
            )  # fmt: skip

    def _install(self, plan: Plan, values: Mapping[int, np.ndarray], adopt: bool = False) -> None:
        """The one place fragments are created from initial values (whole or in pieces).

        `adopt`: take the values (a finished init's own aligned buffers) without a
        copy; else copy each (an init's decoded values, which its logged event keeps).
        """
        owned = {f.index: f.size for f in plan.fragments_of(self.index)}
        if set(owned) != set(values):
            raise StateError(f"init event fragments {sorted(values)} != owned {sorted(owned)}")
        self.plan = plan
        self.partial_init = None
        for index in sorted(owned):
            params = values[index] if adopt else host_vector(values[index])
            self.fragments[index] = FragmentState(params, self.stepper.init(params))


# An unfinished init no piece arrived for in this long may be taken over by another island.
ABANDON_S = 30.0

ALREADY_IN = "already_in"  # `piece_check`: this exact piece is in already
RESUME = "resume"  # `begin_check`: the owner asks again with the same plan


@dataclass
class PartialInit:
    """An init in pieces under way (see the module docstring)."""

    plan: Plan
    island: str
    buffers: dict[int, np.ndarray]  # owned fragment -> its values so far (float32, 1-D)
    received: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # sorted [lo, hi)
    missing: int = 0  # elements of all owned fragments not received yet
    heard: float | None = None  # wall-clock of the last begin or piece (None: since a restart)

    @classmethod
    def start(cls, plan: Plan, island: str, shard: int) -> PartialInit:
        """An empty init of shard `shard`'s fragments under `plan`, owned by `island`.

        Args:
            plan: the plan the init's first message carried (checked).
            island: the island that began it.
            shard: this shard's index.

        Returns:
            The partial init, every element missing.
        """
        sizes = {f.index: f.size for f in plan.fragments_of(shard)}
        # aligned like the fragment's own params (fragment_step.host_vector), so the state
        # takes them as they are once the last piece is in: no copy of the model at install
        buffers = {i: aligned_float32(n) for i, n in sorted(sizes.items())}
        return cls(plan, island, buffers, {i: [] for i in buffers}, sum(sizes.values()))

    def abandoned(self, now: float) -> bool:
        """Whether no piece came for ABANDON_S (counted from a restart when none came since).

        Args:
            now: wall-clock seconds.

        Returns:
            True when another island may take the init over.
        """
        if self.heard is None:
            self.heard = now
        return now - self.heard > ABANDON_S

    def place(self, fragment: int, offset: int, values: np.ndarray) -> None:
        """Write a piece checked by `piece_check` (or replayed from the log) into its buffer.

        Args:
            fragment: an owned fragment.
            offset: the piece's first element.
            values: its values (1-D float32).

        Raises:
            ValueError: the piece does not fit (a corrupted log).
        """
        if piece_problem(self, fragment, offset, len(values)) is not None:
            raise ValueError(f"init piece [{offset}, +{len(values)}) of fragment {fragment}")
        self.buffers[fragment][offset : offset + len(values)] = values
        bisect.insort(self.received[fragment], (offset, offset + len(values)))
        self.missing -= len(values)

    def count_at(self, fragment: int, offset: int) -> int:
        """The elements of the piece received at `offset` of `fragment` (0: none there)."""
        return next((hi - lo for lo, hi in self.received[fragment] if lo == offset), 0)

    def describe(self) -> str:
        """One line: who initialises, and how far it got."""
        total = sum(len(b) for b in self.buffers.values())
        return f"island {self.island!r} is initialising it ({total - self.missing} of {total} elements in)"


def piece_problem(partial: PartialInit, fragment: int, offset: int, count: int) -> str | None:
    """Why elements [offset, offset + count) cannot be a new piece of `fragment`, else None."""
    buffer = partial.buffers.get(fragment)
    if buffer is None:
        return f"fragment {fragment} is not one of this shard's {sorted(partial.buffers)}"
    size = len(buffer)
    if count < 1 or offset + count > size:
        return (
            f"piece [{offset}, {offset + count}) of fragment {fragment} does not fit its "
            f"{size} elements (a piece holds 1 or more elements, ending at or before {size})"
        )
    got = partial.received[fragment]
    at = bisect.bisect_left(got, (offset, offset + count))
    for lo, hi in got[max(0, at - 1) : at + 1]:
        if lo < offset + count and offset < hi:
            return (
                f"piece [{offset}, {offset + count}) of fragment {fragment} overlaps the piece "
                f"[{lo}, {hi}) received already; resend pieces with the same cut"
            )
    return None


def begin_check(
    partial: PartialInit | None, island: str, plan: Plan, now: float
) -> str | Outcome | None:
    """What an `init_begin` of `island` with `plan` does to the init under way.

    Args:
        partial: the init under way (None: none).
        island: the asking island.
        plan: its plan (checked).
        now: wall-clock seconds.

    Returns:
        RESUME (the owner again with the same plan: keep the pieces; it was
        heard now), None (start a new init, dropping any unfinished one), or a
        rejected `already_initialized` (another island's init, heard within
        ABANDON_S), not yet counted.
    """
    if partial is None:
        return None
    if partial.island == island and partial.plan.hash == plan.hash:
        partial.heard = now
        return RESUME
    if partial.island != island and not partial.abandoned(now):
        return refused("already_initialized", f"{partial.describe()}; wait, then hello")
    return None


def piece_check(
    partial: PartialInit | None, header: Mapping[str, Any], payload: Sequence[Any], now: float
) -> np.ndarray | str | Outcome:
    """The values of an `init_piece` for the init under way, ALREADY_IN, or why it is refused.

    Args:
        partial: the init under way (None: none).
        header: the piece's header (island, plan_hash, fragment, offset checked by unpack).
        payload: codec frames of the tree {"values": 1-D float32 vector}.
        now: wall-clock seconds (a usable piece is the owner heard from).

    Returns:
        The piece's values (new), ALREADY_IN (this exact piece is in: answer it
        again, keep nothing), or a rejected outcome (not_initialized,
        already_initialized, plan_mismatch, unknown_fragment, bad_shape,
        codec_error, bad_dtype, non_finite), not yet counted.
    """
    if partial is None:
        return refused("not_initialized", "no init under way on this shard: send init_begin first")
    fragment, offset = header["fragment"], header["offset"]
    if header["island"] != partial.island:
        return refused("already_initialized", f"{partial.describe()}; wait for it, then hello")
    if header["plan_hash"] != partial.plan.hash:
        return refused(
            "plan_mismatch",
            f"piece for plan {header['plan_hash'][:12]}; the init under way has plan "
            f"{partial.plan.hash[:12]}: send init_begin with your plan first",
        )
    buffer = partial.buffers.get(fragment)
    if buffer is None:
        return refused(
            "unknown_fragment", f"fragment {fragment} is not one of {sorted(partial.buffers)}"
        )
    if offset >= len(buffer):
        return refused(
            "bad_shape", f"offset {offset} is past the end of fragment {fragment} ({len(buffer)})"
        )
    try:
        tree = codec.decode(payload, max_elements=len(buffer))
    except codec.CodecError as exc:
        return refused("codec_error", str(exc))
    if set(tree) != {"values"} or not isinstance(tree["values"], np.ndarray):
        return refused("bad_shape", f"a piece is the tree {{'values': vec}}, got {sorted(tree)}")
    values = tree["values"]
    if values.ndim != 1:
        return refused("bad_shape", f"piece values must be 1-D, got shape {values.shape}")
    problem = protocol.vector_problem(values, len(values))
    if problem is not None:
        return refused(problem[0], f"piece of fragment {fragment}: {problem[1]}")
    if (offset, offset + len(values)) in partial.received[fragment]:
        partial.heard = now
        return ALREADY_IN
    why = piece_problem(partial, fragment, offset, len(values))
    if why is not None:
        return refused("bad_shape", why)
    partial.heard = now
    return values
