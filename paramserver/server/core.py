"""The shard's protocol logic without I/O (the sans-I/O pattern of h11): requests in, effects out.

`ShardCore.handle(now, request)` takes one request as it came off the ROUTER
and returns `Effects`: the events to append to the write-ahead log, the
replies and the publishes. `due_steps(now)` says which fragments the merge
policy says to step (each marked `urgent` when its pending deltas near the
per-island limit, `pending_near_limit`); the I/O loop clears each with its
data directory (a checkpoint being written may ask to defer one to a later
turn) and `on_tick(now, steps)` takes the cleared steps and heartbeats an idle
PUB; the shard's loop instead begins one with `start_step` (the fragment is in
step: pushes to it join the next step, snapshots of it are answered after it,
pushes over their pending limits wait for it, no checkpoint begins), has the
step thread run it, and books it with `finish_step` (`heartbeat` for the PUB); `next_wake(now)` says when to tick again; `checkpoint_due(now)` when to
begin a checkpoint, and `checkpoint_started` / `checkpoint_done` record one
(`paramserver.server.checkpoint_schedule`).
Nothing here reads a clock, a socket or a file: `now` (wall-clock seconds) is
an argument, so a simulation drives the core with a fake clock.

The one rule of durability: nothing that vouches for an event is sent before
the event's record is fsynced (`paramserver.server.shard.run_batch`; the
shard's log writer thread, `.group_commit`). A reply that says something is on disk (an accepted or duplicate ack,
`init_ok`, `init_begun`, `init_piece_ok`) is a `DurableReply`, decided once
the storage outcome is known: `settle(effects, now, failure)` renders it as
answered when its record is on disk, or, when it is not, adopts the state
rebuilt from disk and renders it a `storage_error` refusal, and drops the
updates of steps not on disk (a failed append costs only its own request;
a failed sync, the whole batch). `settle` then numbers the publishes
(`seq`), packs every message and counts the bytes sent.

Admission (`handle`): a request is charged to its island's rate bucket before
anything is decoded, then decoded and checked (protocol version, kind,
header), its island id checked against its connection and, under CURVE,
against the keys that may use it (`paramserver.server.admission.gate`,
`paramserver.plumbing.identity`); its outcome and refusals, their counts and
what `status` shows of each island are `paramserver.server.admission.outcomes`;
the state's rules (dedup, limits, staleness) decide a push. A large push's
payload (checksums, decompression, the norm) is checked off the core: `handle`
returns it as a `PushCheck` (`Effects.checks`) and `finish_push` admits it once
checked (`paramserver.server.shard.PushChecker`). Snapshots, status
and heartbeats need no disk, so they are served through storage faults.

What the core asks its I/O loop to do is plain data
(`paramserver.server.effects`): a `Request` as received, and the `Effects` of
a batch; a `DueStep` the policy says is due; a `StorageFailure`, what the loop
tells the core when records did not become durable.

Why over 700 lines: one class whose request handlers, step hand-over
(start_step / finish_step, the requests held meanwhile) and durability
(settle) share the same state and ordering rules; the rules themselves live
in admission/, step/, state and checkpoint_schedule.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import codec
from paramserver.plumbing.identity import IslandGuard
from paramserver.server.admission import gate, outcomes
from paramserver.server.admission.gate import ReplyBacklog
from paramserver.server.admission.outcomes import IslandReports, Outcome
from paramserver.server.checkpoint_schedule import CheckpointSchedule
from paramserver.server.config import ShardConfig
from paramserver.server.effects import (
    DueStep,
    DurableReply,
    Effects,
    Publish,
    PushCheck,
    Reply,
    Request,
    StorageFailure,
)
from paramserver.server.fragment import StepEvent
from paramserver.server.state import ShardState
from paramserver.server.step.fragment_step import StepWork
from paramserver.wire import protocol
from paramserver.wire.protocol import ACCEPTED, REJECTED

logger = logging.getLogger(__name__)


# ----- the core ---------------------------------------------------------------------

FORGET_EVERY_S = 1.0  # how often idle islands are looked for (`ShardCore._forget_idle`)
# Requests that act as an island, refused from a connection the island is not bound to.
_BOUND_KINDS = ("push", "heartbeat", "bye")
# The state's counters of requests (not of durable events): kept across a rebuild from disk.
_REQUEST_COUNTERS = (
    "duplicates", "rejected", "bytes_in", "bytes_out", "hello_requests", "dropped",
)  # fmt: skip


class ShardCore:
    """One shard's protocol logic: requests and ticks in, effects out; see the module docstring."""

    def __init__(
        self,
        cfg: ShardConfig,
        index: int,
        state: ShardState,
        endpoints: list[tuple[str, str]],
        now: float,
        guard: IslandGuard | None = None,
        replayed: int = 0,
        last_checkpoint: dict[str, Any] | None = None,
    ) -> None:
        """Wrap a (recovered) state.

        Args:
            cfg: cluster settings.
            index: this shard's index.
            state: the state recovered from the data dir (or a fresh one).
            endpoints: connect addresses [(router, pub), ...] of every shard (for `welcome`).
            now: wall-clock seconds at start (checkpoint and heartbeat clocks start here).
            guard: under CURVE, which key may act as which island.
            replayed: log records replayed at recovery (they count toward a checkpoint).
            last_checkpoint: the checkpoint recovery loaded, for status (see checkpoint_done).
        """
        self.cfg = cfg
        self.index = index
        self.state = state
        self.endpoints = endpoints
        self.guard = guard
        self.seq = 0  # of the last message published
        self.bindings = gate.Bindings(cfg.heartbeat_interval_s, cfg.liveness)
        self._raw32 = codec.raw("float32")  # one per core: encoders keep work buffers
        self._raw32_step = codec.raw("float32")  # the float32 update's, used by the step's thread
        self._last_pub = now
        self.checkpoints = CheckpointSchedule(
            cfg.checkpoint_every_steps, cfg.checkpoint_every_s, last_at=now,
            records_since=replayed, retry_at=now, last=last_checkpoint,
        )  # fmt: skip
        self._h_warned: set[str] = set()  # islands told their H takes other outer defaults
        self.islands = IslandReports()  # what `status` shows of each island (not durable)
        self._forget_at = now  # when to look for islands idle past island_ttl_s next
        # bytes of large replies each connection has not read yet (the I/O loop tracks sends)
        self.backlog = ReplyBacklog(cfg.unread_reply_bytes)
        # request rate limits, checked before a request is decoded
        self.throttle = gate.Throttle(
            gate.Limits(cfg.max_requests_per_s, cfg.request_burst, cfg.max_refusals_per_s)
        )
        self.stepping: StepWork | None = None  # the step under way (start_step .. finish_step)
        self._held: list[Request] = []  # pushes waiting for the step under way (release_held)
        self._held_snapshots: list[Request] = []  # of the fragment in step: after it (finish_step)
        self._due: set[int] = set()  # the fragments due at the last due_steps
        # pushes that send, or decode to, at least this many payload bytes (int8 codes: one
        # per element) are checked off the core (0: never; the shard's loop, which has a
        # checker thread, sets it): see shard.PushChecker
        self.check_off_loop_bytes = 0
        self.checking = 0  # pushes handed off (Effects.checks) and not yet finish_push'ed

    # ----- requests ----------------------------------------------------------------

    def handle(self, now: float, request: Request) -> Effects:
        """Answer one request.

        A request whose first frame is empty came from a REQ socket: the empty
        delimiter is stripped and put back before the reply's header. Before
        anything is decoded the request is charged to its island's (or
        connection's) bucket (`paramserver.server.admission.gate`): over it, it is
        answered `throttled` or, past the answers allowed, dropped unanswered,
        like a header that does not decode past them.

        Args:
            now: wall-clock seconds.
            request: the connection and frames as received.

        Returns:
            Its effects (to be made durable, then sent); none for a dropped request.
        """
        size = protocol.message_bytes(request.frames)
        if not request.admitted:
            self.state.counters.bytes_in += size
            if request.frames and memoryview(request.frames[0]).nbytes == 0:
                request = replace(request, frames=request.frames[1:], envelope=(b"",))
            payload = len(request.frames) > 1  # a push: free while its island's are acked
            verdict, retry_after = self.throttle.admit(now, request.conn, payload)
            if verdict != gate.ADMIT:
                return self._throttled(request, verdict, retry_after)
        try:
            header, payload = protocol.unpack(request.frames)
        except protocol.ProtocolError as exc:
            if not self.throttle.may_answer(now, request.conn):
                self.state.counters.drop(exc.reason)
                return Effects()
            refusal = self.state.reject(exc.reason, exc.detail)
            header = outcomes.render_rejected(exc.header, refusal)
            return Effects(replies=[Reply(request.conn, header, [], request.envelope)])
        island, kind = header.get("island"), header["kind"]
        if self.guard is not None and isinstance(island, str):
            refusal = self.guard.refusal(request.user_id, island, kind, now)
            if refusal is not None:  # before the binding: it neither refreshes nor takes the id
                return self._answer(request, header, self.state.reject("forbidden_island", refusal))
        known = True
        if isinstance(island, str) and kind != "hello":
            verdict = self.bindings.verdict(island, request.conn, now)
            if verdict == gate.IN_USE and kind in _BOUND_KINDS:
                detail = self.bindings.in_use_detail(island, now)
                return self._answer(request, header, self.state.reject("island_in_use", detail))
            known = verdict == gate.OWN and self.state.touch(island, now, header)
        too_big = outcomes.oversize(size, self.cfg.max_message_bytes) or outcomes.too_many_frames(
            len(request.frames), self.cfg.max_frames_per_message
        )
        if too_big is not None:
            return self._answer(request, header, outcomes.count(self.state.counters, too_big))
        try:
            return getattr(self, f"_on_{kind}")(request, header, payload, now, known)
        except Exception as exc:  # a bug must not take the shard down; it is counted
            logger.exception("shard %d: error handling %s", self.index, kind)
            outcome = self.state.reject("internal_error", f"{type(exc).__name__}: {exc}")
            return self._answer(request, header, outcome)

    def _throttled(self, request: Request, verdict: str, retry_after: float) -> Effects:
        """Refuse a request over its bucket: `throttled` (an ack for a push), or drop it."""
        if verdict == gate.DROP:
            self.state.counters.drop("throttled")
            return Effects()
        limits = self.throttle.limits
        refusal = outcomes.throttled(retry_after, limits.rate, limits.burst)
        outcomes.count(self.state.counters, refusal)
        try:  # only the answered few are decoded: for their id (and a push's ack fields)
            header, _ = protocol.unpack(request.frames)
        except protocol.ProtocolError as exc:
            reply = outcomes.render_rejected(exc.header, refusal)
            return Effects(replies=[Reply(request.conn, reply, [], request.envelope)])
        return self._answer(request, header, refusal)

    def _reply(self, request: Request, header: dict, kind: str, payload=(), **fields) -> Effects:
        reply = protocol.reply_header(header, kind, **fields)
        return Effects(replies=[Reply(request.conn, reply, list(payload), request.envelope)])

    def _durable_reply(self, request: Request, header: dict, kind: str, outcome: Outcome, **fields):
        """An init_* reply, sent once the batch (with the outcome's event) is on disk."""
        reply = DurableReply(
            request.conn, header, kind, fields, envelope=request.envelope, event=outcome.event
        )
        records = [outcome.event] if outcome.event is not None else []
        return Effects(records=records, replies=[reply])

    def _answer(self, request: Request, header: dict, outcome: Outcome) -> Effects:
        """Reply with an outcome (`ack` for a push, else `rejected`); log its event if any.

        A push's accepted or duplicate ack says the delta is on disk: it is a
        `DurableReply`, rendered by `settle` once the batch's storage outcome is known.
        """
        version = self.state.version_of(header.get("fragment"))
        records = [outcome.event] if outcome.event is not None else []
        if header.get("kind") == "push" and outcome.status != REJECTED:
            reply: Reply | DurableReply = DurableReply(
                request.conn, header, "ack", outcome=outcome, version=version,
                envelope=request.envelope, event=outcome.event,
            )  # fmt: skip
        else:
            reply = Reply(request.conn, outcomes.render(header, outcome, version), [],
                          request.envelope)  # fmt: skip
        return Effects(records=records, replies=[reply])

    def _on_hello(self, request: Request, header: dict, payload, now: float, known: bool):
        island, session = header["island"], header.get("session")
        if header.get("attach") is True:
            return self._on_attach(request, header, now)
        if not self.bindings.may_bind(island, request.conn, session, now):
            detail = self.bindings.in_use_detail(island, now)
            return self._answer(request, header, self.state.reject("island_in_use", detail))
        outcome = self.state.hello(island, now)
        if outcome.status == REJECTED:
            return self._answer(request, header, outcome)
        self.bindings.bind(island, gate.Binding(request.conn, session, now))
        self.throttle.bind(request.conn, island)
        if len(self.bindings) > len(self.state.last_seen):
            self.bindings.prune(self.state.last_seen)
        return self._reply(request, header, "welcome", **self._welcome_fields())

    def _on_attach(self, request: Request, header: dict, now: float) -> Effects:
        """An attach hello: one more connection of a bound island (gate.Bindings.attach_refusal)."""
        island = header["island"]
        reason = self.bindings.attach_refusal(island, header.get("session"))
        if reason is not None or not self.state.touch(island, now):
            if reason == "island_in_use":
                detail = self.bindings.in_use_detail(island, now)
            else:
                reason = "unknown_island"
                detail = (
                    f"island {island!r} is not bound here: say hello without `attach` "
                    "first (on the connection that heartbeats), then attach"
                )
            return self._answer(request, header, self.state.reject(reason, detail))
        let_go = self.bindings.attach(island, request.conn, now)
        if let_go is not None:
            self.throttle.detach(let_go)
        self.throttle.attach(request.conn, island)
        return self._reply(request, header, "welcome", **self._welcome_fields())

    def peer(self, conn: bytes) -> gate.Key:
        """Whom the bytes of unread replies to `conn` are charged to: its island, else itself."""
        return self.throttle.key(conn)

    def _welcome_fields(self) -> dict[str, Any]:
        """The fields of a `welcome` (docs/protocol.md section 3.1)."""
        plan = self.state.plan
        fields: dict[str, Any] = {
            "shard": self.index,
            "num_shards": self.cfg.shards,
            "num_fragments": self.cfg.num_fragments,
            "endpoints": [list(e) for e in self.endpoints],
            "initialized": plan is not None,
            "plan_hash": plan.hash if plan else None,
            "heartbeat_interval_s": self.cfg.heartbeat_interval_s,
            "liveness": self.cfg.liveness,
            "seq": self.seq,
            "mode": self.cfg.mode,
            "max_message_bytes": self.cfg.max_message_bytes,
        }
        if plan is not None:
            fields["plan"] = plan.to_wire()
        return fields

    def _on_init(self, request: Request, header: dict, payload, now: float, known: bool):
        outcome = self.state.initialize(header["plan"], payload, now)
        if outcome.status != ACCEPTED:
            return self._answer(request, header, outcome)
        return self._init_ok(request, header, outcome)

    def _init_ok(self, request: Request, header: dict, outcome: Outcome) -> Effects:
        versions = protocol.versions_to_wire(self.state.versions())
        return self._durable_reply(request, header, "init_ok", outcome, versions=versions)

    def _on_init_begin(self, request: Request, header: dict, payload, now: float, known: bool):
        outcome = self.state.begin_init(header["plan"], header["island"], now)
        if outcome.status != ACCEPTED:
            return self._answer(request, header, outcome)
        partial = self.state.partial_init
        return self._durable_reply(
            request, header, "init_begun", outcome,
            plan_hash=partial.plan.hash, missing=partial.missing,
        )  # fmt: skip

    def _on_init_piece(self, request: Request, header: dict, payload, now: float, known: bool):
        outcome = self.state.init_piece(header, payload, now)
        if outcome.status == REJECTED:
            return self._answer(request, header, outcome)
        if self.state.initialized:  # this piece completed the init (or did, before a re-send)
            return self._init_ok(request, header, outcome)
        fragment, offset = header["fragment"], header["offset"]
        partial = self.state.partial_init
        return self._durable_reply(
            request, header, "init_piece_ok", outcome, fragment=fragment, offset=offset,
            count=partial.count_at(fragment, offset), missing=partial.missing,
        )  # fmt: skip

    def _on_snapshot(self, request: Request, header: dict, payload, now: float, known: bool):
        fragment = header["fragment"]
        refusal = outcomes.snapshot_refusal(
            self.state.initialized, fragment in self.state.fragments, fragment, self.index
        )
        if refusal is None:
            size = self.state.fragments[fragment].params.shape[0]
            offset = header.get("offset", 0)
            end = min(size, offset + header.get("count", size))
            refusal = outcomes.snapshot_piece_refusal(
                offset, end, size, protocol.piece_elements(self.cfg.max_message_bytes)
            )
        peer = self.peer(request.conn)  # an island's connections share its bound
        if refusal is None and not self.backlog.admits(peer):  # a reader that lags
            refusal = self.backlog.refusal(peer)
        if refusal is not None:
            return self._answer(request, header, outcomes.count(self.state.counters, refusal))
        if self.state.fragments[fragment].in_step is not None:  # its arrays change: after the step
            self._held_snapshots.append(replace(request, admitted=True))
            return Effects()
        version, values = self.state.snapshot(fragment, offset, end)  # copies the piece only
        frames, _ = self._raw32.encode({"values": values})
        self.backlog.charge(peer, protocol.message_bytes(frames))
        return self._reply(
            request, header, "snapshot_reply", frames, fragment=fragment, version=version,
            seq=self.seq, offset=offset, size=size,
        )  # fmt: skip

    def _on_push(self, request: Request, header: dict, payload, now: float, known: bool):
        if known and self._waits_for_step(header, payload):
            self._held.append(replace(request, admitted=True))
            return Effects()
        if not known:
            outcome = outcomes.count(self.state.counters, outcomes.unknown_island(header["island"]))
            return self._answer(request, header, outcome)
        # the check reads what was sent and decodes the whole fragment (a zstd frame of a
        # flat int8 delta is tiny to send and decompresses to one byte per element)
        sent = sum(memoryview(f).nbytes for f in payload)
        frag = self.state.fragments.get(header["fragment"])
        decoded = 0 if frag is None else frag.params.shape[0]
        off_loop = self.check_off_loop_bytes
        if off_loop and (self.checking or max(sent, decoded) >= off_loop):
            early = self.state.precheck_push(header, payload, now)
            if early is None:  # the payload is checked off the core; finish_push books it
                self.checking += 1
                size = self.state.fragments[header["fragment"]].params.shape[0]
                job = PushCheck(replace(request, admitted=True), header, payload, size)
                return Effects(checks=[job])
            return self._pushed(request, header, early, now)
        return self._pushed(request, header, self.state.submit_delta(header, payload, now), now)

    def finish_push(self, now: float, job: PushCheck) -> Effects:
        """Admit a push whose payload was checked off the core (`Effects.checks`).

        The checks that read no payload byte run again (a copy of the push
        may have been accepted since, a step begun, a budget filled): what
        they refuse is refused, a push a step under way would refuse waits
        for it (and is checked again after), and the rest is admitted with
        the checked delta.

        Args:
            now: wall-clock seconds.
            job: the check, run (`PushCheck.run`).

        Returns:
            Its effects: the accepted record and its ack, or a refusal.
        """
        self.checking -= 1
        request, header, payload = job.request, job.header, job.payload
        assert job.result is not None, "finish_push of a check that did not run"
        try:
            if self._waits_for_step(header, payload):
                self._held.append(request)
                return Effects()
            outcome = self.state.precheck_push(header, payload, now)
            if outcome is None:
                outcome = self.state.admit_checked(header, payload, job.result, now)
            return self._pushed(request, header, outcome, now)
        except Exception as exc:  # a bug must not take the shard down; it is counted
            logger.exception("shard %d: error admitting a checked push", self.index)
            outcome = self.state.reject("internal_error", f"{type(exc).__name__}: {exc}")
            return self._answer(request, header, outcome)

    def _pushed(self, request: Request, header: dict, outcome: Outcome, now: float) -> Effects:
        """Book a known island's push outcome (rate, reports) and answer it."""
        self.throttle.pushed(header["island"], outcome.status != REJECTED)
        self.islands.heard(header["island"], header, now)
        if outcome.status == ACCEPTED:
            self.islands.accepted(header["island"], header["round"], now)
        self._check_inner_steps(header["island"], header.get("inner_steps"))
        return self._answer(request, header, outcome)

    def _waits_for_step(self, header: dict, payload) -> bool:
        """Whether to answer a push after the step under way rather than now.

        While a step runs, a push to a fragment in step or due (waiting for the
        step thread) that the island's pending limits (count per fragment, or
        bytes) would refuse now waits for the step: the island's pushes are
        paced by the steps, as they were when a step held the serving loop,
        instead of refused `too_many_pending`. Once no step runs, what is
        still over the limits is refused.
        """
        work = self.stepping
        if work is None:
            return False
        island, fragment = header.get("island"), header.get("fragment")
        frag = self.state.fragments.get(fragment)  # type: ignore[call-overload]
        if frag is None or (fragment != work.fragment and fragment not in self._due):
            return False
        mine = sum(c.island == island for c in frag.pending)
        if mine >= self.cfg.max_pending_per_island:
            return True
        incoming = sum(memoryview(f).nbytes for f in payload)
        budget = self.state.island_budget(incoming, frag.params.shape[0])
        return self.state.pending_bytes(island) + incoming > budget

    def _check_inner_steps(self, island: str, steps: int | None) -> None:
        """Warn once per island whose own H (its push's `inner_steps`) takes other defaults.

        A push's `steps` are not the island's H (merged pushes after a skipped push,
        streaming fragments, a last partial round): without `inner_steps` nothing is said.
        """
        if island not in self._h_warned and (text := self.cfg.inner_steps_mismatch(island, steps)):
            self._h_warned.add(island)
            logger.warning("%s", text)

    def _on_heartbeat(self, request: Request, header: dict, payload, now: float, known: bool):
        if not known:
            refusal = outcomes.unknown_island(header["island"])
            return self._answer(request, header, outcomes.count(self.state.counters, refusal))
        self.islands.heard(header["island"], header, now)
        credited = self.state.counters.credited.get(header["island"], 0.0)
        return self._reply(
            request, header, "heartbeat", shard=self.index, seq=self.seq, credited=credited
        )

    def _on_status(self, request: Request, header: dict, payload, now: float, known: bool):
        status = self.state.status(now)
        status.update(self.checkpoint_report())
        status["seq"] = self.seq
        status["islands"] = self.islands.status()
        status["outer"] = self.cfg.outer_report(self.state.islands_pushing)
        work = self.stepping
        status["stepping"] = None if work is None else {
            "fragment": work.fragment, "since": work.event.at, "merging": len(work.merged_in),
        }  # fmt: skip
        status["endpoints"] = [list(e) for e in self.endpoints]  # the cluster map, without hello
        return self._reply(request, header, "status_reply", status=status)

    def _on_bye(self, request: Request, header: dict, payload, now: float, known: bool):
        if known:  # a bye from a connection that lost the id to another changes nothing
            self.state.bye(header["island"])
            self.bindings.forget(header["island"])
            self.throttle.unbind(header["island"])
        return self._reply(request, header, "bye_ok")

    # ----- time ------------------------------------------------------------------------

    def due_steps(self, now: float) -> list[DueStep]:
        """The outer steps the merge policy says are due now (the loop clears each with storage).

        Args:
            now: wall-clock seconds.

        Returns:
            One DueStep per due fragment, in order; `urgent` when its pending
            deltas near the per-island limit (`pending_near_limit`), so that a
            checkpoint being written does not defer it into `too_many_pending`
            refusals.
        """
        due, _ = self.state.due_fragments(now)
        limit = self.cfg.max_pending_per_island
        self._due = set(due)
        return [DueStep(f, pending_near_limit(self.state, f, limit)) for f in due]

    def on_tick(self, now: float, steps: Sequence[int] | None = None) -> Effects:
        """Take the given outer steps here and now; heartbeat an idle PUB.

        Args:
            now: wall-clock seconds.
            steps: the fragments to step, from `due_steps` (less those a
                checkpoint being written asks to defer to a later turn); None:
                every due fragment.

        Returns:
            The steps' events and updates, or a heartbeat.
        """
        out = Effects()
        if steps is None:
            steps = [due.fragment for due in self.due_steps(now)]
        for fragment in steps:
            work = self.start_step(now, fragment)
            work.run()
            out.extend(self.finish_step(now, work))
        out.extend(self.heartbeat(now, out))
        return out

    def heartbeat(self, now: float, effects: Effects | None = None) -> Effects:
        """A PUB heartbeat when nothing was published for heartbeat_interval_s.

        Every tick of the loop comes here (with or without a step thread), so it
        also forgets the islands idle past island_ttl_s (at most every
        FORGET_EVERY_S).

        Args:
            now: wall-clock seconds.
            effects: the batch so far (a publish in it is a sign of life already).

        Returns:
            The heartbeat's effects, or none.
        """
        self._forget_idle(now)
        if effects is not None and effects.publishes:
            return Effects()
        if now - self._last_pub < self.cfg.heartbeat_interval_s:
            return Effects()
        return Effects(publishes=[Publish({"kind": "heartbeat", "shard": self.index})])

    def start_step(self, now: float, fragment: int) -> StepWork:
        """Begin an outer step: its event and inputs, to be run (`StepWork.run`) then finished.

        Until `finish_step` the fragment's arrays belong to the step (it may run
        in a worker thread): pushes to the fragment are accepted for the next
        step, snapshots of it are answered after it, no checkpoint begins.

        Args:
            now: wall-clock seconds.
            fragment: a due fragment (`due_steps`), cleared with storage.

        Returns:
            The step's work.
        """
        frag = self.state.fragments[fragment]
        self.islands.merged((c.island, frag.version - c.base_version) for c in frag.pending)
        work = self.state.begin_step(fragment, now)
        if not self.state.stepper.downlink.compressed:  # float32: encoded with the step
            encoder = self._raw32_step
            work.then = lambda w: setattr(w, "extra", encoder.encode({"values": w.frag.params})[0])
        self.stepping = work
        return work

    def finish_step(self, now: float, work: StepWork) -> Effects:
        """Book a step that ran: its event to log first, its update to publish after.

        The snapshots held while it ran are answered after it (the pushes that
        waited are `release_held`'s). A step of a state
        since rebuilt from disk (a storage fault meanwhile) is void: its
        deltas are still pending in the rebuilt state.

        Args:
            now: wall-clock seconds.
            work: from `start_step`, run.

        Returns:
            The step's effects, then the held snapshots'.

        Raises:
            BaseException: what the step's arithmetic raised.
        """
        self.stepping = None
        out = Effects()
        if work.owner is self.state:
            update = self.state.finish_step(work)
            if update.frames is None:
                mode, frames = protocol.UPDATE_FULL, list(work.extra)
            else:
                mode, frames = protocol.UPDATE_INCREMENT, list(update.frames)
            header = {
                "kind": "update",
                "shard": self.index,
                "fragment": update.fragment,
                "version": update.version,
                "mode": mode,
                "credited": update.credited,
            }
            out.records.append(work.event)
            out.publishes.append(Publish(header, frames))
        else:
            logger.warning("shard %d: a step of a state rebuilt meanwhile is void", self.index)
        held, self._held_snapshots = self._held_snapshots, []
        for request in held:  # before another step of the fragment can begin
            out.extend(self.handle(now, request))
        return out

    def _forget_idle(self, now: float) -> None:
        """At most every FORGET_EVERY_S: forget islands idle past island_ttl_s, here and in the state."""
        if now < self._forget_at:
            return
        self._forget_at = now + min(FORGET_EVERY_S, self.cfg.island_ttl_s / 4)
        for island in self.state.forget_idle(now):
            self.islands.forget(island)
            self.bindings.forget(island)
            self.throttle.unbind(island)
            self._h_warned.discard(island)

    def release_held(self) -> list[Request]:
        """The pushes held back while a step ran, to handle again (in arrival order).

        Returns:
            The pushes that waited for a step (`_waits_for_step`).
        """
        held, self._held = self._held, []
        return held

    def next_wake(self, now: float) -> float:
        """When to tick next: the merge policy's next wake-up or the next heartbeat.

        Args:
            now: wall-clock seconds.

        Returns:
            Wall-clock seconds (may be <= now: tick at once).
        """
        _, wake = self.state.due_fragments(now)
        heartbeat = self._last_pub + self.cfg.heartbeat_interval_s
        return heartbeat if wake is None else min(wake, heartbeat)

    # ----- durability ----------------------------------------------------------------

    def settle(
        self, effects: Effects, now: float, failure: StorageFailure | None = None
    ) -> list[tuple[bytes | None, list[Any]]]:
        """The messages of a batch once its storage outcome is known, packed and counted.

        Stored (or nothing to store): every reply as answered, durable ones
        rendered now, then the publishes, numbered (`seq`). Not all stored:
        the state is the one rebuilt from disk (the request counters and
        island registry carried over), every `DurableReply` whose event is
        lost (all of them when the sync failed) is a `storage_error` refusal
        (counted) and the updates of lost steps are dropped unpublished; the
        rest is answered as stored.

        Args:
            effects: the batch (none of it sent).
            now: wall-clock seconds.
            failure: why the batch's records are not on disk, with the state
                rebuilt from disk; None when they are (or there were none).

        Returns:
            [(conn, frames)] with conn None for the PUB; the bytes are counted.
        """
        publishes = effects.publishes
        stored = effects.records
        if failure is not None:
            self._adopt(failure.rebuilt)
            publishes = [
                p
                for p in publishes
                if not (p.is_update and failure.lost_step(p.header["fragment"]))
            ]
            stored = [] if failure.lost is None else [
                e for e in stored if not failure.lost_event(e)
            ]  # fmt: skip
        self.checkpoints.stored(len(stored), sum(isinstance(e, StepEvent) for e in stored))
        messages: list[tuple[bytes | None, list[Any]]] = []
        for reply in effects.replies:
            header, payload = self._rendered(reply, failure)
            messages.append((reply.conn, [*reply.envelope, *protocol.pack(header, payload)]))
        for publish in publishes:
            if publish.is_update:
                self.seq += 1
            header = {**publish.header, "seq": self.seq}
            messages.append((None, protocol.pack(header, publish.payload)))
            self._last_pub = now
        self.state.counters.bytes_out += sum(protocol.message_bytes(f) for _, f in messages)
        return messages

    def _adopt(self, rebuilt: ShardState) -> None:
        """Serve from a state rebuilt from disk, keeping what is bookkeeping, not events."""
        old = self.state
        rebuilt.last_seen, rebuilt.paces = old.last_seen, old.paces
        rebuilt.heard_at = old.heard_at
        for name in _REQUEST_COUNTERS:
            setattr(rebuilt.counters, name, getattr(old.counters, name))
        self.state = rebuilt

    def _rendered(
        self, reply: Reply | DurableReply, failure: StorageFailure | None
    ) -> tuple[dict[str, Any], list[Any]]:
        """A reply's header and payload, given the batch's storage outcome."""
        if isinstance(reply, Reply):
            return reply.header, reply.payload
        if failure is not None and failure.lost_event(reply.event, reply.request):
            refusal = self.state.reject(
                "storage_error", f"{failure.error}: not durable; send it again"
            )
            version = self.state.version_of(reply.request.get("fragment"))
            return outcomes.render(reply.request, refusal, version), []
        if reply.outcome is not None:
            return outcomes.render(reply.request, reply.outcome, reply.version), []
        return protocol.reply_header(reply.request, reply.kind, **reply.fields), []

    @property
    def unsaved(self) -> bool:
        """Whether durable events happened since the last checkpoint."""
        return self.checkpoints.unsaved

    def checkpoint_due(self, now: float) -> bool:
        """Whether to begin a checkpoint now (`CheckpointSchedule.due`)."""
        return self.checkpoints.due(now, self.stepping is not None, self.state.initialized)

    def checkpoint_started(self, now: float) -> None:
        """Record that a checkpoint of the state as it is now is being written."""
        self.checkpoints.started()

    def checkpoint_done(
        self, now: float, written: bool, summary: dict[str, Any] | None = None, error: str = ""
    ) -> None:
        """Record the end of a checkpoint attempt (`CheckpointSchedule.done`)."""
        self.checkpoints.done(now, written, summary, error)

    def checkpoint_report(self) -> dict[str, Any]:
        """The checkpoint fields of status (`CheckpointSchedule.report`)."""
        return self.checkpoints.report()


def pending_near_limit(state: ShardState, fragment: int, per_island: int) -> bool:
    """Whether some island has at least half its pending limit waiting on a fragment.

    A step deferred further would soon make that island's pushes fail
    `too_many_pending`, so the checkpoint copies the fragment instead.

    Args:
        state: the shard's state.
        fragment: the fragment about to be stepped.
        per_island: the shard's max_pending_per_island.

    Returns:
        True when an island has >= per_island / 2 deltas pending on it.
    """
    counts = Counter(c.island for c in state.fragments[fragment].pending)
    return 2 * max(counts.values(), default=0) >= per_island
