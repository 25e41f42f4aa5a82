"""What a shard refuses, before any state changes: the rules, as outcomes (never counted here).

This module owns the rules of `check_push` (plan, fragment, island, dedup
window, base version, per-island pending bound; header-only, before any
payload is read), the size limit of any request (`oversize`), the refusals of
a snapshot request (`snapshot_refusal`) and the answer to a request from an
island the shard does not know on that connection (`unknown_island`).
`paramserver.server.state` counts the refusals and applies what passes; the
shard's I/O loop only routes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from paramserver.server.records import Outcome
from paramserver.wire.protocol import DUPLICATE, REJECTED

if TYPE_CHECKING:
    from paramserver.server.state import ShardState


def oversize(state: ShardState, size: int) -> Outcome | None:
    """The refusal of a request larger than the shard accepts.

    Args:
        state: the shard's state (its config holds max_message_bytes).
        size: the request's size in bytes, all frames.

    Returns:
        A rejected `oversize` outcome, or None when the request fits.
    """
    limit = state.cfg.max_message_bytes
    if size <= limit:
        return None
    return Outcome(REJECTED, "oversize", f"{size} bytes; max_message_bytes={limit}")


def snapshot_refusal(state: ShardState, fragment: int) -> Outcome | None:
    """Why a snapshot of `fragment` cannot be served, if it cannot.

    Args:
        state: the shard's state.
        fragment: the requested fragment.

    Returns:
        `not_initialized` or `unknown_fragment` (rejected), or None to serve it.
    """
    if not state.initialized:
        return Outcome(REJECTED, "not_initialized", "no parameters yet: init first")
    if fragment not in state.fragments:
        return Outcome(
            REJECTED, "unknown_fragment", f"fragment {fragment} is not on shard {state.index}"
        )
    return None


def unknown_island(island: str) -> Outcome:
    """The answer to a push or heartbeat of an island not known on its connection.

    Args:
        island: the island id the request names.

    Returns:
        A rejected `unknown_island` outcome asking it to say hello again.
    """
    detail = f"island {island!r} is not known here (or its connection changed): say hello again"
    return Outcome(REJECTED, "unknown_island", detail)


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
        return unknown_island(island)
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
