"""An init in pieces while it is under way: who sends it, which elements are in, and the checks of a piece.

This module owns the rules of `init_begin` / `init_piece` (docs/protocol.md
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import codec
from paramserver.server.admission.outcomes import Outcome, refused
from paramserver.server.step.outer import aligned_float32
from paramserver.wire import protocol
from paramserver.wire.plan import Plan

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
        # aligned like the fragment's own params (chunked_step.host_vector), so the state
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
