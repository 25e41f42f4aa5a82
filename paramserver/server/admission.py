"""Which pushes a shard may accept: the header-only checks, in order, before any payload is read.

This module owns the rules of `check_push` (plan, fragment, island, dedup
window, base version, per-island pending bound); `paramserver.server.state` counts
and applies what passes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from paramserver.server.records import Outcome
from paramserver.wire.protocol import DUPLICATE, REJECTED

if TYPE_CHECKING:
    from paramserver.server.state import ShardState


def check_push(state: ShardState, header: Mapping[str, Any]) -> Outcome | None:
    """Header-only checks of a push, in order; counts nothing.

    Args:
        state: the shard's state.
        header: a push header that passed protocol.unpack.

    Returns:
        None when the push may proceed to payload checks; else the
        duplicate or rejected outcome (not yet counted: see submit_delta).
    """
    if state.plan is None:
        return Outcome(REJECTED, "not_initialized", "no parameters yet: init first")
    fragment = header["fragment"]
    if header["plan_hash"] != state.plan.hash:
        return Outcome(
            REJECTED,
            "plan_mismatch",
            f"plan hash {header['plan_hash']!r} != {state.plan.hash!r}",
        )
    if fragment not in state.fragments:
        return Outcome(
            REJECTED,
            "unknown_fragment",
            f"fragment {fragment} is not owned by shard {state.index}",
        )
    frag = state.fragments[fragment]
    island = header["island"]
    if island not in state.last_seen:
        return Outcome(
            REJECTED, "unknown_island", f"island {island!r}: say hello, then resend", None
        )
    rnd = header["round"]
    entry = state.dedup.get((island, fragment))
    if entry is not None:
        if rnd in entry.rounds:
            still_pending = any(c.island == island and c.round == rnd for c in frag.pending)
            return Outcome(
                DUPLICATE,
                None,
                "already accepted",
                version=frag.version,
                merged_version=frag.version + 1 if still_pending else frag.version,
            )
        if rnd < entry.newest - state.cfg.dedup_window:
            return Outcome(
                REJECTED,
                "replayed_round",
                f"round {rnd} is older than the dedup window "
                f"(newest {entry.newest}, window {state.cfg.dedup_window})",
            )
    if header["base_version"] > frag.version:
        return Outcome(
            REJECTED,
            "future_base_version",
            f"base_version {header['base_version']} > current version {frag.version}",
        )
    mine = sum(1 for c in frag.pending if c.island == island)
    if mine >= state.cfg.max_pending_per_island:
        return Outcome(
            REJECTED,
            "too_many_pending",
            f"{mine} deltas of {island!r} already pending on fragment {fragment}",
        )
    return None
