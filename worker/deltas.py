"""The island's ledger of deltas: one record per pushed delta, from its take to its fate.

A delta gets its record when `Session.step` takes it (round, fragment, base
version, tokens, steps, and the inner-step seconds it carries for goodput),
its payload when the push thread frames it (`framed`: the `PushRequest`, kept
until its fate is known), and its fate from the client: the session installs
`DeltaLedger.on_outcome` as the client's outcome listener
(`Client.watch_outcomes`), which the client's I/O thread calls when a delta is
acked, refused or merged (a version that includes it reached the client's
replica). Waits sleep on the ledger's Condition, which that listener
notifies: nobody polls outcomes.

What the rest of the island derives from the records, rather than keeping its own:
- goodput (`worker.goodput.RoundClock` reads `useful_s`, `lost_s`,
  `in_flight_s`): a delta's seconds move to useful when it merges, to lost when
  it is refused (`settle_final` at close: acked counts as merged, pending as lost);
- the outbox (`worker.outbox`): `take_resolved` names the deltas whose fate
  became known since the last batch, so their records are marked resolved in
  the file;
- the session: a fragment's newest push and its outcome (quorum's skip,
  `newest_outcomes`), whether a round is merged (sync mode, `round_done`),
  whether a previous run's re-sent deltas are resolved (`resent_pending`), and
  the persisted deltas never handed to the client (`unhanded`, kept at close).

A record is forgotten once its fate is final (merged or refused): the ledger
holds only pending and acked-unmerged deltas (at most `max_unacked` plus the
batches in flight, plus what a shard accepted and has not merged), and the
newest record of each fragment. Every method is thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from paramserver.client import PushRequest

MERGED, ACKED, REJECTED, PENDING = "merged", "acked", "rejected", "pending"
"""What became of one pushed delta, as the client reports it (`Client.watch_outcomes`)."""

Key = tuple[int, int]
"""(round, fragment): with the island id, the shards' idempotency key of a delta."""

_WAIT_SLICE_S = 0.05  # waits sleep in slices this long (Ctrl-C reaches a waiting main thread)


@dataclass
class Delta:
    """One pushed delta of this island (see the module docstring).

    Attributes:
        round: its round id.
        fragment: its fragment.
        base_version: the fragment version it was taken against.
        tokens: tokens it carries.
        steps: inner steps it carries.
        work_s: inner-step seconds it carries (goodput); 0 for a previous run's delta.
        request: its payload, from `framed` until its fate is known (then None).
        handed: whether it was handed to the client.
        outcome: PENDING, ACKED, MERGED or REJECTED.
        resent: a previous run's delta, pushed again at the start.
    """

    round: int
    fragment: int
    base_version: int
    tokens: int
    steps: int
    work_s: float = 0.0
    request: PushRequest | None = None
    handed: bool = False
    outcome: str = PENDING
    resent: bool = False


class DeltaLedger:
    """Every pushed delta whose fate is not final yet, keyed (round, fragment)."""

    def __init__(self, outbox: bool = False) -> None:
        """Start empty.

        Args:
            outbox: queue the keys of resolved deltas for `take_resolved` (an island
                with an outbox file; without one nothing would take them).
        """
        self._cond = threading.Condition()
        self._deltas: dict[Key, Delta] = {}
        self._newest: dict[int, Delta] = {}  # fragment -> its newest delta (even once forgotten)
        self._resolved: list[Key] | None = [] if outbox else None
        self._closed = False
        self.useful_s = 0.0  # seconds of deltas that entered the model
        self.lost_s = 0.0  # seconds of deltas refused (or left unacked at close)
        self._in_flight_s = 0.0  # seconds of deltas not settled yet

    def __len__(self) -> int:
        with self._cond:
            return len(self._deltas)

    # -- written by the session and the push thread ----------------------------------

    def taken(self, round: int, fragment: int, base_version: int, tokens: int, steps: int,
              work_s: float) -> None:  # fmt: skip
        """A delta was taken (before anything of it is framed, persisted or pushed).

        Args:
            round: its round id.
            fragment: its fragment.
            base_version: the version it was taken against.
            tokens: tokens it carries.
            steps: inner steps it carries.
            work_s: inner-step seconds it carries (goodput).
        """
        delta = Delta(round, fragment, base_version, tokens, steps, work_s)
        with self._cond:
            old = self._deltas.get((round, fragment))
            if old is not None:  # the same key again (never on the session's path): one record
                delta.work_s += old.work_s
                self._in_flight_s -= old.work_s
            self._deltas[(round, fragment)] = delta
            self._newest[fragment] = delta
            self._in_flight_s += delta.work_s

    def resent(self, requests: Iterable[PushRequest]) -> list[Key]:
        """A previous run's deltas are pushed again (their seconds counted in that run).

        Args:
            requests: the deltas the outbox file kept.

        Returns:
            Their keys.
        """
        keys = []
        with self._cond:
            for r in requests:
                key = (r.round, r.fragment)
                self._deltas[key] = Delta(r.round, r.fragment, r.base_version, r.tokens, r.steps,
                                          request=r, handed=True, resent=True)  # fmt: skip
                keys.append(key)
        return keys

    def framed(self, round: int, frames: Mapping[int, Sequence[Any]],
               fragments: Iterable[int]) -> list[PushRequest]:  # fmt: skip
        """The push thread framed deltas of `round`: their requests, kept until their fate is known.

        Args:
            round: their round id.
            frames: fragment -> its delta's codec frames.
            fragments: the fragments, in push order (each taken with `taken`).

        Returns:
            One `PushRequest` per fragment, from its record's fields.
        """
        out = []
        with self._cond:
            for f in fragments:
                d = self._deltas[(round, f)]
                d.request = PushRequest(f, round, d.base_version, d.tokens, d.steps,
                                        list(frames[f]))  # fmt: skip
                out.append(d.request)
        return out

    def handed(self, request: PushRequest) -> None:
        """The delta was handed to the client (it keeps and re-sends it from now on)."""
        with self._cond:
            delta = self._deltas.get((request.round, request.fragment))
            if delta is not None:
                delta.handed = True

    # -- written by the client's I/O thread ------------------------------------------

    def on_outcome(self, round: int, fragment: int, outcome: str) -> None:
        """The client's outcome listener: a delta was acked, refused or merged.

        Runs on the client's I/O thread, under the client's lock: it never calls the client.

        Args:
            round: the delta's round id.
            fragment: its fragment.
            outcome: ACKED, MERGED or REJECTED.
        """
        with self._cond:
            delta = self._deltas.get((round, fragment))
            if delta is None or delta.outcome in (MERGED, REJECTED):
                return
            if delta.outcome == PENDING and self._resolved is not None:
                self._resolved.append((round, fragment))  # the outbox marks it resolved
            delta.outcome, delta.request = outcome, None
            if outcome in (MERGED, REJECTED):
                del self._deltas[(round, fragment)]
                self._in_flight_s -= delta.work_s
                if outcome == MERGED:
                    self.useful_s += delta.work_s
                else:
                    self.lost_s += delta.work_s
            self._cond.notify_all()

    # -- read by the session, the goodput clock and the outbox -------------------------

    @property
    def in_flight_s(self) -> float:
        """Seconds carried by deltas whose fate is not final yet (left out of goodput)."""
        with self._cond:
            return max(0.0, self._in_flight_s)

    def take_resolved(self) -> list[Key]:
        """The keys of deltas acked or refused since the last call (for the outbox's file)."""
        with self._cond:
            if not self._resolved:
                return []
            out, self._resolved = self._resolved, []
            return out

    def newest_outcomes(self, fragments: Iterable[int]) -> tuple[dict[int, int], dict[Key, str]]:
        """Each fragment's newest push and its outcome (quorum's skip, `push_thread.unblocked`).

        Args:
            fragments: the fragments asked about.

        Returns:
            (fragment -> round id of its newest push, (round, fragment) -> its outcome),
            for the fragments pushed at least once.
        """
        with self._cond:
            newest = {f: self._newest[f] for f in fragments if f in self._newest}
            return (
                {f: d.round for f, d in newest.items()},
                {(d.round, f): d.outcome for f, d in newest.items()},
            )

    def round_done(self, round: int) -> bool:
        """Whether every delta of `round` is merged or refused (none of it is pending or acked)."""
        with self._cond:
            return not any(r == round for r, _ in self._deltas)

    def resent_pending(self) -> int:
        """How many of a previous run's re-sent deltas are not acked or refused yet."""
        with self._cond:
            return sum(1 for d in self._deltas.values() if d.resent and d.outcome == PENDING)

    def unhanded(self) -> list[PushRequest]:
        """The framed deltas never handed to the client, in push order (kept at close)."""
        with self._cond:
            return [d.request for d in self._deltas.values() if d.request and not d.handed]

    def wait(self, done: Callable[[], bool], give_up: Callable[[], bool],
             timeout_s: float | None = None) -> bool:  # fmt: skip
        """Sleep on the ledger's Condition (woken by each outcome) until `done()`.

        Args:
            done: the condition waited for (called without the ledger's lock held).
            give_up: ends the wait when it returns True (stop, close, a failure).
            timeout_s: the longest wait (None: no limit but `give_up` and `close`).

        Returns:
            True once `done()`; False when `give_up`, `close` or the timeout came first.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not done():
            if give_up() or self._closed:
                return False
            left = (
                _WAIT_SLICE_S
                if deadline is None
                else min(_WAIT_SLICE_S, deadline - time.monotonic())
            )
            if left <= 0:
                return False
            with self._cond:
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """End every wait (the session closes or is abandoned)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def settle_final(self) -> None:
        """The session closed: acked deltas count as merged, the others as lost.

        An acked delta is held durably by its shard, which merges it at its next step.
        The records stay (`unhanded` still names what the outbox kept).
        """
        with self._cond:
            for delta in self._deltas.values():
                if delta.outcome == ACKED:
                    self.useful_s += delta.work_s
                else:
                    self.lost_s += delta.work_s
                delta.work_s = 0.0
            self._in_flight_s = 0.0
            self._cond.notify_all()
