"""The merge of a step's pending deltas into one pseudo-gradient: the weighted mean, RDA or median.

`median` (`median_merge`) is the robust rule for islands that are not all
trusted: the coordinate-wise median over the step's islands.

This module owns the `--merge mean|rda` rule of one fragment's step (numpy
only). Each pending delta d_k of island i has a coefficient c_ik
(`paramserver.server.step.weighting`). `mean` is `sum_k c_k * delta_k` in float32,
in delta order (`merge_deltas`). `rda` is radial-directional averaging: with
u_i = sum_k c_ik * d_ik (island i's work, its increments summed) and
C_i = sum_k c_ik, each tensor is merged as::

    merged = (sum_i |u_i|) * phi(sum_i C_i * phi(u_i)),   phi(x) = x / |x|

The mean direction keeps what the islands agree on; the summed norm keeps the
step's size, so it does not shrink like 1/sqrt(M) for M nearly orthogonal
deltas as the plain mean does. One island gives exactly u_1 as the mean does
(a lone stale delta still moves the model less). Embedding tensors (leaf path
containing "embed") use the mean: their rows are touched by few tokens each
and their norms say little about a direction. A tensor whose directions cancel
(|sum C_i phi(u_i)| < 1e-6 sum C_i) or whose deltas are all zero falls back to
the mean. Per element, merged = sum_i a_i * u_i with a_i = N * C_i / (|u_i| * |m|)
(`rda_factors`): the factors need only the islands' Gram matrix <u_i, u_j>
over the whole tensor.

Whole tensors, wherever the plan cuts them: the Gram of a tensor is the sum
of the Grams of its pieces, so a fragment holding a piece computes that
piece's Gram (`rda_partials`: M x M float64 per tensor, `TensorPartial`) and
adds the partial sums of the tensor's other pieces (`chunk_merge(...,
outside=...)`). Given the partial sums of every other piece for the same
deltas and coefficients, the result is the whole-tensor merge for any cut,
any fragment and shard count, up to float rounding (tests/test_rda_whole_tensor.py).
Why partial sums and not a norm in the push header: |m| needs the islands'
cross inner products over the whole tensor, which no island has. Two islands
agreeing on one half of a tensor and orthogonal on the other, or orthogonal
on both halves, push identical second halves with identical whole-tensor
norms, yet the whole-tensor merge scales that half by sqrt(4/3) in the first
case and sqrt(2) in the second; so no per-island header field can make a
fragment's step exact, only data from the tensor's other pieces can.
In the shard: the plan keeps the fragments of a cut tensor on one shard
unless the tensor spans one of the S - 1 boundaries between shards' runs
(`paramserver.wire.plan`), and a step passes the Grams of the pieces this
shard holds of the same pushes (`paramserver.server.step.policy`, logged in
the StepEvent). So a tensor is merged over the whole tensor when all its
pieces are on one shard and hold the step's pushes (in sync mode the pieces
of a round step together); a piece on another shard, or one without the
step's pushes (quorum and async steps that merge different pushes per
piece, a sibling stepped before a restart), is left out of the norms: the
tensor is then normalised over the pieces that have them. Shards exchange
nothing.

Why over 700 lines: the three rules are one interface (`ChunkMerge`, filled a
chunk at a time by the step) over the same delta sources, and RDA's
whole-tensor partial sums are that rule's own data; apart, each rule would
import the others' sources and chunking.

Chunks: a step's merge is a `ChunkMerge` (`chunk_merge`), whose `fill(lo, hi,
out)` writes elements [lo, hi) of the merged delta, decoding its sources
(`DeltaSource`: a pending delta kept coded, `codec.coded.CodedTensor`, or an
array) a piece of at most PIECE elements at a time, so a step needs no decoded
copy of any delta. The Grams come from one pass over the deltas when the
merge is built. Every element's value depends only on its own inputs and the
factors, so fills over any split of [0, size) give the same bits as one fill
of the whole.

RDA's per-tensor arithmetic (`rda_factors`, `aligned_gram`, `TensorPartial`)
is pure numpy on M x M matrices (M islands), apart from the deltas themselves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from codec.coded import CodedTensor
from codec.quant import sum_squares_float32
from codec.quant_rule import step_factor
from paramserver.wire.plan import Fragment

MERGES = ("mean", "rda", "median")
MEAN_LEAF_MARK = "embed"  # leaf paths merged by the weighted mean under RDA
PIECE = 1 << 16  # elements decoded at a time by a fill (scratch: a few of these per island)


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
    """A delta times a float32 factor (a clipped delta: `paramserver.server.step.weighting`)."""

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
    """Sum of the squares of elements [lo, hi) of a delta, in float64 (piece by piece when decoded).

    Args:
        delta: the delta.
        lo, hi: the range (hi None: to the end).

    A delta kept coded sums itself (`codec.coded.CodedTensor.sum_squares`:
    an int8 one from its codes and block scales in one compiled pass, equal
    to the sum over its decoded values within 2**-23 relative).

    Returns:
        The sum.
    """
    hi = delta.size if hi is None else hi
    if isinstance(delta, CodedTensor):
        return delta.sum_squares(lo, hi)
    if isinstance(delta, ArrayDelta) and delta.values.dtype == np.float32:
        return sum_squares_float32(delta.values[lo:hi])  # a fragment's params: one pass
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
    """A range [start, stop) of a fragment vector merged as one unit: one tensor's slice.

    `path` names the tensor (RDA's norms are per tensor: the slices of one path,
    here and in the partial sums of its other pieces, share them); "" makes the
    segment a tensor of its own.
    """

    start: int
    stop: int
    mean_only: bool = False
    path: str = ""


def fragment_segments(fragment: Fragment) -> list[Segment]:
    """The RDA segments of a fragment: one per slice, named by its tensor, embeddings mean-only.

    Args:
        fragment: a plan fragment.

    Returns:
        Contiguous segments covering [0, fragment.size) in slice order.
    """
    segments, offset = [], 0
    for piece in fragment.slices:
        mean_only = MEAN_LEAF_MARK in piece.path
        segments.append(Segment(offset, offset + piece.size, mean_only, piece.path))
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


def _compiled_kernels():
    """`codec.quant.compiled_loops` (numba), or None where numba cannot be imported."""
    try:
        from codec.quant import compiled_loops as kernels
    except ImportError:
        return None
    return kernels


def _int8_coded(source: DeltaSource) -> tuple[np.ndarray, np.ndarray, int, np.float32] | None:
    """(codes, scales, block, clip factor) of an int8-coded delta (maybe clipped), else None."""
    factor = np.float32(1.0)
    if isinstance(source, ScaledDelta):
        factor, source = np.float32(source.factor), source.source
    if getattr(source, "scheme", None) != "int8":
        return None
    codes, scales = source.codes, source.scales  # type: ignore[attr-defined]
    if codes.ndim != 1 or codes.dtype != np.int8 or scales.dtype != np.float32:
        return None
    return codes, scales, int(source.block), factor  # type: ignore[attr-defined]


class _MeanMerge(ChunkMerge):
    """sum_i w_i * delta_i in float32, in delta order (each product rounded, then added).

    When every delta is int8-coded (the shard's pending deltas) and numba is
    installed, a fill is one compiled loop per delta over the whole range
    (`codec.quant.compiled_loops.dequantize_weighted`), the same float32 operations in the
    same order as the numpy pieces, so the same bits.
    """

    def __init__(self, sources: Sequence[DeltaSource], weights: Sequence[float]) -> None:
        super().__init__(sources[0].size)
        self.sources = list(sources)
        self.weights = [np.float32(w) for w in weights]
        coded = [_int8_coded(s) for s in self.sources]
        self._kernels = _compiled_kernels() if all(c is not None for c in coded) else None
        self._coded = coded

    def _fill(self, lo: int, hi: int, out: np.ndarray) -> None:
        if self._kernels is not None and out.flags.c_contiguous:
            step = step_factor(127)
            for k, (coded, w) in enumerate(zip(self._coded, self.weights, strict=True)):
                codes, scales, block, factor = coded  # type: ignore[misc]
                self._kernels.dequantize_weighted(
                    codes, scales, out, lo, block, step, factor, w, k > 0
                )
            return
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


class _MedianMerge(ChunkMerge):
    """(sum_i C_i) * the coordinate-wise median over islands of u_i / C_i (`median_merge`)."""

    def __init__(self, parts: Sequence[Sequence[tuple[DeltaSource, float]]]) -> None:
        super().__init__(parts[0][0][0].size)
        self.parts = [list(p) for p in parts]
        self.totals = [math.fsum(c for _, c in p) for p in self.parts]
        self.scale = math.fsum(self.totals)

    def _fill(self, lo: int, hi: int, out: np.ndarray) -> None:
        for a, b in pieces(lo, hi):
            rows = np.zeros((len(self.parts), b - a), np.float64)
            scratch = np.empty(b - a, np.float32)
            for row, part, total in zip(rows, self.parts, self.totals, strict=True):
                for source, c in part:
                    source.decode_into(a, b, scratch)
                    row += scratch * (c / total if total > 0 else 0.0)
            out[a - lo : b - lo] = self.scale * np.median(rows, axis=0)


def median_merge(rows: Sequence[tuple[str, DeltaSource, float]]) -> _MedianMerge:
    """The coordinate-wise median over the islands of a step, for islands not all trusted.

    With u_i = sum_k c_ik * d_ik (island i's work) and C_i = sum_k c_ik, each
    element is merged as (sum_i C_i) * median_i(u_i / C_i): each island's own
    mean delta votes with equal say, whatever tokens it claims, and the step
    keeps the size the weighted mean would have had. One island gives u_1
    exactly as the mean; with two, the median is their average; from three
    on, one island alone cannot move an element past the others' values.

    Args:
        rows: (island, delta, c_k) per pending delta of the step.

    Returns:
        A ChunkMerge (float64 inside, float32 out).
    """
    per_island: dict[str, list[tuple[DeltaSource, float]]] = {}
    for island, source, c in rows:
        per_island.setdefault(island, []).append((source, c))
    _check_coefficients([c for _, _, c in rows])
    return _MedianMerge(list(per_island.values()))


class _RdaMerge(ChunkMerge):
    """Per segment, sum_i a_i * u_i in float64 with per-tensor factors a_i from Gram matrices.

    `parts[i]` are island i's (delta, c_ik); u_i = sum_k c_ik * d_ik. The Gram
    of each tensor's piece here is computed in one pass at build time
    (`partials`), the Grams in `outside` (the tensor's other pieces) are added,
    and the factors come from the sum (`rda_factors`).
    """

    def __init__(
        self,
        islands: Sequence[str],
        parts: Sequence[Sequence[tuple[DeltaSource, float]]],
        segments: Sequence[Segment],
        outside: Sequence[Mapping[str, TensorPartial]] = (),
    ) -> None:
        super().__init__(parts[0][0][0].size)
        self.islands = tuple(islands)
        self.parts = [[(s, float(c)) for s, c in island] for island in parts]
        self.segments = list(segments)
        weights = [sum(c for _, c in island) for island in self.parts]  # C_i = sum_k c_ik
        self.weights = np.asarray(weights, dtype=np.float64)
        count = len(self.islands)
        grams: dict[str, np.ndarray] = {}
        keys = []
        for index, seg in enumerate(self.segments):
            key = seg.path or f"\0segment {index}"  # "" is a tensor of its own
            keys.append(key)
            if not seg.mean_only and count > 1:
                grams[key] = grams.get(key, 0.0) + self._gram(seg)
        self.partials = {
            key: TensorPartial(self.islands, gram) for key, gram in grams.items() if key[0] != "\0"
        }
        for key in list(grams):
            for more in outside:
                if key[0] != "\0" and key in more:
                    grams[key] = grams[key] + aligned_gram(more[key], self.islands, key)
        ones = np.ones(count)
        self.factors = [
            ones if seg.mean_only or count == 1 else rda_factors(grams[key], self.weights)
            for seg, key in zip(self.segments, keys, strict=True)
        ]

    def _island_piece(self, i: int, a: int, b: int, out: np.ndarray, scratch) -> None:
        """u_i over [a, b) into the float64 `out`: equal c_ik sum in float32 first, as v_i."""
        narrow, tmp, wide = (x[: b - a] for x in scratch)
        parts = self.parts[i]
        if all(c == parts[0][1] for _, c in parts):
            parts[0][0].decode_into(a, b, narrow)
            for part, _ in parts[1:]:
                part.decode_into(a, b, tmp)
                narrow += tmp
            np.copyto(out, narrow)
            out *= parts[0][1]
            return
        out[:] = 0.0
        for part, c in parts:
            part.decode_into(a, b, narrow)
            np.copyto(wide, narrow)
            wide *= c
            out += wide

    @staticmethod
    def _scratch(width: int):
        return np.empty(width, np.float32), np.empty(width, np.float32), np.empty(width)

    def _gram(self, seg: Segment) -> np.ndarray:
        count = len(self.islands)
        gram = np.zeros((count, count))
        width = min(PIECE, seg.stop - seg.start)
        scratch, rows = self._scratch(width), np.empty((count, width))
        for a, b in pieces(seg.start, seg.stop):
            for i in range(count):
                self._island_piece(i, a, b, rows[i, : b - a], scratch)
            block = rows[:, : b - a]
            gram += block @ block.T
        return gram

    def _fill(self, lo: int, hi: int, out: np.ndarray) -> None:
        width = min(PIECE, hi - lo)
        scratch, island, acc = self._scratch(width), np.empty(width), np.empty(width)
        for seg, factors in zip(self.segments, self.factors, strict=True):
            for a, b in pieces(max(lo, seg.start), min(hi, seg.stop)):
                n = b - a
                acc[:n] = 0.0
                for i, factor in enumerate(factors):
                    if factor == 0.0 or self.weights[i] == 0.0:
                        continue
                    self._island_piece(i, a, b, island[:n], scratch)
                    island[:n] *= factor
                    acc[:n] += island[:n]
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
    names = [str(i) for i in range(len(sources))]
    parts = [[(s, c)] for s, c in zip(sources, coefficients, strict=True)]
    return _RdaMerge(names, parts, segments).whole(out)


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


Coefficients = Sequence[float]  # one c_k per pending delta, aligned with the deltas


def _grouped(
    rule: str,
    deltas: Sequence[tuple[str, DeltaSource | np.ndarray]],
    coefficients: Coefficients,
    fragment: Fragment,
) -> list[tuple[str, DeltaSource, float]]:
    """(island, source, c_k) per delta, checked against the rule and the fragment."""
    if rule not in MERGES:
        raise MergeError(f"merge={rule!r} is unknown; choose one of {MERGES}")
    if not deltas:
        raise MergeError("a merge needs at least one delta")
    sources = [(island, as_source(d)) for island, d in deltas]
    if any(s.size != fragment.size for _, s in sources):
        sizes = sorted({s.size for _, s in sources})
        raise MergeError(
            f"deltas of sizes {sizes} for fragment {fragment.index} of {fragment.size}"
        )
    coef = list(coefficients)
    if len(coef) != len(sources):
        raise MergeError(f"{len(sources)} deltas but {len(coef)} coefficients")
    return [(island, s, c) for (island, s), c in zip(sources, coef, strict=True)]


def _rda(
    rows: Sequence[tuple[str, DeltaSource, float]],
    fragment: Fragment,
    outside: Sequence[Mapping[str, TensorPartial]] = (),
) -> _RdaMerge:
    per_island: dict[str, list[tuple[DeltaSource, float]]] = {}
    for island, source, c in rows:
        per_island.setdefault(island, []).append((source, c))
    _check_coefficients([c for _, _, c in rows])
    segments = fragment_segments(fragment)
    return _RdaMerge(list(per_island), list(per_island.values()), segments, outside)


def chunk_merge(
    rule: str,
    deltas: Sequence[tuple[str, DeltaSource | np.ndarray]],
    coefficients: Coefficients,
    fragment: Fragment,
    outside: Sequence[Mapping[str, TensorPartial]] = (),
) -> ChunkMerge:
    """A step's merged pseudo-gradient under a merge rule, to be written range by range.

    Args:
        rule: "mean" (sum of c_k * delta_k), "rda" or "median" (`median_merge`).
        deltas: (island, delta) of every pending delta the step merges; an
            island's deltas are disjoint increments, u_i = sum_k c_ik * d_ik (rda).
        coefficients: one c_k per delta, aligned with `deltas` (C_i = sum_k c_ik).
        fragment: the plan fragment (its slices are the RDA segments).
        outside: rda only: the partial sums (`rda_partials`) of the other pieces
            of this fragment's tensors, merging the same deltas; added to this
            fragment's own, they make the norms those of the whole tensors.

    Returns:
        A ChunkMerge of fragment.size elements: `fill(lo, hi, out)` writes its
        elements [lo, hi). The rda factors are computed here (one pass over
        the deltas); the sources must not change while it is used.

    Raises:
        MergeError: an unknown rule, no deltas, deltas of the wrong size, bad
            coefficients, or malformed partial sums.
    """
    rows = _grouped(rule, deltas, coefficients, fragment)
    if rule == "mean":
        return _MeanMerge([s for _, s, _ in rows], [c for _, _, c in rows])
    if rule == "median":
        return median_merge(rows)
    return _rda(rows, fragment, outside)


def rda_partials(
    deltas: Sequence[tuple[str, DeltaSource | np.ndarray]],
    coefficients: Coefficients,
    fragment: Fragment,
) -> dict[str, TensorPartial]:
    """RDA's partial sums of each (non-embedding) tensor over this fragment's piece of it.

    Args:
        deltas: (island, delta) as for `chunk_merge`.
        coefficients: as for `chunk_merge`.
        fragment: the plan fragment.

    Returns:
        Tensor path -> its `TensorPartial` (none when one island merges): what the
        steps of the tensor's other pieces take as `outside`.
    """
    rows = _grouped("rda", deltas, coefficients, fragment)
    return _rda(rows, fragment).partials


CANCEL_TOL = 1e-6  # |mean direction| / sum C_i below this: the directions cancel, use the mean


class MergeError(ValueError):
    """Deltas, coefficients, segments or partial sums that do not fit together."""


@dataclass(frozen=True)
class TensorPartial:
    """RDA's partial sums of one tensor over one piece of it: the islands' Gram matrix there.

    `gram[a, b]` = <u_a, u_b> over the piece (float64), u_i = sum_k c_ik * d_ik
    the island's coefficient-weighted deltas, islands in `islands` order. The
    Grams of a tensor's pieces add up to the whole tensor's, which is all RDA's
    factors need (`rda_partials`, `chunk_merge(..., outside=...)`).
    """

    islands: tuple[str, ...]
    gram: np.ndarray


def rda_factors(gram: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """RDA's factor a_i per island for one tensor: merged = sum_i a_i * u_i.

    With N = sum_i |u_i| and m = sum_i C_i * u_i / |u_i| (zero norms add nothing),
    merged = N * m / |m|, so a_i = N * C_i / (|u_i| * |m|); where |m| < 1e-6 * sum C_i
    (the directions cancel) or one island merges, every a_i is 1: the weighted mean.

    Args:
        gram: the islands' M x M Gram matrix <u_i, u_j> over the whole tensor.
        weights: C_i = sum_k c_ik per island.

    Returns:
        The M factors (float64).
    """
    count = len(weights)
    norms = np.sqrt(np.maximum(np.diag(gram), 0.0))
    inv = np.divide(weights, norms, out=np.zeros(count), where=norms > 0)  # C_i / |u_i|
    length = float(np.sqrt(max(float(inv @ gram @ inv), 0.0)))  # |m|
    if count == 1 or length < CANCEL_TOL * float(np.sum(weights)):
        return np.ones(count)
    return float(norms.sum()) * inv / length


def aligned_gram(partial: TensorPartial, islands: tuple[str, ...], path: str) -> np.ndarray:
    """A partial Gram laid out in `islands` order (its other islands dropped, missing ones 0)."""
    names, gram = tuple(partial.islands), np.asarray(partial.gram, dtype=np.float64)
    if len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
        raise MergeError(f"partial sums of {path!r}: islands {names!r} must be distinct ids")
    if gram.shape != (len(names), len(names)) or not np.all(np.isfinite(gram)):
        raise MergeError(
            f"partial sums of {path!r}: the Gram must be a finite {len(names)}x{len(names)} "
            f"matrix for islands {names!r}, got shape {gram.shape}"
        )
    if np.any(np.diag(gram) < 0):
        raise MergeError(f"partial sums of {path!r}: negative squared norms {np.diag(gram)}")
    where = [names.index(n) if n in names else -1 for n in islands]
    out = np.zeros((len(islands), len(islands)))
    for a, x in enumerate(where):
        for b, y in enumerate(where):
            if x >= 0 and y >= 0:
                out[a, b] = gram[x, y]
    return out
