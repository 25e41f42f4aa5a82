"""Robust aggregation: clip a delta's norm relative to the median norm of recent deltas.

This module owns the pure decision of how much to scale down one incoming
delta so that a single poisoned island (huge, or merely much larger than its
peers) cannot dominate a merge: a delta whose L2 norm exceeds `multiple` times
the median of the last accepted norms of its fragment is scaled to exactly
that bound. The shard applies it when a delta is accepted
(`ShardConfig.clip_norm_multiple`, off by default); the norms it keeps are the
clipped ones, so an attacker cannot raise the bound by repeating itself.
A delta's norm is read from its pending form (codes, a piece at a time:
`paramserver.server.merge.sum_squares`), never from a decoded copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from paramserver.server.merge import DeltaSource, as_source, sum_squares

# Accepted norms to see before clipping starts (the median of fewer is noise).
MIN_HISTORY = 4
# Norms kept per fragment.
HISTORY = 32


def clip_factor(
    norm: float, recent: Sequence[float], multiple: float, min_history: int = MIN_HISTORY
) -> float:
    """The scale in (0, 1] to apply to a delta of L2 norm `norm`.

    Args:
        norm: the delta's L2 norm (finite, >= 0).
        recent: norms of recently accepted deltas of the same fragment.
        multiple: allowed multiple of their median (> 0); 0 turns clipping off.
        min_history: fewer recent norms than this: no clipping yet.

    Returns:
        min(1, multiple * median(recent) / norm), or 1.0 when clipping is off,
        the history is short, or the norm is 0.
    """
    if multiple <= 0 or len(recent) < min_history or norm <= 0:
        return 1.0
    bound = multiple * float(np.median(np.asarray(recent, dtype=np.float64)))
    return 1.0 if norm <= bound else bound / norm


def l2_norm(delta: DeltaSource | np.ndarray) -> float:
    """L2 norm of a 1-D delta, accumulated in float64 piece by piece.

    Args:
        delta: the delta (a 1-D array, or a pending delta kept coded).

    Returns:
        The norm.
    """
    return float(np.sqrt(sum_squares(as_source(delta))))


def clip(
    delta: DeltaSource | np.ndarray, recent: Sequence[float], multiple: float
) -> tuple[float, float, list[float]]:
    """Judge one incoming delta against its fragment's recent norms.

    Args:
        delta: the delta (a 1-D array, or a pending delta kept coded).
        recent: the fragment's kept (clipped) norms, oldest first.
        multiple: allowed multiple of their median (> 0); 0 turns clipping off.

    Returns:
        (the delta's norm, its clip factor in (0, 1], the recent norms with its
        clipped norm appended, the newest HISTORY kept).
    """
    norm = l2_norm(delta)
    factor = clip_factor(norm, recent, multiple)
    return norm, factor, [*recent, norm * factor][-HISTORY:]
