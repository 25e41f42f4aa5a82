"""An island's view of the global parameters and the Clone-pattern bookkeeping per shard.

This module owns, with no sockets: the per-fragment version (and, when the
client keeps them, fp32 values) of the global parameters, `apply_update` (the
one function that turns a published update into the new values, so replicas
stay bit-exact with the shard), `published_update` (what an `update` message
must hold to be applied), and `ShardFeed`, which follows one shard's sequenced
update stream: it buffers updates while snapshots are in flight, replays the
ones newer than each snapshot, and asks for a re-snapshot when a sequence
number is missing or out of order. What it hands out is the `Update`s of the
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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from codec.decode import Coded, read_codes
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
