"""The outer step of sparse codecs (SparseLoCo): a per-entry merge and SGD without momentum.

A sparse delta (codec `topk`: each island sends ~2% of the entries and keeps
the rest in its error-feedback buffer) says nothing about the entries it did
not send. The weighted mean of `paramserver.server.step.merge` treats those as
zeros, so an entry sent by one of three equal islands lands at a third of
its value while the island's error feedback assumes it was applied whole:
the other two thirds are lost. Here each entry is averaged over the islands
that sent it. With per-delta coefficients c_ik (island i, its k-th pending
delta, aligned with the deltas: the S1 contract of `chunk_merge`), island
i's vector u_i = sum_k c_ik * d_ik and its weight p_i::

    merged[e] = sum_{i sent e} u_i[e] / sum_{i sent e} p_i

where "i sent e" means some delta of island i is nonzero at e (a topk entry
is listed; an unlisted one decodes to exactly 0). In the shard's step
(`fragment_step`) c_ik = w_i * g(s_ik) without the step's share of a round
(`weighting.merge_coefficients(..., scale_by_share=False)`) and p_i = w_i, the
island's work weight: an entry island i alone sent lands at
sum_k g(s_ik) * d_ik[e], its value damped by its own staleness only, whatever
the mode (async and quorum-1 steps, which merge one island of N, applied it
at about g/N before: applied/sent 0.446 against 0.900 in sync). An entry
every island sent is merged as the mean is (`sum_i u_i[e]`). Entries nobody
sent stay 0. Given no weights, p_i = W_i / sum_j W_j with W_i = mean_k c_ik.

No outer momentum: the islands' error feedback already re-sends what was not
applied, so a momentum buffer replays it a second time (every momentum variant
of the issue-22 simulation rose late in a run; SGD decreased steadily). A
shard knows a step is sparse from its pending deltas' codec (`paramserver.server.fragment.is_sparse`:
every delta merged is topk-coded) and then steps with plain SGD at
`ShardConfig.sparse_outer_lr` (default 1.0, the issue-22 simulation's value;
`diloco-bench topk_outer` sweeps it). A cluster
whose islands all run `--codec topk` thus has one outer optimizer for the
whole run; islands of one cluster are meant to share a codec (a step mixing
topk and dense deltas takes the dense mean and the configured optimizer).

`SparseMerge.fill(lo, hi, out)` computes each element from its own inputs
only (float64 sums in delta order), so any split of [0, size) gives the same
bits as one fill of the whole. A sparse step's int8 update is published with
zstd (SPARSE_PUBLISH_ZSTD_LEVEL): the union of the entries sent is a few
percent of the fragment, so its codes are mostly zeros.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import optax

from paramserver.server.step.merge import (
    PIECE,
    ChunkMerge,
    DeltaSource,
    MergeError,
    as_source,
    pieces,
)

# zstd level of a sparse step's published int8 update: its codes are mostly zeros, which
# zstd level 1 shrinks ~6x (134 KB -> 22 KB for 6% nonzero entries of 131,712); the dense
# updates of other steps publish without zstd (paramserver.server.step.downlink)
SPARSE_PUBLISH_ZSTD_LEVEL = 1


def sparse_optimizer(lr: float) -> optax.GradientTransformation:
    """The outer optimizer of sparse steps: plain SGD (no momentum) at `lr`.

    Args:
        lr: the outer learning rate (`ShardConfig.sparse_outer_lr`).

    Returns:
        optax.sgd(lr).
    """
    return optax.sgd(lr)


class SparseMerge(ChunkMerge):
    """Per entry, the coefficient-weighted mean over the islands that sent it (module docstring)."""

    def __init__(
        self,
        islands: Sequence[Sequence[tuple[DeltaSource, float]]],
        weights: Sequence[float] | None = None,
    ) -> None:
        """Build the merge.

        Args:
            islands: per island, its (delta, coefficient) pairs in delta order.
            weights: p_i per island (> 0, normalised here); None: from the
                coefficients, W_i = mean_k c_ik.
        """
        super().__init__(islands[0][0][0].size)
        self.islands = [list(parts) for parts in islands]
        if weights is None:
            weights = [np.mean([c for _, c in parts]) for parts in self.islands]
        p = np.asarray(weights, dtype=np.float64)
        self.shares = p / p.sum()  # p_i

    def _fill(self, lo: int, hi: int, out: np.ndarray) -> None:
        width = min(PIECE, hi - lo)
        narrow = np.empty(width, np.float32)
        wide, acc, den = np.empty(width), np.empty(width), np.empty(width)
        sent = np.empty(width, np.bool_)
        for a, b in pieces(lo, hi):
            n = b - a
            acc[:n] = 0.0
            den[:n] = 0.0
            for parts, share in zip(self.islands, self.shares, strict=True):
                sent[:n] = False
                for source, coefficient in parts:
                    source.decode_into(a, b, narrow[:n])
                    sent[:n] |= narrow[:n] != 0
                    np.multiply(narrow[:n], np.float64(coefficient), out=wide[:n])
                    acc[:n] += wide[:n]
                den[:n] += np.where(sent[:n], share, 0.0)
            np.divide(acc[:n], den[:n], out=acc[:n], where=den[:n] > 0)
            np.copyto(out[a - lo : b - lo], acc[:n], casting="same_kind")


def sparse_merge(
    deltas: Sequence[tuple[str, DeltaSource | np.ndarray]],
    coefficients: Sequence[float],
    size: int,
    weights: dict[str, float] | None = None,
) -> SparseMerge:
    """A sparse step's merged pseudo-gradient, to be written range by range.

    Args:
        deltas: (island, delta) of every pending delta the step merges; an
            island's deltas are disjoint increments and are summed.
        coefficients: one c_ik per delta, aligned with `deltas`, >= 0 with a positive sum.
        size: the fragment's element count.
        weights: island -> p_i, its work weight (each > 0; the shard's step
            passes w_i: the module docstring); None: W_i = mean_k c_ik.

    Returns:
        A SparseMerge of `size` elements (`fill(lo, hi, out)`).

    Raises:
        MergeError: no deltas, a count or size mismatch, or bad coefficients.
    """
    if not deltas or len(deltas) != len(coefficients):
        raise MergeError(f"{len(deltas)} deltas but {len(coefficients)} coefficients")
    coef = np.asarray(coefficients, dtype=np.float64)
    if not np.all(np.isfinite(coef)) or np.any(coef < 0) or float(coef.sum()) <= 0:
        raise MergeError(f"coefficients {list(coefficients)} must be >= 0 with a positive sum")
    per_island: dict[str, list[tuple[DeltaSource, float]]] = {}
    for (island, delta), c in zip(deltas, coefficients, strict=True):
        source = as_source(delta)
        if source.size != size:
            raise MergeError(f"a delta of {source.size} elements for a fragment of {size}")
        per_island.setdefault(island, []).append((source, float(c)))
    kept = [island for island, parts in per_island.items() if sum(c for _, c in parts) > 0]
    if weights is not None:
        missing = [i for i in kept if not (weights.get(i, 0.0) > 0 and np.isfinite(weights[i]))]
        if missing:
            raise MergeError(f"islands {missing} need a finite work weight > 0")
    return SparseMerge(
        [per_island[i] for i in kept], None if weights is None else [weights[i] for i in kept]
    )
