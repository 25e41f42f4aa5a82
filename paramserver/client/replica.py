"""What an island keeps of the global model: the replica, the shards' update feeds, and the readout.

This module owns, with no sockets, no lock and no I/O:

- the per-fragment version (and, when the client keeps them, fp32 values) of
  the global parameters, `apply_update` (the one function that turns a
  published update into the new values, so replicas stay bit-exact with the
  shard) and `published_update` (what an `update` message must hold to be
  applied);
- `ShardFeed`, which follows one shard's sequenced update stream: it buffers
  updates while snapshots are in flight, replays the ones newer than each
  snapshot, and asks for a re-snapshot when a sequence number is missing or
  out of order;
- `Readout`, what the client's API reads of its core: the counters, the
  newest version heard of per fragment, the updates `poll_updates` has not
  taken, ack latencies, the version that will include each acked delta (for
  `round_merged`) and the tokens each shard credited (`Client.stats`,
  `poll_updates`, `round_merged`, `delta_outcomes`, `ack_latencies`).

Both belong to the client's core (`paramserver.client.core`); the I/O
thread's lock guards them. What a feed hands out is the `Update`s of the
versions it took, in order; what it keeps depends on `ClientConfig.keep`:

- "values": a replica (`ReplicaFragment.values`), shared read-only with the
  updates it hands out (no copy per update);
- "increments": versions only, but for values not handed out yet: a
  snapshot's values (and the increments replayed onto them, decoded) are held
  until the join takes them or the shard's re-sync ends (a snapshot of the
  version handed out last is dropped: the caller has it); otherwise an
  increment is handed out as its codes, undecoded, and a full-values update
  as its values, and neither is kept;
- "versions": versions only; updates are not decoded.

Untaken updates (`Readout`): with `keep` "values" or "versions" the newest of
each fragment (an update's values are the replica's own read-only array, not
a copy); with "increments" every one, in order, since an increment only
applies to the version before it. That chain is bounded: when a fragment's
untaken increments outgrow its float32 values, it is dropped and `publish`
names the fragment, whose shard the core then snapshots again (the
snapshot's values restart the chain).
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from codec.coded import Coded, read_codes
from paramserver.client.types import Update
from paramserver.wire.plan import Plan
from paramserver.wire.protocol import UPDATE_FULL, UPDATE_INCREMENT, ProtocolError
from paramserver.wire.snapshot import fragment_vector

logger = logging.getLogger(__name__)

MODES = (UPDATE_FULL, UPDATE_INCREMENT)


def apply_update(current: np.ndarray | None, mode: str, values: np.ndarray) -> np.ndarray:
    """The values of a fragment after one published update.

    Args:
        current: the values at the previous version (1-D float32), or None.
        mode: "full" (`values` are the new values) or "increment" (`values` is the
            decoded change to add in float32).
        values: the decoded payload, 1-D.

    Returns:
        A new 1-D float32 array; `current` is not modified.

    Raises:
        ValueError: unknown mode, or an "increment" without current values or of another size.
    """
    if mode == "full":
        return np.array(values, dtype=np.float32, copy=True, order="C")
    if mode == UPDATE_INCREMENT:
        if current is None or current.shape != np.shape(values):
            raise ValueError("a delta update needs current values of the same shape")
        return np.add(current, values, dtype=np.float32)
    raise ValueError(f"unknown update mode {mode!r}; expected one of {MODES}")


def read_only(values: np.ndarray) -> np.ndarray:
    """`values` as float32, marked read-only (shared with readers, never changed in place)."""
    out = np.asarray(values, dtype=np.float32)
    out.flags.writeable = False
    return out


@dataclass
class ReplicaFragment:
    """One fragment as the client knows it: its version, and its fp32 values when kept.

    `values` is None without a replica (`ClientConfig.keep` "increments" or "versions"),
    except, with "increments", for values not handed out yet (see the module docstring).
    """

    version: int
    values: np.ndarray | None


@dataclass(frozen=True)
class Published:
    """One `update` message of a shard's PUB stream, as far as the client decodes it.

    `values`: the decoded 1-D float32 payload (the new values, or the increment's
    change), or None when not decoded; `coded`: an int8/int4 increment's codes and
    scales (then `values`, if set, is decoded from them).
    """

    seq: int
    fragment: int
    version: int
    mode: str
    values: np.ndarray | None
    coded: Coded | None = None

    def decoded(self) -> np.ndarray:
        """The payload's values (decoded from the codes when only they were read)."""
        if self.values is not None:
            return self.values
        if self.coded is None:
            raise Resync(f"update of fragment {self.fragment} was not decoded")
        return self.coded.values()


@dataclass
class ShardFeed:
    """Clone-pattern state of one shard's update stream.

    `replica` is shared with the other feeds (each feed only touches its own
    fragments). Methods return the `Update`s to hand out, in order, or raise
    `Resync` when the shard's fragments must be snapshotted again. `keep` is
    `ClientConfig.keep`; with "increments", `holding` is True until the join took
    the values (`take_values`), and values are handed out at the end of each
    re-sync afterwards.
    """

    shard: int
    fragments: tuple[int, ...]
    replica: dict[int, ReplicaFragment]
    keep: str = "values"
    last_seq: int | None = None
    awaiting: set[int] = field(default_factory=set)
    snapshot_seqs: dict[int, int] = field(default_factory=dict)
    buffer: list[Published] = field(default_factory=list)
    sync_started: float = 0.0
    holding: bool = True

    @property
    def syncing(self) -> bool:
        """True while snapshots of this shard are outstanding."""
        return bool(self.awaiting)

    def begin_sync(self, now: float) -> list[int]:
        """Start (or restart) a snapshot of every fragment of the shard.

        Args:
            now: monotonic time, to time out a sync that never completes.

        Returns:
            The fragments to request snapshots of.
        """
        self.awaiting = set(self.fragments)
        self.snapshot_seqs = {}
        self.buffer = []
        self.sync_started = now
        return list(self.fragments)

    def on_snapshot(
        self, fragment: int, version: int, seq: int, values: np.ndarray | None
    ) -> list[Update]:
        """Take one snapshot reply; when it is the last one, replay the buffered updates.

        Args:
            fragment: the fragment (must be awaited; others are ignored).
            version: its version in the snapshot.
            seq: the PUB sequence number the snapshot includes.
            values: its exact fp32 values (None: a read of the version only).

        Returns:
            The updates to hand out, in order.

        Raises:
            Resync: the buffered stream has a hole; snapshot again.
        """
        if fragment not in self.awaiting:
            return []
        self.awaiting.discard(fragment)
        self.snapshot_seqs[fragment] = seq
        old = self.replica.get(fragment)
        unchanged = old is not None and old.version == version
        kept = None if values is None or self.keep == "versions" else read_only(values)
        if self.keep == "increments" and unchanged and not self.holding and old.values is None:
            # the caller holds (or will take) this version: later ones as codes. Values
            # still held (an earlier read of this re-sync, which restarted) are not yet
            # handed out: keep them, or the caller would miss this version
            kept = None
        self.replica[fragment] = ReplicaFragment(version, kept)
        out: list[Update] = []
        if self.keep != "increments" and not unchanged:
            out.append(Update(fragment, version, kept))
        # "increments": new values are held (replayed onto) until the sync ends, then handed out
        if not self.awaiting:
            out.extend(self._finish_sync())
        return out

    def _finish_sync(self) -> list[Update]:
        low, high = min(self.snapshot_seqs.values()), max(self.snapshot_seqs.values())
        replay = sorted(
            {p.seq: p for p in self.buffer if p.seq > low}.values(), key=lambda p: p.seq
        )
        self.buffer = []
        expected = low + 1
        for item in replay:
            if item.seq != expected:
                raise Resync(f"shard {self.shard}: update seq {expected} missing after snapshot")
            expected += 1
        if expected - 1 < high:
            raise Resync(f"shard {self.shard}: updates up to seq {high} not all received")
        self.last_seq = expected - 1
        out: list[Update] = []
        for item in replay:
            out.extend(self._apply(item))
        if self.keep == "increments" and not self.holding:
            out.extend(self._hand_out_values())
        return out

    def take_values(self) -> dict[int, ReplicaFragment]:
        """The join takes the values held ("increments"); from now on they are handed out.

        Returns:
            fragment -> its version and values (None with "values", whose replica keeps
            them, and with "versions").
        """
        self.holding = False
        out = {}
        for f in self.fragments:
            state = self.replica[f]
            out[f] = ReplicaFragment(state.version, state.values)
            if self.keep == "increments":
                state.values = None
        return out

    def _hand_out_values(self) -> list[Update]:
        out = []
        for f in self.fragments:
            state = self.replica.get(f)
            if state is not None and state.values is not None:
                out.append(Update(f, state.version, state.values))
                state.values = None
        return out

    def on_update(self, item: Published) -> list[Update]:
        """Take one published update.

        Args:
            item: the update, as `published_update` read it.

        Returns:
            The updates to hand out (none, or one of `item.fragment`).

        Raises:
            Resync: a sequence gap, a restart of the stream, or a delta that
                does not follow the replica's version.
        """
        if self.syncing:
            self.buffer.append(item)
            return []
        if self.last_seq is not None and item.seq != self.last_seq + 1:
            raise Resync(
                f"shard {self.shard}: update seq {item.seq} after {self.last_seq}: missed updates"
            )
        self.last_seq = item.seq
        return self._apply(item)

    def on_heartbeat(self, seq: int) -> None:
        """Check a PUB heartbeat's sequence number against the stream.

        Args:
            seq: the last update seq the shard published.

        Raises:
            Resync: updates were missed (or the shard restarted its stream).
        """
        if self.syncing or self.last_seq is None:
            return
        if seq != self.last_seq:
            raise Resync(f"shard {self.shard}: heartbeat seq {seq}, last update {self.last_seq}")

    def _apply(self, item: Published) -> list[Update]:
        f = item.fragment
        if f not in self.fragments:
            raise Resync(f"shard {self.shard}: update for fragment {f} it does not own")
        state = self.replica.get(f)
        if state is not None and item.version <= state.version:
            return []
        increment = item.mode == UPDATE_INCREMENT
        if increment and (state is None or item.version != state.version + 1):
            raise Resync(
                f"shard {self.shard}: delta to version {item.version} of fragment "
                f"{f}, replica has {None if state is None else state.version}"
            )
        if self.keep == "versions":  # the update is not decoded
            self.replica[f] = ReplicaFragment(item.version, None)
            return [Update(f, item.version, None)]
        current = None if state is None else state.values
        if self.keep == "increments" and increment and current is None:
            if item.coded is None:  # nothing the caller could add: read the values instead
                raise Resync(f"shard {self.shard}: increment of fragment {f} is not int8/int4")
            self.replica[f] = ReplicaFragment(item.version, None)
            return [Update(f, item.version, None, item.coded)]
        change = item.decoded()
        if current is not None and change.shape != current.shape:
            raise Resync(f"shard {self.shard}: update of fragment {f} has wrong size")
        values = read_only(apply_update(current if increment else None, item.mode, change))
        if self.keep == "increments" and (self.holding or self.syncing):
            self.replica[f] = ReplicaFragment(item.version, values)  # held: not handed out yet
            return []
        kept = values if self.keep == "values" else None
        self.replica[f] = ReplicaFragment(item.version, kept)
        return [Update(f, item.version, values, item.coded if increment else None)]


class Resync(Exception):
    """The feed lost track of its shard's stream: snapshot its fragments again."""


def published_update(
    header: dict, payload: list, plan: Plan | None, keep: str = "values"
) -> Published:
    """A published update, decoded as far as a client that keeps `keep` needs.

    Args:
        header: the update header (seq, fragment, version, mode).
        payload: its codec frames, {"values": 1-D vector}.
        plan: the island's plan (None: shapes not checked).
        keep: `ClientConfig.keep`: "values" decodes everything (an int8/int4
            increment also kept as its codes); "increments" reads an int8/int4
            increment's codes without decoding them; "versions" reads no payload.

    Returns:
        The update.

    Raises:
        Resync: a fragment the plan does not have, or values of another size.
        ProtocolError: no values, not 1-D, or an unknown mode.
        CodecError: the frames cannot be decoded.
    """
    fragment = header["fragment"]
    mode = header["mode"]
    if mode not in MODES:
        raise ProtocolError("malformed", f"update mode {mode!r}")
    if plan is not None and fragment >= plan.num_fragments:
        raise Resync(f"update of fragment {fragment}: the plan has {plan.num_fragments}")
    if keep == "versions":
        return Published(header["seq"], fragment, header["version"], mode, None)
    # an int8 increment is decompressed once: its codes are kept, its values decoded from them
    coded = read_codes(payload, "values") if mode == UPDATE_INCREMENT else None
    if coded is None:
        values = fragment_vector(payload)
    else:
        values = None if keep == "increments" else coded.values()
    size = coded.size if values is None else values.size
    if values is not None and values.ndim != 1:
        raise Resync(f"update of fragment {fragment} with shape {values.shape}")
    if plan is not None and size != plan.fragments[fragment].size:
        raise Resync(f"update of fragment {fragment} with {size} elements")
    return Published(header["seq"], fragment, header["version"], mode, values, coded)


_MAX_LATENCIES = 100_000  # ack latencies kept until `take_ack_latencies` (bounded memory)
_MAX_MERGE_ROUNDS = 1024  # rounds whose merge versions are kept for `round_merged`
# with a listener (`Client.watch_outcomes`), whose owner keeps its own record of each
# delta: the newest rounds kept for `round_merged` and `delta_outcomes` (bounded memory)
_WATCHED_MERGE_ROUNDS = 16
_MAX_REFUSED = 256  # finally refused deltas kept for `take_refused` (the oldest go first)
# "increments": a fragment's untaken increments may hold up to this many bytes per element
# (its float32 values, what a snapshot of it costs); beyond, they are dropped for a snapshot
_CHAIN_BYTES_PER_ELEMENT = 4


@dataclass
class Counters:
    """What `stats` reports."""

    bytes_sent: int = 0
    bytes_received: int = 0
    pushes: int = 0
    acked: int = 0
    duplicates: int = 0
    rejected: Counter = field(default_factory=Counter)
    resent: int = 0
    spurious_resends: int = 0  # re-sends the shard answered `duplicate`: not needed
    snapshots: int = 0
    updates_applied: int = 0
    reconnects: int = 0
    resyncs: int = 0
    bad_messages: int = 0
    deferred: int = 0  # pushes the shard refused for now (too_many_pending): kept, re-sent


_COUNTS = frozenset(f.name for f in fields(Counters)) - {"rejected"}


class Readout:
    """The bookkeeping of one client's core (callers hold the core's lock)."""

    def __init__(self, keep: str = "values") -> None:
        """Start empty: no plan, no replica, every counter at zero.

        Args:
            keep: `ClientConfig.keep` ("increments": every untaken update is kept, in order).
        """
        self._counters = Counters()
        self._chained = keep == "increments"
        self.replica: dict[int, ReplicaFragment] = {}
        self.num_fragments: int | None = None  # the plan's, once joined
        self._known: dict[int, int] = {}  # newest version heard of, per fragment
        self._updates: dict[int, list[Update]] = {}  # fragment -> untaken updates, in order
        self._ack_latencies: deque[float] = deque(maxlen=_MAX_LATENCIES)
        # round -> fragment -> first version that includes the delta (None: rejected)
        self._merge_targets: dict[int, dict[int, int | None]] = {}
        self._credited: dict[int, float] = {}  # shard -> tokens of ours that entered the model
        # (fragment, round, codec frames) of deltas finally refused, until `take_refused`
        self._refused: deque[tuple[int, int, list[Any]]] = deque(maxlen=_MAX_REFUSED)
        # told (round, fragment, outcome) as a delta is acked, refused or merged (`Client.watch_outcomes`)
        self.listener: Callable[[int, int, str], None] | None = None
        # with a listener: fragment -> round -> the version that merges it, acked and not merged yet
        self._awaiting: dict[int, dict[int, int]] = {}

    # -- written by the core ------------------------------------------------------------------

    def add(self, **amounts: int) -> None:
        """Add to counters.

        Args:
            amounts: counter name -> amount, e.g. `add(resent=1, bytes_sent=n)`; any
                field of `Counters` but `rejected` (which `record_ack` keeps).
        """
        unknown = set(amounts) - _COUNTS
        if unknown:
            raise ValueError(f"no counter named {sorted(unknown)}; see Counters")
        for name, amount in amounts.items():
            setattr(self._counters, name, getattr(self._counters, name) + amount)

    def note_version(self, fragment: int, version: int) -> None:
        """A shard named `version` of `fragment` (ack, snapshot or update): track the newest."""
        self._known[fragment] = max(self._known.get(fragment, 0), version)

    def record_ack(self, ack: dict, latency_s: float, payload: list[Any] | None = None) -> None:
        """Count a delta's final ack and remember which version will include it.

        Args:
            ack: the ack header (outcome, reason, round, fragment, version,
                merged_version when the shard says).
            latency_s: seconds since the delta was pushed.
            payload: the delta's codec frames, kept for `take_refused` when it was refused.
        """
        target = ack.get("merged_version")
        if ack["outcome"] == "rejected":
            target = None
        elif target is None:  # a shard that does not say: a step merges all pending
            target = ack["version"] + (ack["outcome"] == "accepted")
        self._merge_targets.setdefault(ack["round"], {})[ack["fragment"]] = target
        kept = _MAX_MERGE_ROUNDS if self.listener is None else _WATCHED_MERGE_ROUNDS
        while len(self._merge_targets) > kept:
            del self._merge_targets[min(self._merge_targets)]
        if self.listener is not None:
            self._tell(ack["round"], ack["fragment"], target)
        if ack["outcome"] in ("accepted", "duplicate"):
            self._counters.acked += 1
            self._ack_latencies.append(latency_s)
            self._counters.duplicates += ack["outcome"] == "duplicate"
        else:
            self._counters.rejected[ack.get("reason") or "unknown"] += 1
            if payload is not None:
                self._refused.append((ack["fragment"], ack["round"], payload))

    def _tell(self, round: int, fragment: int, target: int | None) -> None:
        """Tell the listener a delta's final ack; a merge it still waits for is awaited."""
        outcome = self._outcome(fragment, target)
        if outcome == "acked":
            self._awaiting.setdefault(fragment, {})[round] = target
        self.listener(round, fragment, outcome)

    def _merged_upto(self, fragment: int) -> None:
        """Tell the listener of each awaited delta of `fragment` the replica now includes."""
        waiting, state = self._awaiting.get(fragment), self.replica.get(fragment)
        if not waiting or state is None:
            return
        for round in [r for r, target in waiting.items() if state.version >= target]:
            del waiting[round]
            self.listener(round, fragment, "merged")

    def credit(self, shard: int, credited: object) -> None:
        """A shard's cumulative credit of this island's tokens (ignored unless a number)."""
        if isinstance(credited, int | float) and not isinstance(credited, bool):
            self._credited[shard] = max(self._credited.get(shard, 0.0), float(credited))

    def publish(self, updates: list[Update]) -> list[int]:
        """Hand updates (in order) to `take_updates`.

        Args:
            updates: new versions, as the shards' feeds hand them out.

        Returns:
            Fragments whose untaken increments outgrew their bound and were dropped
            ("increments"): their shard must be snapshotted again. Else [].
        """
        dropped: list[int] = []
        if self.listener is not None:
            for fragment in sorted({u.fragment for u in updates}):
                self._merged_upto(fragment)
        for u in updates:
            self._counters.updates_applied += 1
            chain = self._updates.setdefault(u.fragment, [])
            if not self._chained or u.increment is None or u.values is not None:
                chain[:] = [u]  # the newest values (or version) replace what was untaken
                continue
            chain.append(u)
            held = sum(c.increment.nbytes for c in chain if c.values is None)
            if held > _CHAIN_BYTES_PER_ELEMENT * u.increment.size:
                del self._updates[u.fragment]
                dropped.append(u.fragment)
        return dropped

    # -- read by the API ------------------------------------------------------------------------

    def take_refused(self) -> list[tuple[int, int, list[Any]]]:
        """The deltas finally refused since the last call, oldest first (then forgotten).

        Returns:
            (fragment, round, codec frames) per delta.
        """
        out = list(self._refused)
        self._refused.clear()
        return out

    def take_updates(self) -> list[Update]:
        """Pop the untaken updates: the newest of each fragment, or every one ("increments").

        Returns:
            Updates sorted by fragment, then version.
        """
        updates, self._updates = self._updates, {}
        return [u for k in sorted(updates) for u in updates[k]]

    def take_ack_latencies(self) -> list[float]:
        """Pop the ack latencies recorded since the last call (bounded to the newest 100,000).

        Returns:
            Seconds from `push` to the ack (accepted or duplicate), one per delta.
        """
        out = list(self._ack_latencies)
        self._ack_latencies.clear()
        return out

    def delta_merged(self, round: int, fragment: int) -> bool:
        """Whether the delta of (`round`, `fragment`) is resolved and in the replica.

        Args:
            round: the round id given to `push`.
            fragment: the fragment index.

        Returns:
            True once it is acked and the replica holds a version that includes
            it, or it was rejected (it never will be: resolved).
        """
        return self.delta_outcome(round, fragment) in ("merged", "rejected")

    def round_merged(self, round: int) -> bool:
        """Whether every fragment's delta of `round` is resolved and in the replica.

        Args:
            round: the round id given to `push`.

        Returns:
            True once every fragment of the plan has an ack for this round and
            the replica holds a version that includes it (a rejected delta
            never will: it counts as resolved).
        """
        targets = self._merge_targets.get(round)
        if self.num_fragments is None or targets is None:
            return False
        if len(targets) < self.num_fragments:
            return False
        return all(self.delta_merged(round, f) for f in targets)

    def delta_outcome(self, round: int, fragment: int) -> str:
        """What became of one pushed delta, as far as this client knows.

        Args:
            round: the round id given to `push`.
            fragment: the delta's fragment.

        Returns:
            "merged" (acked, and the replica holds a version that includes it),
            "acked" (the shard holds it; no version including it arrived yet),
            "rejected", or "pending" (no final ack yet, or forgotten: only the
            newest 1024 rounds are kept, 16 with a listener).
        """
        targets = self._merge_targets.get(round, {})
        if fragment not in targets:
            return "pending"
        return self._outcome(fragment, targets[fragment])

    def _outcome(self, fragment: int, target: int | None) -> str:
        """ "rejected", "merged" or "acked" of a delta whose final ack said `target`."""
        if target is None:
            return "rejected"
        state = self.replica.get(fragment)
        return "merged" if state is not None and state.version >= target else "acked"

    def stats(self, shards_down: int) -> dict[str, Any]:
        """A copy of the counters plus derived values.

        Args:
            shards_down: shards the core counts as down.

        Returns:
            The stats dict of `Client.stats` (without `pending`).
        """
        c = self._counters
        replica = list(self.replica.items())  # one C-level copy; the dict may grow
        lag = max((self._known.get(f, s.version) - s.version for f, s in replica), default=0)
        return {
            "bytes_sent": c.bytes_sent,
            "bytes_received": c.bytes_received,
            "pushes": c.pushes,
            "acked": c.acked,
            "duplicates": c.duplicates,
            "rejected": dict(c.rejected),
            "resent": c.resent,
            "spurious_resends": c.spurious_resends,
            "snapshots": c.snapshots,
            "updates_applied": c.updates_applied,
            "version_lag": max(0, lag),
            "reconnects": c.reconnects,
            "resyncs": c.resyncs,
            "bad_messages": c.bad_messages,
            "deferred": c.deferred,
            "shards_down": shards_down,
            "credited_tokens": sum(self._credited.values()),
        }
