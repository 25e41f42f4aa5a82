"""The client's one ledger of pending deltas: which to send, keep, re-send or forget.

This module owns the island side's delivery rules for pushed deltas. `Ledger`
holds every delta pushed and not yet resolved, keyed (fragment, round): it is
the only record of "pending" (back-pressure counts its length). Its methods
take the time (`now`, monotonic seconds) and the shards' answers as arguments
and return what to do, so the rules are unit-tested without a network. The
client's core (`paramserver.client.core`) sends what the ledger names and
reports back with `sent` / `blocked`; `drop_all` hands what is left at close
back as the `PushRequest`s pushed (`Client.unacked`), `StorageWarning` rate-
limits the warning about a shard whose disk refuses deltas, and `AckTimer`
(below) is the adaptive re-send timeout.

The rules:
- a delta is kept, with its frames, until its shard resolves it;
- unacked, it is re-sent after the adaptive ack timeout (`due`): the
  ledger's `AckTimer` (TCP's RFC 6298 timer, below) starts
  at `ack_timeout_s`, learns from the latency of every delta acked after its
  only send (Karn's rule: `on_ack` takes the time), stays within
  [floor, `ack_timeout_cap_s`], and doubles per attempt and after a timeout;
  as TCP's, it restarts on every ack of its shard (`ack_due`), so deltas queued
  behind others at a busy shard that keeps answering are not re-sent, while
  one the shard passed over (it acked a later send on the same connection
  first: acks keep send order per connection, not across an island's
  several bulk connections) counts from its send;
  deltas of a shard that is down wait for it;
- a re-send turns out needless ("spurious", `spurious`) when the shard answers
  `duplicate` to a copy of a delta that went out more than once; the timer then
  learns the latency of the first copy (RFC 4015), which Karn's rule had left out;
- an ack `accepted` or `duplicate` resolves it ("done"), and so does a
  rejection, which is final (plan_mismatch, replayed_round,
  future_base_version, bad_shape, ...), except that:
  - `unknown_island` (the shard forgot this island): it stays pending and the
    island says hello again ("rejoin"); the welcome re-sends every delta of
    that shard (`on_rejoin`);
  - a reason in `RETRYABLE_REASONS` (the shard's buffer for this island is
    full, or it could not write its log: `storage_error`, nothing was kept):
    it stays pending, deferred ("defer"), and is re-sent when its fragment
    steps (`on_step`) or on the ack back-off, whichever comes first (the
    back-off doubles, so a shard with a broken disk is not hammered);
  - `codec_error` (corrupted in transit, as this client keeps frames intact):
    re-sent at once ("resend"), up to `DECODE_RETRIES` times, then final;
  - `throttled` (the island sent more requests than the shard's rate limit
    while others waited): it stays pending, deferred ("defer"), and is re-sent
    once the ack's `retry_after_s` has passed (`due`; `THROTTLED_RETRY_S`
    when the ack did not say), not when its fragment steps. Like the others
    kept, it is not lost work: the round is merged once a re-send gets in.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Container
from dataclasses import dataclass, replace
from typing import Any, Literal

from paramserver.client.types import PushRequest
from paramserver.wire.protocol import DUPLICATE, REJECTED

logger = logging.getLogger(__name__)

Key = tuple[int, int]
"""(fragment, round): with the island, the idempotency key of a delta."""

Decision = Literal["done", "resend", "defer", "rejoin"]
"""What to do after an ack: forget the delta (resolved), send it again now, keep it
until its fragment steps, or keep it and say hello to the shard again."""

STORAGE_WARNING_EVERY_S = 60.0  # one warning per shard per minute while its disk fails
_MAX_RESENT_KEPT = 1024  # re-sent deltas whose first copy's latency waits for a duplicate

RETRYABLE_REASONS = frozenset({"too_many_pending", "storage_error", "throttled"})
"""Rejections that say "not now" rather than "never": the delta is kept and re-sent."""

THROTTLED_RETRY_S = 1.0
"""Wait before re-sending a `throttled` delta whose ack carried no `retry_after_s`."""

DECODE_RETRIES = 3
"""A push the shard could not decode (codec_error) was corrupted in transit, since this
client keeps its frames intact: it is re-sent at once, up to this many times, before the
rejection is final."""


@dataclass
class Entry:
    """One unacked delta: kept, with its packed message, until its shard resolves it."""

    request: PushRequest  # the delta as `push` took it (`unacked` hands it back)
    shard: int
    frames: list[Any]  # its packed push message, re-sent as is
    nbytes: int
    queued_at: float  # when `push` handed it over (ack latency is measured from here)
    sent_at: float  # last send, or last try of one (the back-off counts from here)
    attempt: int = 0  # back-off re-sends so far
    sends: int = 0  # sends that went out
    first_sent_at: float | None = None  # the first send that went out
    decode_retries: int = 0  # re-sends after the shard could not decode it (codec_error)
    deferred: bool = False  # refused for now (RETRYABLE_REASONS): re-sent when its fragment steps
    retry_at: float | None = None  # throttled: re-sent at this time (`due`), not on a step
    flow: int = 0  # the connection (link) of its last send: acks keep send order per flow


class Ledger:
    """The pending deltas of one client, in the order they were pushed."""

    def __init__(
        self,
        ack_timeout_s: float,
        ack_timeout_cap_s: float,
        ack_timeout_floor_s: float | None = None,
    ) -> None:
        """Create an empty ledger.

        Args:
            ack_timeout_s: wait for an ack before the first re-send, until the
                first latency sample, > 0.
            ack_timeout_cap_s: upper bound of every wait, >= ack_timeout_s.
            ack_timeout_floor_s: lower bound of the measured wait, > 0; never above
                ack_timeout_s (a smaller ack_timeout_s lowers it). None: ack_timeout_s.
        """
        floor = ack_timeout_s if ack_timeout_floor_s is None else ack_timeout_floor_s
        self.timer = AckTimer(ack_timeout_s, min(floor, ack_timeout_s), ack_timeout_cap_s)
        self._entries: dict[Key, Entry] = {}
        # per shard: when its last ack of a pending delta came (TCP restarts its timer on an
        # ack of new data, RFC 6298 5.3): a shard that keeps answering is working through
        # what we sent, and its queue is not a lost delta (`ack_due`)
        self._acked_at: dict[int, float] = {}
        # per (shard, flow): the latest send among the deltas it acked accepted / duplicate;
        # a delta sent before it on that flow and still unacked was passed over (dropped)
        self._acked_sent: dict[tuple[int, int], float] = {}
        self._stepped_at: dict[int, float] = {}  # per fragment: its last published step
        # re-sent deltas resolved by an ack `accepted`: the latency of their first copy,
        # kept until a `duplicate` proves the re-send needless (bounded, oldest dropped)
        self._resent_latency: dict[Key, float] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def floor(self, round_id: int) -> int:
        """The push `floor` of a new delta of round `round_id`: the lowest round still unacked.

        Args:
            round_id: the new delta's round.

        Returns:
            min(round_id, the round of every delta kept here).
        """
        return min((r for _, r in self._entries), default=round_id)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: Key) -> Entry | None:
        """The pending delta under `key`, or None (never pushed, or already resolved)."""
        return self._entries.get(key)

    def add(
        self, key: Key, shard: int, frames: list[Any], nbytes: int, now: float,
        request: PushRequest,
    ) -> bool:  # fmt: skip
        """Keep a newly pushed delta (not sent yet: send it, then call `sent`).

        Args:
            key: (fragment, round).
            shard: the shard that owns the fragment.
            frames: the packed message, re-sent as is.
            nbytes: its size on the wire.
            now: when it was pushed.
            request: the delta itself (what `drop_all` hands back).

        Returns:
            False, leaving the ledger as it was, when that round of the fragment
            is still pending (the new push is to be ignored).
        """
        if key in self._entries:
            return False
        self._entries[key] = Entry(request, shard, frames, nbytes, queued_at=now, sent_at=now)
        return True

    def sent(self, key: Key, now: float, flow: int = 0) -> bool:
        """Record a send that went out.

        Args:
            key: a pending delta.
            now: when it was sent.
            flow: the connection it went on (one of its shard's links).

        Returns:
            Whether it was a re-send (the delta had gone out before).
        """
        entry = self._entries[key]
        resend = entry.sends > 0
        if not resend:
            entry.first_sent_at = now
        entry.sends += 1
        entry.sent_at, entry.flow = now, flow
        return resend

    def blocked(self, key: Key, now: float) -> None:
        """Record a send that could not go out (the socket's queue was full).

        The delta is tried again after the back-off, as if it had been sent.

        Args:
            key: a pending delta.
            now: when the send was tried.
        """
        self._entries[key].sent_at = now

    def on_ack(
        self,
        key: Key,
        outcome: str,
        reason: str | None,
        now: float,
        retry_after_s: float | None = None,
    ) -> Decision:
        """Apply a shard's ack of a pending delta (see the module docstring for the rules).

        Args:
            key: a pending delta (check with `in` first: the ack of a re-send whose
                first copy was already acked is to be ignored).
            outcome: "accepted", "duplicate" or "rejected".
            reason: the rejection reason, or None.
            now: when the ack arrived; if the delta went out once and never
                timed out, now - its send is a latency sample for the timer.
            retry_after_s: the ack's `retry_after_s` (a `throttled` refusal), if any.

        Returns:
            "done": resolved and removed (accepted, duplicate, or finally rejected);
            "resend": kept, send it again now; "defer": kept until its fragment
            steps (`on_step`) or the back-off (`due`); "rejoin": kept, say hello
            to the shard (its welcome re-sends, `on_rejoin`).

        Raises:
            KeyError: `key` is not pending.
        """
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"delta {key} is not pending; check `key in ledger` before on_ack")
        if entry.sends == 1 and entry.attempt == 0 and reason != "throttled":
            self.timer = self.timer.sample(now - entry.sent_at)  # Karn: it answers the only copy
        self._acked_at[entry.shard] = now  # the shard answers: its timer restarts
        if outcome != REJECTED and entry.sends == 1:  # durable acks come in send order;
            # (Karn: the ack of a delta sent more than once may answer any copy)
            flow = (entry.shard, entry.flow)
            self._acked_sent[flow] = max(self._acked_sent.get(flow, entry.sent_at), entry.sent_at)
        if outcome == REJECTED:
            if reason == "unknown_island":
                return "rejoin"
            if reason == "throttled":
                wait = THROTTLED_RETRY_S if retry_after_s is None else retry_after_s
                entry.deferred, entry.retry_at = True, now + wait
                return "defer"
            if reason in RETRYABLE_REASONS:
                entry.deferred = True
                return "defer"
            if reason == "codec_error" and entry.decode_retries < DECODE_RETRIES:
                entry.decode_retries += 1
                return "resend"
        del self._entries[key]
        if entry.sends > 1 and outcome != REJECTED and entry.first_sent_at is not None:
            self._resent_latency[key] = now - entry.first_sent_at  # the first ack back
            if len(self._resent_latency) > _MAX_RESENT_KEPT:
                del self._resent_latency[next(iter(self._resent_latency))]
        return "done"

    def due(self, now: float, up: Container[int]) -> list[Key]:
        """The deltas whose ack is overdue, to send again now; each one's attempt is counted.

        Args:
            now: current time.
            up: the shards that are up (deltas of the others wait for `on_rejoin`).

        Returns:
            Keys, in push order, of the deltas that `ack_due` names (last sent, or
            tried, and last heard of their shard at least `timer.timeout_s(attempt)`
            ago, as the timer stood before this call), and of the throttled ones whose `retry_at` has come (no attempt
            counted: they are due again, not late). Deferred deltas are included
            and stay deferred. The timeout of a delta that was not deferred (its
            ack is late) backs the timer off.
        """
        keys = []
        timer = self.timer
        for key, entry in self._entries.items():
            if entry.shard not in up:
                continue
            if entry.retry_at is not None:
                if now >= entry.retry_at:
                    entry.retry_at, entry.deferred = None, False
                    keys.append(key)
                continue
            acked_at = self._acked_at.get(entry.shard, self._stepped_at.get(key[0]))
            passed = self._acked_sent.get((entry.shard, entry.flow), -math.inf) > entry.sent_at
            if entry.deferred or passed:
                acked_at = None  # refused for now, or passed over: it counts from its send
            if ack_due(now, entry.sent_at, acked_at, timer.timeout_s(entry.attempt), timer.cap_s):
                if not entry.deferred:
                    self.timer = self.timer.timed_out(entry.attempt)
                entry.attempt += 1
                keys.append(key)
        return keys

    def spurious(self, key: Key, outcome: str) -> bool:
        """Whether an ack shows that a re-send of `key` was needless; if so, adapt the timer.

        Call it for every ack, before `on_ack`. The shard answers `duplicate` to
        a copy when an earlier copy was accepted: so an ack `duplicate` of a
        delta that went out more than once, or of one already resolved here
        (the answer to an extra copy), counts one re-send that was not needed.
        In the latter case the acks came back in order on the one connection, so
        the ack that resolved the delta answered its first copy: its latency
        feeds the timer (`AckTimer.spurious`).

        Args:
            key: (fragment, round) of the ack.
            outcome: the ack's outcome.

        Returns:
            True for one needless re-send.
        """
        if outcome != DUPLICATE:
            return False
        entry = self._entries.get(key)
        if entry is not None:
            return entry.sends > 1
        latency = self._resent_latency.pop(key, None)
        if latency is not None:
            self.timer = self.timer.spurious(latency)
        return True

    def on_step(self, fragment: int, now: float | None = None) -> list[Key]:
        """A fragment stepped, so its shard has room again: its deferred deltas, to send now.

        Until its shard first acks one of ours, the step also restarts the ack timer
        of the fragment's deltas (`due`): at a cold start behind other islands' deltas,
        the shard shows it works through its queue before our first ack comes.

        Args:
            fragment: the fragment a published update named.
            now: when the update arrived (None: no timer restart).

        Returns:
            Keys, in push order, of the deltas of `fragment` that were deferred
            (they are not deferred any more), throttled ones excepted: a step
            does not lift a rate limit, they wait for their `retry_at`.
        """
        if now is not None:
            self._stepped_at[fragment] = now
        keys = []
        for key, entry in self._entries.items():
            if entry.deferred and entry.retry_at is None and key[0] == fragment:
                entry.deferred = False
                keys.append(key)
        return keys

    def on_rejoin(self, shard: int) -> list[Key]:
        """A shard welcomed this island again (after a reconnect or `unknown_island`).

        Args:
            shard: the shard's index.

        Returns:
            Keys, in push order, of every delta of that shard, to send now
            (back-off and deferral unchanged).
        """
        return [key for key, entry in self._entries.items() if entry.shard == shard]

    def shards(self) -> set[int]:
        """The shards that hold at least one pending delta.

        Returns:
            Shard indices (empty when nothing is pending).
        """
        return {entry.shard for entry in self._entries.values()}

    def drop_all(self) -> list[PushRequest]:
        """Forget every pending delta (the client closes).

        Returns:
            Each delta dropped unacked, as pushed but with its frames copied to bytes,
            in push order (so that the caller can keep them elsewhere, e.g. in a file).
        """
        dropped = [
            replace(e.request, frames=[memoryview(f).tobytes() for f in e.request.frames])
            for e in self._entries.values()
        ]
        self._entries.clear()
        return dropped


class StorageWarning:
    """Logs a shard's `storage_error` refusals at most once per `STORAGE_WARNING_EVERY_S`."""

    def __init__(self) -> None:
        """Start with no warning given."""
        self._last: dict[int, float] = {}

    def note(self, shard: int, ack: dict, now: float) -> bool:
        """Look at an ack that kept its delta for later; warn if it says storage_error.

        Args:
            shard: the shard's index.
            ack: the ack header (reason, detail).
            now: monotonic time.

        Returns:
            Whether a warning was logged.
        """
        if ack.get("reason") != "storage_error":
            return False
        last = self._last.get(shard)
        if last is not None and now - last < STORAGE_WARNING_EVERY_S:
            return False
        self._last[shard] = now
        logger.warning(
            "shard %d cannot store deltas (storage_error: %s); they are kept and re-sent "
            "after the back-off",
            shard,
            ack.get("detail", "no detail"),
        )
        return True


# -- the adaptive ack timeout ------------------------------------------------------------

ALPHA = 1 / 8  # gain of the smoothed latency
BETA = 1 / 4  # gain of the latency's mean deviation
K = 4  # deviations added to the smoothed latency


def ack_due(
    now: float, sent_at: float, acked_at: float | None, timeout_s: float, cap_s: float
) -> bool:
    """Whether a delta's ack is overdue, so that it is sent again (TCP's timer, per shard).

    The wait counts from the later of the delta's last send and its shard's last
    ack of one of this client's deltas (RFC 6298 5.3 restarts the timer on each
    ack): while a shard answers, the deltas queued behind wait their turn in its
    queue, so a long queue (many islands, a starved shard) is not mistaken for a
    lost delta. The caller passes no ack time for a delta the shard passed over
    (it acked a delta sent later; its accepted / duplicate acks come in send
    order), which then counts from its send; and any delta is re-sent once it
    waited `cap_s` since its send.

    Args:
        now: current time.
        sent_at: the delta's last send (or try of one).
        acked_at: its shard's last ack, or None (none yet; or the delta is
            deferred, refused for now, or was passed over: it counts from its send).
        timeout_s: the timer's timeout for the delta (`AckTimer.timeout_s`).
        cap_s: the longest wait from its send (`AckTimer.cap_s`).

    Returns:
        True when `now - max(sent_at, acked_at) >= timeout_s`, or when
        `now - sent_at >= cap_s`.
    """
    since = sent_at if acked_at is None else max(sent_at, acked_at)
    return now - since >= timeout_s or now - sent_at >= cap_s


def smoothed(srtt: float | None, rttvar: float | None, sample: float) -> tuple[float, float]:
    """RFC 6298's estimators after one more latency sample.

    Args:
        srtt: smoothed latency so far (None before the first sample).
        rttvar: its mean deviation so far (None before the first sample).
        sample: a measured latency, seconds, >= 0.

    Returns:
        (SRTT, RTTVAR) after the sample.
    """
    if srtt is None or rttvar is None:
        return sample, sample / 2
    rttvar = (1 - BETA) * rttvar + BETA * abs(srtt - sample)
    return (1 - ALPHA) * srtt + ALPHA * sample, rttvar


@dataclass(frozen=True)
class AckTimer:
    """The ack timeout of one client: estimates from its samples, and its back-off."""

    initial_s: float  # the timeout before any sample (ClientConfig.ack_timeout_s)
    floor_s: float  # lower bound of the measured timeout
    cap_s: float  # upper bound of every timeout, >= initial_s and floor_s
    srtt_s: float | None = None  # smoothed ack latency; None before the first sample
    rttvar_s: float | None = None  # mean deviation of the ack latency
    backoff: int = 0  # timeouts in a row of one delta since the last valid sample

    def __post_init__(self) -> None:
        for name in ("initial_s", "floor_s", "cap_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"AckTimer.{name}={value!r}: must be a number > 0")
        if self.cap_s < max(self.initial_s, self.floor_s):
            raise ValueError(
                f"AckTimer.cap_s={self.cap_s!r}: must be >= initial_s={self.initial_s} "
                f"and floor_s={self.floor_s}"
            )

    @property
    def base_s(self) -> float:
        """The timeout of a delta sent once, before back-off (seconds)."""
        if self.srtt_s is None or self.rttvar_s is None:
            return self.initial_s
        return min(self.cap_s, max(self.floor_s, self.srtt_s + K * self.rttvar_s))

    def timeout_s(self, attempt: int = 0) -> float:
        """How long to wait for the ack of a delta re-sent `attempt` times so far.

        Args:
            attempt: back-off re-sends of the delta so far, >= 0.

        Returns:
            min(cap_s, base_s * 2**max(attempt, backoff)).
        """
        doublings = max(attempt, self.backoff)
        if doublings >= math.log2(self.cap_s / self.base_s) + 1:  # no float overflow
            return self.cap_s
        return min(self.cap_s, self.base_s * 2.0**doublings)

    def sample(self, latency_s: float) -> AckTimer:
        """The timer after a valid sample (a delta acked after its only send).

        Args:
            latency_s: seconds from that send to its ack (negative counts as 0).

        Returns:
            A timer with updated estimates and no back-off.
        """
        srtt, rttvar = smoothed(self.srtt_s, self.rttvar_s, max(0.0, float(latency_s)))
        return replace(self, srtt_s=srtt, rttvar_s=rttvar, backoff=0)

    def spurious(self, latency_s: float) -> AckTimer:
        """The timer after a re-send proved needless (RFC 4015's response to a spurious timeout).

        Args:
            latency_s: seconds from the first send of the delta to its first ack
                (which answered that first copy).

        Returns:
            A timer whose estimates are at least that latency (and half of it as
            deviation), with no back-off.
        """
        latency = max(0.0, float(latency_s))
        if self.srtt_s is None or self.rttvar_s is None:
            return self.sample(latency)
        srtt, rttvar = max(self.srtt_s, latency), max(self.rttvar_s, latency / 2)
        return replace(self, srtt_s=srtt, rttvar_s=rttvar, backoff=0)

    def timed_out(self, attempt: int) -> AckTimer:
        """The timer after a delta's ack did not come in time (it is re-sent).

        Args:
            attempt: the delta's back-off re-sends before this one, >= 0.

        Returns:
            A timer backed off to at least attempt + 1 doublings (many deltas
            timing out together back it off once, not once each).
        """
        return replace(self, backoff=max(self.backoff, attempt + 1))
