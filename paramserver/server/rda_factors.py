"""RDA's per-tensor arithmetic: the factors from a Gram matrix, and the partial sums' form.

`paramserver.server.merge` explains the rule and uses these; they are pure
numpy on M x M matrices (M islands), apart from the deltas themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
