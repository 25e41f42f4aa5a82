"""The deterministic state of one shard: parameters, optimizer, pending deltas; no sockets, no files.

(Over 700 lines: one event-sourced state, whose every mutation, live or
replayed, goes through `apply`, must be read in one place; the rules it
applies live in `admission/` and `step/`.)

This module owns what a shard knows and every rule that changes it: the plan,
per owned fragment the fp32 parameters (1-D), outer optimizer state, version,
pending contributions (each delta kept coded as it arrived, `codec.decode`,
under the shard's `max_pending_bytes`), arrival statistics and round clock
(`paramserver.server.step.weighting`: staleness in rounds, the islands of a round); the dedup table; the island
registry (last heard from); the counters reported by `status`.

Event-sourced: every change that must survive a crash is one of these events,

- `InitEvent`: the plan and initial values (first `init`, all in one message);
- `InitBeginEvent`, `InitPieceEvent`: an init in pieces (`init_begin`, then one
  event per `init_piece`; the fragments exist once no element is missing, see
  `paramserver.server.state_init`);
- `AcceptEvent`: one validated delta joins a fragment's pending set;
- `StepEvent`: one outer step of a fragment merging exactly the listed keys.

`initialize`, `submit_delta` and `step` validate, build the event and
`apply` it; they return the event, which the caller (`paramserver.server.core`)
hands to the write-ahead log. Replaying the same events
through `apply` on a fresh state gives the same parameters bit for bit (the
write-ahead log's recovery). Rejected requests never reach `apply`, so they
never touch parameters. Island registry, rejection counts and byte counters
are bookkeeping, not events (a restart keeps what the last checkpoint had).

Parameters, optimizer state and downlink residual are host buffers that a
step updates in place (`paramserver.server.step.fragment_step`; JAX reads them
zero-copy): `snapshot` returns a copy, and a StepUpdate's values are valid
until the fragment's next step.

Clock: `now` is wall-clock seconds (the caller's time.time()), because
arrival times are persisted with pending deltas and must mean the same after a
restart. The state reads no clock: the duration of a step (for the eq3 grace
window) comes from the `timer` it is given (none: 0).

Why over 700 lines: one class whose live rules (`submit_delta`, `step`) and
replay (`apply`) must stay side by side, so that a change to one is seen next
to the other; the init rules (`state_init`, mixed in), the refusal rules
(`outcomes`), the step's arithmetic (`fragment_step`) and the on-disk forms
(`storage/`) live elsewhere.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from paramserver.server.admission import outcomes
from paramserver.server.admission.outcomes import (
    CheckedPayload,
    Outcome,
    ShardCounters,
    check_payload,
)
from paramserver.server.config import ShardConfig
from paramserver.server.fragment import (
    DEDUP_MAX_ROUNDS,
    AcceptEvent,
    Contribution,
    DedupEntry,
    Event,
    FragmentState,
    InitBeginEvent,
    InitEvent,
    InitPieceEvent,
    MomentumDtypeError,
    StateError,
    StepEvent,
    StepUpdate,
)
from paramserver.server.state_init import PartialInit, ShardInit
from paramserver.server.step.fragment_step import FragmentStepper, StepWork
from paramserver.server.step.policy import (
    IslandPace,
    decide,
    observe,
    observe_step,
    pace_report,
    quorum_time,
)
from paramserver.server.step.weighting import HISTORY, clip_factor, l2_norm, round_share
from paramserver.wire.plan import Plan
from paramserver.wire.protocol import ACCEPTED, live_islands

logger = logging.getLogger(__name__)

# The largest bound on a step's merged delta norm (sum of its deltas' clip * norm) that a
# step applies as is; above it the deltas are scaled down together (`ShardState._guard`).
MAX_MERGED_NORM = 1e30


class ShardState(ShardInit):
    """Everything one shard knows; see the module docstring for the event rules."""

    def __init__(
        self, cfg: ShardConfig, index: int, timer: Callable[[], float] | None = None
    ) -> None:
        """Create an empty (uninitialized) shard state.

        Args:
            cfg: cluster settings (policy, weighting, outer optimizer, limits).
            index: this shard's index in [0, cfg.shards).
            timer: a monotonic clock (seconds) timing each outer step for the
                grace window (e.g. time.perf_counter); None counts steps as 0 s.
        """
        if not 0 <= index < cfg.shards:
            raise StateError(f"shard index {index} out of range: the config has {cfg.shards}")
        self.cfg = cfg
        self.index = index
        self.policy = cfg.policy()
        self.stepper = FragmentStepper(cfg)
        self.optimizer = self.stepper.optimizer  # the outer optimizer's state <-> arrays
        self.plan: Plan | None = None
        self.partial_init: PartialInit | None = None  # an init in pieces under way
        self.init_owner: tuple[str, str] | None = None  # (island, plan hash) that completed it
        self.fragments: dict[int, FragmentState] = {}
        self.dedup: dict[tuple[str, int], DedupEntry] = {}
        self.last_seen: dict[str, float] = {}
        self.paces: dict[str, IslandPace] = {}  # reported step times (eq3 grace window)
        self.islands_pushing: int | None = None  # N of the latest step (status `outer`)
        # island -> when last heard (kept after bye; `forget_idle` drops it after island_ttl_s)
        self.heard_at: dict[str, float] = {}
        self.counters = ShardCounters()
        self.timer = timer

    # ----- queries -------------------------------------------------------------

    @property
    def initialized(self) -> bool:
        """Whether the shard has its plan and parameters."""
        return self.plan is not None

    def version_of(self, fragment: object) -> int:
        """The current version of one owned fragment (0 when not owned or before init)."""
        try:
            state = self.fragments.get(fragment)  # type: ignore[call-overload]
        except TypeError:  # an unhashable value from a bad header
            return 0
        return state.version if state is not None else 0

    def versions(self) -> dict[int, int]:
        """Fragment -> current version of the owned fragments.

        Returns:
            The versions (empty before init).
        """
        return {i: f.version for i, f in sorted(self.fragments.items())}

    def live(self, now: float) -> frozenset[str]:
        """Islands heard from within the liveness budget.

        Args:
            now: wall-clock seconds.

        Returns:
            The live island ids.
        """
        return live_islands(now, self.last_seen, self.cfg.heartbeat_interval_s, self.cfg.liveness)

    def snapshot(self, fragment: int, lo: int = 0, hi: int | None = None) -> tuple[int, np.ndarray]:
        """The current version and values [lo, hi) of an owned fragment.

        Args:
            fragment: fragment index.
            lo, hi: the elements wanted (default: all); only they are copied.

        Returns:
            (version, a read-only copy of those params: steps change them in place).

        Raises:
            StateError: not initialized or fragment not owned.
        """
        if fragment not in self.fragments:
            raise StateError(f"fragment {fragment} is not owned by shard {self.index}")
        frag = self.fragments[fragment]
        values = frag.params[lo:hi].copy()
        values.flags.writeable = False
        return frag.version, values

    def pending_bytes(self, island: str | None = None) -> int:
        """Bytes pending deltas of the shard keep (coded: `Contribution.delta.nbytes`).

        Args:
            island: count only this island's deltas (None: every island's).

        Returns:
            The sum over every owned fragment's pending deltas (of `island`).
        """
        return sum(
            c.delta.nbytes
            for f in self.fragments.values()
            for c in f.pending
            if island is None or c.island == island
        )

    def status(self, now: float) -> dict[str, Any]:
        """Counters and versions, JSON-ready (str keys).

        Args:
            now: wall-clock seconds (for liveness).

        Returns:
            A dict with shard, initialized, plan_hash, versions, islands_live,
            islands_known, accepted, duplicates, rejected, bytes_in, bytes_out,
            staleness_histogram, steps, clipped, pending (fragment -> count),
            pending_bytes (what the pending deltas keep, against
            max_pending_bytes; one island's against max_pending_bytes_per_island), paces (island -> reported step_s, steps, round_s)
            and credited_tokens (island -> tokens that entered the model through
            this shard: each merged delta's tokens * the fragment's share of all
            parameters, staleness not counted; summed over shards, an island's
            useful tokens).
        """
        return {
            "shard": self.index,
            "initialized": self.initialized,
            "plan_hash": self.plan.hash if self.plan else None,
            "versions": {str(k): v for k, v in self.versions().items()},
            "islands_live": sorted(self.live(now)),
            "islands_known": len(self.last_seen),
            "pending": {str(i): len(f.pending) for i, f in sorted(self.fragments.items())},
            "pending_bytes": self.pending_bytes(),
            "max_pending_bytes": self.cfg.max_pending_bytes,
            "max_pending_bytes_per_island": self.cfg.pending_bytes_per_island,
            "paces": {i: p.report() for i, p in sorted(self.paces.items())},
            **self.counters.report(),
        }

    # ----- islands -------------------------------------------------------------

    def hello(self, island: str, now: float) -> Outcome:
        """Register an island (or refresh it); at capacity, silent islands are forgotten first.

        Args:
            island: island id.
            now: wall-clock seconds.

        Returns:
            accepted, or rejected "too_many_islands" (counted).
        """
        if island not in self.last_seen and len(self.last_seen) >= self.cfg.max_islands:
            live = self.live(now)
            for gone in [i for i in self.last_seen if i not in live]:
                del self.last_seen[gone]
            if len(self.last_seen) >= self.cfg.max_islands:
                return self.reject(
                    "too_many_islands",
                    f"{len(self.last_seen)} live islands; max_islands={self.cfg.max_islands}",
                )
        self.last_seen[island] = now
        self.heard_at[island] = max(now, self.heard_at.get(island, now))
        return Outcome(ACCEPTED)

    def touch(self, island: str, now: float, header: Mapping[str, Any] | None = None) -> bool:
        """Refresh a known island's last-heard time (any message counts as a heartbeat).

        Args:
            island: island id.
            now: wall-clock seconds.
            header: the message; its `t_step` (and a push's `steps`) update the
                island's pace for the eq3 grace window.

        Returns:
            Whether the island is known (said hello).
        """
        if island not in self.last_seen:
            return False
        self.last_seen[island] = max(now, self.last_seen[island])
        self.heard_at[island] = self.last_seen[island]
        if header is not None and (pace := pace_report(self.paces.get(island), header)):
            self.paces[island] = pace
        return True

    def bye(self, island: str) -> None:
        """Forget an island that left (it no longer counts for quorum).

        Args:
            island: island id.
        """
        self.last_seen.pop(island, None)

    def forget_idle(self, now: float) -> list[str]:
        """Forget the islands with no session and nothing pending, unheard for island_ttl_s.

        An island has no session once it said bye or fell silent past the
        liveness budget. Forgetting drops its registry entry, pace, credited
        tokens (summed into `counters.credited_forgotten`) and its dedup
        entries: after that long no delta of a live session can still be on
        its way (a client re-sends within its ack timeout; an island away
        longer re-joins with deltas the shard treats as new). Islands known
        only from a checkpoint (no time heard since the start) count from `now`.

        Args:
            now: wall-clock seconds.

        Returns:
            The islands forgotten (the caller drops its own per-island state).
        """
        ttl = self.cfg.island_ttl_s
        live = self.live(now)
        busy = {c.island for f in self.fragments.values() for c in f.pending}
        known = set(self.heard_at) | set(self.last_seen) | {i for i, _ in self.dedup}
        known |= set(self.counters.credited) | set(self.paces)
        gone = []
        for island in known:
            heard = self.heard_at.setdefault(island, now)
            if island not in live and island not in busy and now - heard > ttl:
                gone.append(island)
        if not gone:
            return gone
        dropped = set(gone)
        for island in gone:
            self.heard_at.pop(island, None)
            self.last_seen.pop(island, None)
            self.paces.pop(island, None)
            credit = self.counters.credited.pop(island, 0.0)
            self.counters.credited_forgotten += credit
        self.dedup = {k: e for k, e in self.dedup.items() if k[0] not in dropped}
        self.counters.forgotten_islands += len(gone)
        return gone

    # ----- requests that change state -----------------------------------------

    def reject(self, reason: str, detail: str) -> Outcome:
        """Count a rejection and build its outcome.

        Args:
            reason: one of paramserver.wire.protocol.REASONS.
            detail: human-readable explanation.

        Returns:
            Outcome(rejected, reason, detail).
        """
        return outcomes.count(self.counters, outcomes.refused(reason, detail))

    def submit_delta(
        self, header: Mapping[str, Any], payload: Sequence[Any], now: float
    ) -> Outcome:
        """Validate a push and, if good, accept its delta into the pending set.

        Args:
            header: a push header that passed protocol.unpack.
            payload: codec frames of the tree {"delta": 1-D vector of the fragment's size}.
            now: wall-clock arrival time.

        Returns:
            accepted (with its AcceptEvent), duplicate, or rejected with a
            reason (too_many_pending too when the delta, at its coded size,
            would take the island's pending deltas over its share,
            max_pending_bytes_per_island, checked once before the payload is
            read, or the shard's over max_pending_bytes); counted.
            Parameters are never touched here.
        """
        early = self.precheck_push(header, payload, now)
        if early is not None:
            return early
        size = self.fragments[header["fragment"]].params.shape[0]
        return self.admit_checked(header, payload, check_payload(payload, size), now)

    def precheck_push(
        self, header: Mapping[str, Any], payload: Sequence[Any], now: float
    ) -> Outcome | None:
        """The checks of a push that read no payload byte: its refusal (counted), or None.

        Args:
            header: a push header that passed protocol.unpack.
            payload: its codec frames (only their byte counts are read).
            now: wall-clock arrival time.

        Returns:
            The early outcome (a duplicate, or a refusal: plan, fragment, dedup,
            staleness, count limits, the island's budget at the size sent),
            or None when the payload is worth checking (`outcomes.check_payload`).
        """
        key = (header["island"], header["fragment"])
        early = outcomes.check_push(
            header,
            self.plan,
            self.fragments.get(header["fragment"]),
            header["island"] in self.last_seen,
            self.dedup.get(key),
            self.cfg,
            now,
        )
        if early is not None:
            return outcomes.count(self.counters, early)
        frag = self.fragments[header["fragment"]]
        island, size = header["island"], frag.params.shape[0]
        sent = sum(memoryview(f).nbytes for f in payload)  # ~ its coded size, before decoding
        limit = self.island_budget(sent, size)
        full = outcomes.island_budget_refusal(island, self.pending_bytes(island), None, limit)
        return None if full is None else outcomes.count(self.counters, full)

    def admit_checked(
        self,
        header: Mapping[str, Any],
        payload: Sequence[Any],
        checked: CheckedPayload,
        now: float,
    ) -> Outcome:
        """Accept a push whose payload was checked (`outcomes.check_payload`), or refuse it.

        Call right after `precheck_push` returned None for it, with no state
        change in between (the shard's loop calls both again when the payload
        was checked off the loop meanwhile).

        Args:
            header: the push header.
            payload: its codec frames (kept for the log record).
            checked: its checked delta and norm, or the payload's refusal.
            now: wall-clock arrival time.

        Returns:
            accepted (with its AcceptEvent) or rejected (counted).
        """
        if checked.refusal is not None:
            return outcomes.count(self.counters, checked.refusal)
        delta, norm = checked.delta, checked.norm
        assert delta is not None
        frag = self.fragments[header["fragment"]]
        island, size = header["island"], frag.params.shape[0]
        mine = self.pending_bytes(island)
        too_large = outcomes.norm_refusal(norm, self._param_norm(frag), frag.params.shape[0],
                                          self.cfg.max_delta_norm_ratio)  # fmt: skip
        if too_large is not None:
            return outcomes.count(self.counters, too_large)
        limit = self.island_budget(delta.nbytes, size)
        over = outcomes.island_budget_refusal(island, mine, delta.nbytes, limit)
        if over is None:
            budget = self.cfg.max_pending_bytes
            over = outcomes.budget_refusal(self.pending_bytes(), delta.nbytes, budget)
        if over is not None:
            return outcomes.count(self.counters, over)
        contribution = Contribution(
            island=header["island"],
            round=header["round"],
            fragment=header["fragment"],
            base_version=header["base_version"],
            tokens=header["tokens"],
            steps=header["steps"],
            arrived=float(now),
            delta=delta,
            floor=header.get("floor"),
            norm=norm,
        )
        event = AcceptEvent(contribution, tuple(payload))
        self.apply(event)
        # a step under way makes version + 1 without this delta: it joins the next one
        merged = frag.version + 1 + (frag.in_step is not None)
        return Outcome(ACCEPTED, event=event, version=frag.version, merged_version=merged)

    def island_budget(self, delta_bytes: int, fragment_size: int) -> int:
        """The pending bytes one island may keep here, given one of its deltas.

        `max_pending_bytes_per_island` when set; by default a quarter of
        `max_pending_bytes`, but at least two whole-model deltas of the island
        on this shard at that delta's bytes per parameter (its codec): an
        island is never refused its second round while the first is pending.
        The shard's own budget (`max_pending_bytes`) still bounds them all.

        Args:
            delta_bytes: one of the island's deltas, coded (or as sent).
            fragment_size: that delta's fragment's elements.

        Returns:
            Bytes.
        """
        if self.cfg.max_pending_bytes_per_island:
            return self.cfg.max_pending_bytes_per_island
        shard_size = sum(f.params.shape[0] for f in self.fragments.values())
        whole = -(-delta_bytes * shard_size // max(1, fragment_size))
        return max(self.cfg.pending_bytes_per_island, 2 * whole)

    # ----- steps ----------------------------------------------------------------

    def due_fragments(self, now: float) -> tuple[list[int], float | None]:
        """Which fragments the merge policy says to step now, and when to look again.

        Args:
            now: wall-clock seconds.

        Returns:
            (fragments to step now, earliest wake_at of the others or None); under
            rda in sync mode a due piece of a cut tensor waits for its siblings
            (`paramserver.server.step.policy`).
        """
        live = self.live(now)
        due: list[int] = []
        wake: float | None = None
        for index, frag in sorted(self.fragments.items()):
            if not frag.pending:
                continue
            decision = decide(now, frag.waiting(), live, frag.stats, self.policy, self.paces)
            if decision.step:
                due.append(index)
            elif decision.wake_at is not None:
                wake = decision.wake_at if wake is None else min(wake, decision.wake_at)
        # rda in sync mode: a cut tensor's pieces step together
        due = self.stepper.groups.ready(
            self.plan, self.index, self.policy.mode, self.fragments, due
        )
        return due, wake

    def step(self, fragment: int, now: float) -> tuple[StepEvent, StepUpdate]:
        """One outer step of a fragment merging all its pending deltas, in this thread.

        `begin_step`, `StepWork.run` and `finish_step` in one go.

        Args:
            fragment: an owned fragment with pending deltas.
            now: wall-clock seconds.

        Returns:
            (the applied StepEvent, the StepUpdate to publish).
        """
        work = self.begin_step(fragment, now)
        work.run()
        return work.event, self.finish_step(work)

    def begin_step(self, fragment: int, now: float) -> StepWork:
        """Decide a live outer step of a fragment (all its pending deltas) without running it.

        The fragment is marked in step (`FragmentState.in_step`) until
        `finish_step`: meanwhile its arrays belong to the step (`StepWork.run`,
        e.g. in a worker thread), pushes to it join its pending deltas for the
        next step, and nothing else of the state is read by the step.

        Args:
            fragment: an owned fragment with pending deltas, not in step.
            now: wall-clock seconds.

        Returns:
            The step's work: its event and inputs.

        Raises:
            StateError: nothing pending, or a step of it is already under way.
        """
        frag = self.fragments.get(fragment)
        if frag is None or not frag.pending:
            raise StateError(f"fragment {fragment} has nothing to step")
        if frag.in_step is not None:
            raise StateError(f"fragment {fragment} is already being stepped")
        live = self.live(now)
        quorum_s = quorum_time(frag.waiting(), live, self.policy)
        # islands of a round: those that push (round_clock), not every island heard
        expected = frag.clock.expected(live, {c.island for c in frag.pending})
        event = self.stepper.groups.step_event(
            self.plan, self.index, self.fragments, fragment, float(now), expected
        )  # rda: Grams
        event = replace(event, momentum_dtype=self.cfg.momentum_dtype)
        return self._work(event, quorum_s)

    def _work(self, event: StepEvent, quorum_s: float | None = None) -> StepWork:
        """The work of a step event: the deltas it merges, marked in step."""
        frag = self.fragments.get(event.fragment)
        if frag is None:
            raise StateError(f"step event for fragment {event.fragment} not owned by {self.index}")
        by_key = {(c.island, c.round): c for c in frag.pending}
        try:
            merged_in = [by_key[tuple(k)] for k in event.keys]
        except KeyError as exc:
            raise StateError(f"step event merges {exc.args[0]}, which is not pending") from None
        if not merged_in:
            raise StateError(f"step event for fragment {event.fragment} merges nothing")
        merged_in = self._guard(frag, event.fragment, merged_in)
        frag.in_step = frozenset((c.island, c.round) for c in merged_in)
        where = self.plan.fragments[event.fragment]
        return StepWork(self, self.stepper, self.timer, event, frag, merged_in, where, quorum_s)

    def finish_step(self, work: StepWork) -> StepUpdate:
        """Book a step whose arithmetic ran (`StepWork.run`): pending set, version, counters.

        Args:
            work: from `begin_step` (or replay), run.

        Returns:
            The StepUpdate to publish.

        Raises:
            StateError: the work belongs to another state.
            BaseException: what the step's arithmetic raised (re-raised here).
        """
        if work.owner is not self:
            raise StateError("a step of another state (the shard's state was rebuilt meanwhile)")
        frag, event, merged_in = work.frag, work.event, work.merged_in
        frag.in_step = None
        if work.error is not None:
            raise work.error
        assert work.shares is not None
        share_of_model = frag.params.shape[0] / self.plan.total_size
        self.counters.add_step(  # credit: the tokens that entered the model, staleness aside
            [frag.version - c.base_version for c in merged_in],
            {x.island: x.tokens * share_of_model for x in work.shares},
        )
        done = {id(c) for c in merged_in}
        frag.pending = [c for c in frag.pending if id(c) not in done]
        frag.version += 1
        self.islands_pushing = event.expected or len(work.shares)
        frag.clock.advance(
            round_share(len(work.shares), event.expected or None),
            [x.island for x in work.shares],
        )
        frag.param_norm = l2_norm(frag.params)  # the next pushes' bound; and a finite check
        if not np.isfinite(frag.param_norm):
            self.counters.non_finite_steps += 1
            logger.error(
                "shard %d fragment %d: parameters not finite after step %d (a bug: report it)",
                self.index, event.fragment, frag.version,
            )  # fmt: skip
        credited = {x.island: self.counters.credited[x.island] for x in work.shares}
        coefficients = {x.island: round(x.coefficient, 4) for x in work.shares}
        values = frag.params.view()
        values.flags.writeable = False  # valid until this fragment's next step
        update = StepUpdate(
            event.fragment, frag.version, values, work.frames, credited, coefficients
        )
        if work.quorum_s is None:  # replayed
            return update
        frag.stats = observe_step(frag.stats, work.quorum_s, work.took, self.policy.ema_alpha)
        where = {"shard": self.index, "fragment": event.fragment, "version": update.version}
        merged = len(event.keys)
        logger.info(
            "outer step shard=%d fragment=%d version=%d merged=%d", *where.values(), merged,
            extra={**where, "merged": merged, "coefficients": update.coefficients},
        )  # fmt: skip
        return update

    # ----- the one mutation path --------------------------------------------------

    def apply(self, event: Event) -> StepUpdate | None:
        """Apply an event (live or replayed from the log).

        Args:
            event: InitEvent, AcceptEvent or StepEvent.

        Returns:
            The StepUpdate of a StepEvent, else None.

        Raises:
            StateError: the event does not fit this state (corrupted or foreign log).
        """
        if isinstance(event, InitEvent):
            self._apply_init(event)
            return None
        if isinstance(event, InitBeginEvent | InitPieceEvent):
            self._apply_init_piece(event)
            return None
        if isinstance(event, AcceptEvent):
            self._apply_accept(event.contribution)
            return None
        if isinstance(event, StepEvent):
            return self._apply_step(event)
        raise StateError(f"unknown event {type(event).__name__}")

    def _apply_accept(self, c: Contribution) -> None:
        frag = self.fragments.get(c.fragment)
        if frag is None:
            raise StateError(f"accept event for fragment {c.fragment} not owned by {self.index}")
        if c.delta.size != frag.params.shape[0]:
            raise StateError(
                f"accept event for fragment {c.fragment} has {c.delta.size} elements, "
                f"the fragment {frag.params.shape[0]}"
            )
        if self.cfg.clip_norm_multiple > 0:
            c = self._clip(frag, c)
        frag.pending.append(c)
        frag.stats = observe(frag.stats, c.arrived, self.policy.ema_alpha)
        entry = self.dedup.get((c.island, c.fragment))
        if entry is None:
            entry = self.dedup[(c.island, c.fragment)] = DedupEntry(c.round, set())
        entry.rounds.add(c.round)
        floor = entry.floor
        if c.floor is not None:
            entry.floor = c.floor if entry.floor is None else max(entry.floor, c.floor)
        if c.round > entry.newest or entry.floor != floor:
            entry.newest = max(entry.newest, c.round)
            low = entry.low(self.cfg.dedup_window)
            entry.rounds = {r for r in entry.rounds if r >= low}
        if len(entry.rounds) > DEDUP_MAX_ROUNDS:  # a round held back that long: forget it
            entry.rounds.discard(min(entry.rounds))
            entry.floor = min(entry.rounds)
        self.counters.accepted += 1

    def _param_norm(self, frag: FragmentState) -> float:
        """The fragment's parameter norm (computed once per version, float64)."""
        if frag.param_norm is None:
            frag.param_norm = l2_norm(frag.params)
        return frag.param_norm

    def _clip(self, frag: FragmentState, c: Contribution) -> Contribution:
        """Scale a delta down to the robust bound (deterministic: replay clips the same)."""
        norm = l2_norm(c.delta) if c.norm is None else c.norm
        factor = clip_factor(norm, frag.norms, self.cfg.clip_norm_multiple)
        frag.norms = [*frag.norms, norm * factor][-HISTORY:]
        c = replace(c, norm=norm)
        if factor >= 1.0:
            return c
        self.counters.clipped += 1
        logger.warning(
            "shard %d clipped a delta of island %s on fragment %d: norm %.4g scaled by %.3g",
            self.index,
            c.island,
            c.fragment,
            norm,
            factor,
            extra={"shard": self.index, "island": c.island, "fragment": c.fragment},
        )
        # the delta stays as received (what the log replays); the merge applies the factor
        return replace(c, clip=factor)

    def _guard(
        self, frag: FragmentState, fragment: int, merged_in: list[Contribution]
    ) -> list[Contribution]:
        """The step's deltas, scaled down together when their merge could leave float32's range.

        Every coefficient of a merge is at most 1, so sum(clip * norm) bounds the
        merged delta's norm. Above MAX_MERGED_NORM (accepted deltas never get
        there: `max_delta_norm_ratio`; only a bug or a huge model could) every
        delta is scaled so that the bound is MAX_MERGED_NORM: the step stays
        finite. Deterministic, so replay scales the same.
        """
        norms = [l2_norm(c.delta) if c.norm is None else c.norm for c in merged_in]
        bound = math.fsum(c.clip * n for c, n in zip(merged_in, norms, strict=True))
        if bound <= MAX_MERGED_NORM:
            return merged_in
        scale = MAX_MERGED_NORM / bound if math.isfinite(bound) else 0.0
        self.counters.guarded_steps += 1
        logger.error(
            "shard %d fragment %d: merged delta bound %.4g over %.0e: its deltas scaled by %.3g",
            self.index, fragment, bound, MAX_MERGED_NORM, scale,
        )  # fmt: skip
        scaled_in = [replace(c, clip=c.clip * scale) for c in merged_in]
        swap = {id(old): new for old, new in zip(merged_in, scaled_in, strict=True)}
        frag.pending = [swap.get(id(c), c) for c in frag.pending]
        return scaled_in

    def _apply_step(self, event: StepEvent) -> StepUpdate:
        if event.momentum_dtype != self.cfg.momentum_dtype:  # never mixed (same bits as live)
            raise MomentumDtypeError(
                event.momentum_dtype,
                self.cfg.momentum_dtype,
                f"the logged step of fragment {event.fragment}",
            )
        work = self._work(event)
        work.run()
        return self.finish_step(work)
