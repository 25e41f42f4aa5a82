"""The init rules of a shard's state: the plan and initial values, whole or in pieces.

`ShardInit` is a part of `paramserver.server.state.ShardState` (a mixin: it
reads and sets the state's plan, fragments, partial init and counters): the
live requests (`initialize`, `begin_init`, `init_piece`) next to the replay of
the events they build (`_apply_init`, `_apply_init_piece`) and the one place
fragments are created from initial values (`_install`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from paramserver.server.admission import outcomes
from paramserver.server.admission.outcomes import Outcome
from paramserver.server.events import InitBeginEvent, InitEvent, InitPieceEvent, StateError
from paramserver.server.fragment import FragmentState
from paramserver.server.init_pieces import RESUME, PartialInit, begin_check, piece_check
from paramserver.server.step.fragment_step import host_vector
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
                init_pieces.ABANDON_S).

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
        """Take one piece of the init under way (the checks: init_pieces.piece_check).

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
