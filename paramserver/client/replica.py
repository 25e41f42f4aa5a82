"""An island's replica of the global parameters and the Clone-pattern bookkeeping per shard.

This module owns, with no sockets: the per-fragment (version, fp32 values)
replica, `apply_update` (the one function that turns a published update into
the new values, so replicas stay bit-exact with the shard), `published_update`
(what an `update` message must hold to be applied), and `ShardFeed`, which
follows one shard's sequenced update stream: it buffers updates while
snapshots are in flight, replays the ones newer than each snapshot, and asks
for a re-snapshot when a sequence number is missing or out of order. A
client without a replica (`ClientConfig(replica=False)`) follows the same
stream with versions only: its fragments' values are None and its updates
are not decoded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from codec.prequantized import Coded, read_codes
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


@dataclass
class ReplicaFragment:
    """One fragment of the replica: its version and fp32 values.

    `values` is None in a client that keeps no replica (versions only).
    `increment`: the codes of the update that led from version - 1 to `version`
    (None after a snapshot or a full-values update, and without a replica).
    """

    version: int
    values: np.ndarray | None
    increment: Coded | None = None


@dataclass(frozen=True)
class Published:
    """One decoded `update` message of a shard's PUB stream (`values` None: not decoded)."""

    seq: int
    fragment: int
    version: int
    mode: str
    values: np.ndarray | None
    coded: Coded | None = None  # an int8/int4 increment's codes and scales (`values` decoded)


@dataclass
class ShardFeed:
    """Clone-pattern state of one shard's update stream.

    `replica` is shared with the other feeds (each feed only touches its own
    fragments). Methods return the fragments whose replica values changed,
    or raise `Resync` when the shard's fragments must be snapshotted again.
    """

    shard: int
    fragments: tuple[int, ...]
    replica: dict[int, ReplicaFragment]
    last_seq: int | None = None
    awaiting: set[int] = field(default_factory=set)
    snapshot_seqs: dict[int, int] = field(default_factory=dict)
    buffer: list[Published] = field(default_factory=list)
    sync_started: float = 0.0

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
    ) -> list[int]:
        """Take one snapshot reply; when it is the last one, replay the buffered updates.

        Args:
            fragment: the fragment (must be awaited; others are ignored).
            version: its version in the snapshot.
            seq: the PUB sequence number the snapshot includes.
            values: its exact fp32 values (None: a read of the version only).

        Returns:
            Fragments whose replica changed.

        Raises:
            Resync: the buffered stream has a hole; snapshot again.
        """
        if fragment not in self.awaiting:
            return []
        self.awaiting.discard(fragment)
        self.snapshot_seqs[fragment] = seq
        old = self.replica.get(fragment)
        kept = None if values is None else np.asarray(values, dtype=np.float32)
        self.replica[fragment] = ReplicaFragment(version, kept)
        changed = [] if old is not None and old.version == version else [fragment]
        if not self.awaiting:
            changed.extend(self._finish_sync())
        return changed

    def _finish_sync(self) -> list[int]:
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
        changed: list[int] = []
        for item in replay:
            if self._apply(item):
                changed.append(item.fragment)
        return changed

    def on_update(self, item: Published) -> list[int]:
        """Take one published update.

        Args:
            item: the decoded update.

        Returns:
            Fragments whose replica changed (empty or [item.fragment]).

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
        return [item.fragment] if self._apply(item) else []

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

    def _apply(self, item: Published) -> bool:
        if item.fragment not in self.fragments:
            raise Resync(f"shard {self.shard}: update for fragment {item.fragment} it does not own")
        state = self.replica.get(item.fragment)
        if state is not None and item.version <= state.version:
            return False
        if item.mode == UPDATE_INCREMENT and (state is None or item.version != state.version + 1):
            raise Resync(
                f"shard {self.shard}: delta to version {item.version} of fragment "
                f"{item.fragment}, replica has {None if state is None else state.version}"
            )
        if item.values is None:  # versions only: the update is not decoded
            self.replica[item.fragment] = ReplicaFragment(item.version, None)
            return True
        if state is not None and np.shape(item.values) != state.values.shape:
            raise Resync(f"shard {self.shard}: update of fragment {item.fragment} has wrong size")
        values = apply_update(None if state is None else state.values, item.mode, item.values)
        increment = item.coded if item.mode == UPDATE_INCREMENT else None
        self.replica[item.fragment] = ReplicaFragment(item.version, values, increment)
        return True


class Resync(Exception):
    """The feed lost track of its shard's stream: snapshot its fragments again."""


def published_update(
    header: dict, payload: list, plan: Plan | None, decode: bool = True
) -> Published:
    """A published update, decoded.

    Args:
        header: the update header (seq, fragment, version, mode).
        payload: its codec frames, {"values": 1-D vector}.
        plan: the island's plan (None: shapes not checked).
        decode: False: the payload is not read (values None; a client without a
            replica needs only the version).

    Returns:
        The update, its values 1-D float32 (an int8/int4 increment also as its codes).

    Raises:
        Resync: a fragment the plan does not have, or values of another size.
        ProtocolError: no values, not 1-D, or an unknown mode.
        CodecError: the frames cannot be decoded.
    """
    fragment = header["fragment"]
    if header["mode"] not in MODES:
        raise ProtocolError("malformed", f"update mode {header['mode']!r}")
    if not decode:
        if plan is not None and fragment >= plan.num_fragments:
            raise Resync(f"update of fragment {fragment}: the plan has {plan.num_fragments}")
        return Published(header["seq"], fragment, header["version"], header["mode"], None)
    coded = read_codes(payload, "values") if header.get("mode") == UPDATE_INCREMENT else None
    # an int8 increment is decompressed once: its codes are kept, its values decoded from them
    values = fragment_vector(payload) if coded is None else coded.values()
    if plan is not None and (
        fragment >= plan.num_fragments or values.shape != (plan.fragments[fragment].size,)
    ):
        raise Resync(f"update of fragment {fragment} with shape {values.shape}")
    return Published(header["seq"], fragment, header["version"], header["mode"], values, coded)
