"""Combining a step's island deltas into one pseudo-gradient: the weighted mean, or RDA.

This module owns the `--merge mean|rda` rule of one fragment's step (numpy
only). `mean` is `sum_i c_i * delta_i` (`merge_deltas`). `rda` is radial-
directional averaging: island deltas merged by mean norm and mean direction.
With one coefficient c_ik per pending delta d_ik (`paramserver.server.weighting`:
the island's weight times the delta's own staleness factor), island i's vector
u_i = sum_k c_ik * d_ik and its weight C_i = sum_k c_ik, each tensor segment
of the fragment is merged as::

    merged = (sum_i |u_i|) * phi(sum_i C_i * phi(u_i)),   phi(x) = x / |x|

restricted to the segment. The mean direction keeps what the islands agree
on; the mean norm keeps the step's size, so it does not shrink like
1/sqrt(M) for M nearly orthogonal deltas as the plain mean does. The
coefficients carry the staleness factors, so one island's delta gives exactly
`u_1` as with the mean (a lone stale delta still moves the model less), and a
fresh lone delta is merged unchanged.

Segments: the fragment's slices (`plan.Slice`), one per tensor or tensor piece.
Where the byte-balanced plan splits a tensor across fragments (possibly on
different shards), each piece is normalised on its own: norms are per slice,
not per whole tensor, so a shard never needs another shard's data. Embedding
tensors (leaf path containing "embed") use the weighted mean: their rows are
touched by few tokens each and their norms say little about a direction. A
segment whose islands' directions cancel (|sum p_i phi(v_i)| tiny) or whose
deltas are all zero falls back to the weighted mean.

Chunks: a step's merge is a `ChunkMerge` (`chunk_merge`), whose `fill(lo, hi,
out)` writes elements [lo, hi) of the merged delta, decoding its sources
(`DeltaSource`: a pending delta kept coded, `codec.coded.CodedTensor`, or an
array) a piece of at most PIECE elements at a time, so a step needs no decoded
copy of any delta. The whole-segment quantities of `rda` (each island's norm,
the mean direction's length) come from one pass over the deltas when the
merge is built (the Gram matrix of the islands' deltas per segment). Every
element's value depends only on its own inputs and those factors, so fills
over any split of [0, size) give the same bits as one fill of the whole.
The `mean` rule computes exactly what a float32 `sum_i c_i * delta_i` in
delta order does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from paramserver.wire.plan import Fragment

MERGES = ("mean", "rda")
MEAN_LEAF_MARK = "embed"  # leaf paths merged by the weighted mean under RDA
PIECE = 1 << 16  # elements decoded at a time by a fill (scratch: a few of these per island)
_CANCEL_TOL = 1e-6  # |mean direction| below this: the directions cancel, use the mean


class MergeError(ValueError):
    """Deltas, coefficients or segments that do not fit together."""


class DeltaSource(Protocol):
    """A delta the merge reads a range at a time (`codec.coded.CodedTensor` is one)."""

    @property
    def size(self) -> int:
        """Element count."""
        ...

    def decode_into(self, lo: int, hi: int, out: np.ndarray) -> None:
        """Write float32 elements [lo, hi) into `out` (hi - lo elements)."""
        ...


@dataclass(frozen=True)
class ArrayDelta:
    """A delta held as a 1-D array (any float dtype; read as float32)."""

    values: np.ndarray

    @property
    def size(self) -> int:
        """Element count."""
        return int(self.values.shape[0])

    def decode_into(self, lo: int, hi: int, out: np.ndarray) -> None:
        """Copy elements [lo, hi) into `out` as float32."""
        np.copyto(out, self.values[lo:hi], casting="unsafe")


@dataclass(frozen=True)
class ScaledDelta:
    """A delta times a float32 factor (a clipped delta: `paramserver.server.robust`)."""

    source: DeltaSource
    factor: float

    @property
    def size(self) -> int:
        """Element count."""
        return self.source.size

    def decode_into(self, lo: int, hi: int, out: np.ndarray) -> None:
        """Elements [lo, hi) of the source, each times float32(factor)."""
        self.source.decode_into(lo, hi, out)
        np.multiply(out, np.float32(self.factor), out=out)


def scaled(source: DeltaSource, factor: float) -> DeltaSource:
    """`source` times `factor` (the source itself when the factor is 1).

    Args:
        source: a delta.
        factor: its scale.

    Returns:
        A DeltaSource.
    """
    return source if factor == 1.0 else ScaledDelta(source, factor)


def as_source(delta: DeltaSource | np.ndarray) -> DeltaSource:
    """A DeltaSource of an array or of a source.

    Args:
        delta: a 1-D array or anything with `size` and `decode_into`.

    Returns:
        The source (an ArrayDelta for an array).

    Raises:
        MergeError: an array that is not 1-D.
    """
    if hasattr(delta, "decode_into"):
        return delta  # type: ignore[return-value]
    values = np.asarray(delta)
    if values.ndim != 1:
        raise MergeError(f"deltas must be 1-D of one length, got shape {values.shape}")
    return ArrayDelta(values)


def pieces(lo: int, hi: int, step: int = PIECE):
    """The ranges [a, b) of at most `step` elements that cut [lo, hi) in order."""
    return ((a, min(a + step, hi)) for a in range(lo, hi, step))


def sum_squares(delta: DeltaSource, lo: int = 0, hi: int | None = None) -> float:
    """Sum of the squares of elements [lo, hi) of a delta, accumulated in float64 piece by piece.

    Args:
        delta: the delta.
        lo, hi: the range (hi None: to the end).

    Returns:
        The sum.
    """
    hi = delta.size if hi is None else hi
    buf = np.empty(min(PIECE, max(hi - lo, 0)), np.float32)
    wide = np.empty(buf.shape[0], np.float64)
    total = 0.0
    for a, b in pieces(lo, hi):
        delta.decode_into(a, b, buf[: b - a])
        np.copyto(wide[: b - a], buf[: b - a])
        total += float(np.dot(wide[: b - a], wide[: b - a]))
    return total


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


class ChunkMerge:
    """A step's merged delta, written a range at a time (`fill`); build with `chunk_merge`."""

    def __init__(self, size: int) -> None:
        """Args: size: the merged vector's element count."""
        self.size = size

    def fill(self, lo: int, hi: int, out: np.ndarray) -> None:
        """Write elements [lo, hi) of the merged delta into `out`.

        Args:
            lo, hi: 0 <= lo <= hi <= size.
            out: float32 array of hi - lo elements (must not alias a source).

        Raises:
            MergeError: a bad range or output.
        """
        if not 0 <= lo <= hi <= self.size or out.shape != (hi - lo,) or out.dtype != np.float32:
            raise MergeError(
                f"fill({lo}, {hi}) of {self.size} elements needs a float32 array of "
                f"{hi - lo}, got {out.dtype} {out.shape}"
            )
        self._fill(lo, hi, out)

    def _fill(self, lo: int, hi: int, out: np.ndarray) -> None:
        raise NotImplementedError

    def whole(self, out: np.ndarray | None = None) -> np.ndarray:
        """The whole merged delta (one fill of [0, size)).

        Args:
            out: optional float32 buffer of `size` elements.

        Returns:
            The merged float32 vector (`out` when given).
        """
        if out is None:
            out = np.empty(self.size, np.float32)
        elif out.dtype != np.float32 or out.shape != (self.size,):
            raise MergeError(
                f"out must be float32 of shape ({self.size},), got {out.dtype} {out.shape}"
            )
        self.fill(0, self.size, out)
        return out


class _MeanMerge(ChunkMerge):
    """sum_i w_i * delta_i in float32, in delta order (each product rounded, then added)."""

    def __init__(self, sources: Sequence[DeltaSource], weights: Sequence[float]) -> None:
        super().__init__(sources[0].size)
        self.sources = list(sources)
        self.weights = [np.float32(w) for w in weights]

    def _fill(self, lo: int, hi: int, out: np.ndarray) -> None:
        scratch = np.empty(min(PIECE, hi - lo), np.float32) if len(self.sources) > 1 else None
        for a, b in pieces(lo, hi):
            dst = out[a - lo : b - lo]
            self.sources[0].decode_into(a, b, dst)
            np.multiply(dst, self.weights[0], out=dst)
            for source, w in zip(self.sources[1:], self.weights[1:], strict=True):
                tmp = scratch[: b - a]
                source.decode_into(a, b, tmp)
                np.multiply(tmp, w, out=tmp)
                dst += tmp


class _RdaMerge(ChunkMerge):
    """Per segment, sum_i a_i * u_i in float64 with factors a_i from a Gram pass at build time.

    u_i = sum_k c_ik * d_ik is island i's coefficient-weighted sum of its deltas.
    """

    def __init__(
        self,
        islands: Sequence[Sequence[tuple[DeltaSource, float]]],
        segments: Sequence[Segment],
    ) -> None:
        super().__init__(islands[0][0][0].size)
        self.islands = [[(s, np.float32(c)) for s, c in parts] for parts in islands]
        self.segments = list(segments)
        weights = np.array([sum(c for _, c in parts) for parts in islands], dtype=np.float64)
        self.factors = [self._factors(seg, weights) for seg in self.segments]

    def _island_piece(self, i: int, a: int, b: int, out: np.ndarray, tmp: np.ndarray) -> None:
        """u_i over [a, b) into `out`: island i's deltas times their coefficients, summed (float32)."""
        (first, c0), *rest = self.islands[i]
        first.decode_into(a, b, out)
        np.multiply(out, c0, out=out)
        for part, c in rest:
            part.decode_into(a, b, tmp)
            np.multiply(tmp, c, out=tmp)
            out += tmp

    def _factors(self, seg: Segment, weights: np.ndarray) -> np.ndarray:
        count = len(self.islands)
        mean = np.ones(count)  # the weighted mean: sum_i u_i
        if seg.mean_only or count == 1:
            return mean
        gram = np.zeros((count, count))
        width = min(PIECE, seg.stop - seg.start)
        narrow, tmp = np.empty(width, np.float32), np.empty(width, np.float32)
        wide = np.empty((count, width))
        for a, b in pieces(seg.start, seg.stop):
            for i in range(count):
                self._island_piece(i, a, b, narrow[: b - a], tmp[: b - a])
                np.copyto(wide[i, : b - a], narrow[: b - a])
            block = wide[:, : b - a]
            gram += block @ block.T
        norms = np.sqrt(np.maximum(np.diag(gram), 0.0))
        unit = np.divide(weights, norms, out=np.zeros(count), where=norms > 0)  # C_i / |u_i|
        length = float(np.sqrt(max(float(unit @ gram @ unit), 0.0)))  # |sum_i C_i phi(u_i)|
        if length < _CANCEL_TOL * float(weights.sum()):
            return mean
        return float(norms.sum()) * unit / length

    def _fill(self, lo: int, hi: int, out: np.ndarray) -> None:
        width = min(PIECE, hi - lo)
        narrow, tmp = np.empty(width, np.float32), np.empty(width, np.float32)
        wide, acc = np.empty(width), np.empty(width)
        for seg, factors in zip(self.segments, self.factors, strict=True):
            for a, b in pieces(max(lo, seg.start), min(hi, seg.stop)):
                n = b - a
                acc[:n] = 0.0
                for i, factor in enumerate(factors):
                    if factor == 0.0:
                        continue
                    self._island_piece(i, a, b, narrow[:n], tmp[:n])
                    np.multiply(narrow[:n], np.float64(factor), out=wide[:n])
                    acc[:n] += wide[:n]
                np.copyto(out[a - lo : b - lo], acc[:n], casting="same_kind")


def _check_coefficients(coefficients: Sequence[float]) -> None:
    coef = np.asarray(coefficients, dtype=np.float64)
    if not np.all(np.isfinite(coef)) or np.any(coef < 0) or float(coef.sum()) <= 0:
        raise MergeError(f"coefficients {list(coefficients)} must be >= 0 with a positive sum")


def _check_segments(segments: Sequence[Segment], size: int) -> None:
    expected = 0
    for seg in segments:
        if seg.start != expected or seg.stop < seg.start:
            raise MergeError(f"segments must be contiguous from 0; got {seg} after {expected}")
        expected = seg.stop
    if expected != size:
        raise MergeError(f"segments cover {expected} elements, the deltas have {size}")


def rda_merge(
    deltas: Sequence[np.ndarray | DeltaSource],
    coefficients: Sequence[float],
    segments: Sequence[Segment],
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Merge one delta per island by radial-directional averaging.

    Args:
        deltas: equal-sized 1-D float arrays (or sources), one per island (pushes summed).
        coefficients: c_i per island (C_i = c_i, u_i = c_i * delta_i), >= 0 with a positive sum.
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
    sources = [as_source(d) for d in deltas]
    if any(s.size != sources[0].size for s in sources):
        raise MergeError(f"deltas must be 1-D of one length, got {[s.size for s in sources]}")
    _check_coefficients(coefficients)
    _check_segments(segments, sources[0].size)
    islands = [[(s, float(c))] for s, c in zip(sources, coefficients, strict=True)]
    return _RdaMerge(islands, segments).whole(out)


def merge_deltas(
    deltas: Sequence[np.ndarray | DeltaSource],
    weights: Sequence[float],
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Weighted sum of deltas.

    Args:
        deltas: equal-sized 1-D float arrays or sources (decoded pseudo-gradients).
        weights: one already-normalized weight per delta.
        out: optional float32 buffer of the deltas' shape (must not alias a delta).

    Returns:
        sum_i weights[i] * deltas[i] as float32 (`out` when given).
    """
    if len(deltas) == 0:
        raise MergeError("merge_deltas needs at least one delta")
    if len(deltas) != len(weights):
        raise MergeError(f"{len(deltas)} deltas but {len(weights)} weights")
    sources = [as_source(d) for d in deltas]
    for i, s in enumerate(sources):
        if s.size != sources[0].size:
            raise MergeError(f"delta {i} has shape ({s.size},), delta 0 has ({sources[0].size},)")
    return _MeanMerge(sources, weights).whole(out)


def chunk_merge(
    rule: str,
    deltas: Sequence[tuple[str, DeltaSource | np.ndarray]],
    coefficients: Sequence[float],
    fragment: Fragment,
) -> ChunkMerge:
    """A step's merged pseudo-gradient under a merge rule, to be written range by range.

    Args:
        rule: "mean" (sum of c_k * delta_k) or "rda" (this module).
        deltas: (island, delta) of every pending delta the step merges; an
            island's deltas are disjoint increments, summed with their
            coefficients first (rda).
        coefficients: one c_k >= 0 per delta, aligned with `deltas`
            (`weighting.merge_coefficients`), with a positive sum.
        fragment: the plan fragment (its slices are the RDA segments).

    Returns:
        A ChunkMerge of fragment.size elements: `fill(lo, hi, out)` writes its
        elements [lo, hi). The rda factors are computed here (one pass over
        the deltas); the sources must not change while it is used.

    Raises:
        MergeError: an unknown rule, no deltas, deltas of the wrong size, or
            coefficients that do not match them.
    """
    if rule not in MERGES:
        raise MergeError(f"merge={rule!r} is unknown; choose one of {MERGES}")
    if not deltas:
        raise MergeError("a merge needs at least one delta")
    if len(coefficients) != len(deltas):
        raise MergeError(f"{len(deltas)} deltas but {len(coefficients)} coefficients")
    _check_coefficients(coefficients)
    sources = [(island, as_source(d)) for island, d in deltas]
    if any(s.size != fragment.size for _, s in sources):
        sizes = sorted({s.size for _, s in sources})
        raise MergeError(
            f"deltas of sizes {sizes} for fragment {fragment.index} of {fragment.size}"
        )
    if rule == "mean":
        return _MeanMerge([s for _, s in sources], list(coefficients))
    per_island: dict[str, list[tuple[DeltaSource, float]]] = {}
    for (island, source), c in zip(sources, coefficients, strict=True):
        per_island.setdefault(island, []).append((source, float(c)))
    return _RdaMerge(list(per_island.values()), fragment_segments(fragment))


def merge_pending(
    rule: str,
    deltas: Sequence[tuple[str, DeltaSource | np.ndarray]],
    coefficients: Sequence[float],
    fragment: Fragment,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """A step's merged pseudo-gradient under a merge rule, whole (`chunk_merge` filled once).

    Args:
        rule: "mean" (sum of c_k * delta_k) or "rda" (this module).
        deltas: (island, delta) of every pending delta the step merges.
        coefficients: one c_k per delta, aligned with `deltas`.
        fragment: the plan fragment (its slices are the RDA segments).
        out: optional float32 buffer of the deltas' shape.

    Returns:
        The merged float32 vector (`out` when given).
    """
    return chunk_merge(rule, deltas, coefficients, fragment).whole(out)
