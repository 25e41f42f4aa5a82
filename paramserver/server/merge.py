"""Combining a step's island deltas into one pseudo-gradient: the weighted mean, or RDA.

This module owns the `--merge mean|rda` rule of one fragment's step (numpy
only). `mean` is `sum_i c_i * delta_i` (`merge_deltas`). `rda` is radial-
directional averaging: island deltas merged by mean norm and mean direction. With the step's island coefficients c_i = w_i * g(s_i)
(`paramserver.server.weighting`), C = sum c_i and p_i = c_i / C, each tensor segment
of the fragment is merged as::

    merged = C * (sum_i p_i * |v_i|) * phi(sum_i p_i * phi(v_i)),   phi(x) = x / |x|

where v_i is island i's delta (its pushes summed) restricted to the segment. The
mean direction keeps what the islands agree on; the mean norm keeps the step's
size, so it does not shrink like 1/sqrt(M) for M nearly orthogonal deltas as the
plain mean does. C carries the staleness factors, so one island's delta gives
exactly `c_1 * v_1` as with the mean (a lone stale delta still moves the model
less), and a fresh lone delta is merged unchanged.

Segments: the fragment's slices (`plan.Slice`), one per tensor or tensor piece.
Where the byte-balanced plan splits a tensor across fragments (possibly on
different shards), each piece is normalised on its own: norms are per slice,
not per whole tensor, so a shard never needs another shard's data. Embedding
tensors (leaf path containing "embed") use the weighted mean: their rows are
touched by few tokens each and their norms say little about a direction. A
segment whose islands' directions cancel (|sum p_i phi(v_i)| tiny) or whose
deltas are all zero falls back to the weighted mean.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from paramserver.wire.plan import Fragment

MERGES = ("mean", "rda")
MEAN_LEAF_MARK = "embed"  # leaf paths merged by the weighted mean under RDA
_CANCEL_TOL = 1e-6  # |mean direction| below this: the directions cancel, use the mean


class MergeError(ValueError):
    """Deltas, coefficients or segments that do not fit together."""


@dataclass(frozen=True)
class Segment:
    """A range [start, stop) of a fragment vector merged as one unit."""

    start: int
    stop: int
    mean_only: bool = False


def fragment_segments(fragment: Fragment) -> list[Segment]:
    """The RDA segments of a fragment: one per slice, embeddings marked mean-only.

    Args:
        fragment: a plan fragment.

    Returns:
        Contiguous segments covering [0, fragment.size) in slice order.
    """
    segments, offset = [], 0
    for piece in fragment.slices:
        segments.append(Segment(offset, offset + piece.size, MEAN_LEAF_MARK in piece.path))
        offset += piece.size
    return segments


def rda_merge(
    deltas: Sequence[np.ndarray],
    coefficients: Sequence[float],
    segments: Sequence[Segment],
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Merge one delta per island by radial-directional averaging.

    Args:
        deltas: equal-shaped 1-D float arrays, one per island (pushes summed).
        coefficients: c_i = w_i * g(s_i) per island, >= 0 with a positive sum.
        segments: contiguous ranges covering the vector (`fragment_segments`).
        out: optional float32 buffer of the deltas' shape (must not alias a delta).

    Returns:
        The merged float32 vector (`out` when given).

    Raises:
        MergeError: no deltas, mismatched lengths or shapes, bad coefficients, or
            segments that do not cover the vector.
    """
    if not deltas or len(deltas) != len(coefficients):
        raise MergeError(f"{len(deltas)} deltas but {len(coefficients)} coefficients")
    size = np.shape(deltas[0])
    if len(size) != 1 or any(np.shape(d) != size for d in deltas):
        raise MergeError(f"deltas must be 1-D of one length, got {[np.shape(d) for d in deltas]}")
    coef = np.asarray(coefficients, dtype=np.float64)
    total = float(coef.sum())
    if not np.all(np.isfinite(coef)) or np.any(coef < 0) or total <= 0:
        raise MergeError(f"coefficients {list(coefficients)} must be >= 0 with a positive sum")
    expected = 0
    for seg in segments:
        if seg.start != expected or seg.stop < seg.start:
            raise MergeError(f"segments must be contiguous from 0; got {seg} after {expected}")
        expected = seg.stop
    if expected != size[0]:
        raise MergeError(f"segments cover {expected} elements, the deltas have {size[0]}")
    if out is None:
        out = np.empty(size, dtype=np.float32)
    share = coef / total
    for seg in segments:
        pieces = [np.asarray(d[seg.start : seg.stop], dtype=np.float64) for d in deltas]
        out[seg.start : seg.stop] = total * _merge_segment(pieces, share, seg.mean_only)
    return out


def _merge_segment(pieces: list[np.ndarray], share: np.ndarray, mean_only: bool) -> np.ndarray:
    if not mean_only and len(pieces) > 1:
        norms = np.array([np.linalg.norm(v) for v in pieces])
        direction = sum(p * v / n for p, v, n in zip(share, pieces, norms, strict=True) if n > 0)
        length = float(np.linalg.norm(direction))  # 0 when every delta is zero
        if length >= _CANCEL_TOL:
            return float(share @ norms) * direction / length
    return sum(p * v for p, v in zip(share, pieces, strict=True))  # the weighted mean


def merge_deltas(
    deltas: Sequence[np.ndarray], weights: Sequence[float], out: np.ndarray | None = None
) -> np.ndarray:
    """Weighted sum of deltas.

    Args:
        deltas: equal-shaped float arrays (decoded pseudo-gradients).
        weights: one already-normalized weight per delta.
        out: optional float32 buffer of the deltas' shape (must not alias a delta).

    Returns:
        sum_i weights[i] * deltas[i] as float32 (`out` when given).
    """
    if len(deltas) == 0:
        raise MergeError("merge_deltas needs at least one delta")
    if len(deltas) != len(weights):
        raise MergeError(f"{len(deltas)} deltas but {len(weights)} weights")
    shape = np.shape(deltas[0])
    for i, d in enumerate(deltas):
        if np.shape(d) != shape:
            raise MergeError(f"delta {i} has shape {np.shape(d)}, delta 0 has {shape}")
    if out is None:
        out = np.empty(shape, dtype=np.float32)
    elif out.dtype != np.float32 or out.shape != shape:
        raise MergeError(f"out must be float32 of shape {shape}, got {out.dtype} {out.shape}")
    np.multiply(deltas[0], np.float32(weights[0]), out=out, casting="unsafe")
    if len(deltas) > 1:
        scratch = np.empty(shape, dtype=np.float32)
        for d, w in zip(deltas[1:], weights[1:], strict=True):
            np.multiply(d, np.float32(w), out=scratch, casting="unsafe")
            out += scratch
    return out


def merge_pending(
    rule: str,
    deltas: Sequence[tuple[str, np.ndarray]],
    coefficients: Mapping[str, float],
    fragment: Fragment,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """A step's merged pseudo-gradient under a merge rule.

    Args:
        rule: "mean" (sum of c_i * delta) or "rda" (this module).
        deltas: (island, delta) of every pending delta the step merges; an
            island's deltas are disjoint increments and are summed first.
        coefficients: island -> c_i = w_i * g(s_i).
        fragment: the plan fragment (its slices are the RDA segments).
        out: optional float32 buffer of the deltas' shape.

    Returns:
        The merged float32 vector (`out` when given).
    """
    if rule not in MERGES:
        raise MergeError(f"merge={rule!r} is unknown; choose one of {MERGES}")
    if rule == "mean":
        return merge_deltas([d for _, d in deltas], [coefficients[i] for i, _ in deltas], out=out)
    per_island: dict[str, np.ndarray] = {}
    for island, delta in deltas:
        if island in per_island:
            per_island[island] = per_island[island] + delta
        else:
            per_island[island] = np.asarray(delta, dtype=np.float32)
    return rda_merge(
        list(per_island.values()),
        [coefficients[i] for i in per_island],
        fragment_segments(fragment),
        out=out,
    )
