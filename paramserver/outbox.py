"""The client's outbox: which unacked deltas to send, keep, re-send or forget, with no sockets.

This module owns the island side's delivery rules for pushed deltas. `Outbox`
is a ledger of pending deltas keyed (fragment, round); its methods take the
time (`now`, monotonic seconds) and the shards' answers as arguments and
return what to do, so the rules are unit-tested without a network. The I/O
thread (`paramserver.client_io`) keeps the sockets, sends what the ledger
names, and reports back with `sent` / `blocked`.

The rules:
- a delta is kept, with its frames, until its shard resolves it;
- unacked, it is re-sent after `ack_timeout_s`, doubling per attempt up to
  `ack_timeout_cap_s` (`due`); deltas of a shard that is down wait for it;
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
    re-sent at once ("resend"), up to `DECODE_RETRIES` times, then final.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import Any, Literal

from paramserver.liveness import resend_due
from paramserver.protocol import REJECTED

Key = tuple[int, int]
"""(fragment, round): with the island, the idempotency key of a delta."""

Decision = Literal["done", "resend", "defer", "rejoin"]
"""What to do after an ack: forget the delta (resolved), send it again now, keep it
until its fragment steps, or keep it and say hello to the shard again."""

RETRYABLE_REASONS = frozenset({"too_many_pending", "storage_error"})
"""Rejections that say "not now" rather than "never": the delta is kept and re-sent."""

DECODE_RETRIES = 3
"""A push the shard could not decode (codec_error) was corrupted in transit, since this
client keeps its frames intact: it is re-sent at once, up to this many times, before the
rejection is final."""


@dataclass
class Entry:
    """One unacked delta: kept, with its frames, until its shard resolves it."""

    shard: int
    frames: list[Any]
    nbytes: int
    queued_at: float  # when `push` handed it over (ack latency is measured from here)
    sent_at: float  # last send, or last try of one (the back-off counts from here)
    attempt: int = 0  # back-off re-sends so far
    sends: int = 0  # sends that went out
    decode_retries: int = 0  # re-sends after the shard could not decode it (codec_error)
    deferred: bool = False  # refused for now (RETRYABLE_REASONS): re-sent when its fragment steps


class Outbox:
    """The pending deltas of one client, in the order they were pushed."""

    def __init__(self, ack_timeout_s: float, ack_timeout_cap_s: float) -> None:
        """Create an empty ledger.

        Args:
            ack_timeout_s: wait for an ack before the first re-send, > 0.
            ack_timeout_cap_s: upper bound of the doubling wait, >= ack_timeout_s.
        """
        self.ack_timeout_s = ack_timeout_s
        self.ack_timeout_cap_s = ack_timeout_cap_s
        self._entries: dict[Key, Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: Key) -> Entry | None:
        """The pending delta under `key`, or None (never pushed, or already resolved)."""
        return self._entries.get(key)

    def add(self, key: Key, shard: int, frames: list[Any], nbytes: int, now: float) -> bool:
        """Keep a newly pushed delta (not sent yet: send it, then call `sent`).

        Args:
            key: (fragment, round).
            shard: the shard that owns the fragment.
            frames: the packed message, re-sent as is.
            nbytes: its size on the wire.
            now: when it was pushed.

        Returns:
            False, leaving the ledger as it was, when that round of the fragment
            is still pending (the new push is to be ignored).
        """
        if key in self._entries:
            return False
        self._entries[key] = Entry(shard, frames, nbytes, queued_at=now, sent_at=now)
        return True

    def sent(self, key: Key, now: float) -> bool:
        """Record a send that went out.

        Args:
            key: a pending delta.
            now: when it was sent.

        Returns:
            Whether it was a re-send (the delta had gone out before).
        """
        entry = self._entries[key]
        resend = entry.sends > 0
        entry.sends += 1
        entry.sent_at = now
        return resend

    def blocked(self, key: Key, now: float) -> None:
        """Record a send that could not go out (the socket's queue was full).

        The delta is tried again after the back-off, as if it had been sent.

        Args:
            key: a pending delta.
            now: when the send was tried.
        """
        self._entries[key].sent_at = now

    def on_ack(self, key: Key, outcome: str, reason: str | None) -> Decision:
        """Apply a shard's ack of a pending delta (see the module docstring for the rules).

        Args:
            key: a pending delta (check with `in` first: the ack of a re-send whose
                first copy was already acked is to be ignored).
            outcome: "accepted", "duplicate" or "rejected".
            reason: the rejection reason, or None.

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
            raise KeyError(f"delta {key} is not pending; check `key in outbox` before on_ack")
        if outcome == REJECTED:
            if reason == "unknown_island":
                return "rejoin"
            if reason in RETRYABLE_REASONS:
                entry.deferred = True
                return "defer"
            if reason == "codec_error" and entry.decode_retries < DECODE_RETRIES:
                entry.decode_retries += 1
                return "resend"
        del self._entries[key]
        return "done"

    def due(self, now: float, up: Container[int]) -> list[Key]:
        """The deltas whose ack is overdue, to send again now; each one's attempt is counted.

        Args:
            now: current time.
            up: the shards that are up (deltas of the others wait for `on_rejoin`).

        Returns:
            Keys, in push order, of the deltas last sent (or tried) at least
            min(ack_timeout_cap_s, ack_timeout_s * 2**attempt) ago. Deferred
            deltas are included and stay deferred.
        """
        keys = []
        for key, entry in self._entries.items():
            if entry.shard in up and resend_due(
                now, entry.sent_at, entry.attempt, self.ack_timeout_s, self.ack_timeout_cap_s
            ):
                entry.attempt += 1
                keys.append(key)
        return keys

    def on_step(self, fragment: int) -> list[Key]:
        """A fragment stepped, so its shard has room again: its deferred deltas, to send now.

        Args:
            fragment: the fragment a published update named.

        Returns:
            Keys, in push order, of the deltas of `fragment` that were deferred
            (they are not deferred any more).
        """
        keys = []
        for key, entry in self._entries.items():
            if entry.deferred and key[0] == fragment:
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

    def drop_all(self) -> list[list[Any]]:
        """Forget every pending delta (the client closes).

        Returns:
            The packed message of each delta dropped unacked, in push order (so
            that the caller can keep them elsewhere, e.g. in a file).
        """
        dropped = [entry.frames for entry in self._entries.values()]
        self._entries.clear()
        return dropped
