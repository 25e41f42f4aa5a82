"""Two models' parameter leaves compared, in words: sizes and the first leaf that differs.

A plan mismatch (an island's model against a cluster's) and `diloco-worker
eval` against a cluster of another model both say which models they are
(parameter count, leaf count) and where they first differ (path, dtype and
shape on both sides), not only that two hashes differ. Pure functions over
any objects with ``path``, ``shape`` and ``dtype`` (`paramserver.wire.plan.LeafSpec`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

FRESH_CLUSTER = "train a new model on a new cluster (diloco-server start with a fresh --data-dir)"


def model_size(leaves: Sequence[Any]) -> str:
    """`leaves` in a few words, e.g. "131,712 parameters in 12 leaves".

    Args:
        leaves: leaf specs (path, shape, dtype).

    Returns:
        The phrase.
    """
    count = sum(math.prod(int(d) for d in leaf.shape) for leaf in leaves)
    return f"{count:,} parameters in {len(leaves)} leaves"


def first_difference(ours: Sequence[Any], theirs: Sequence[Any], here: str, there: str) -> str:
    """The first leaf, in path order, where two models differ.

    Args:
        ours: one model's leaf specs.
        theirs: the other's.
        here: what `ours` is called, e.g. "here" or "in model 'small'".
        there: what `theirs` is called, e.g. "in the cluster's model".

    Returns:
        e.g. "leaf 'embed' is float32[256, 128] here, float32[256, 64] in the cluster's
        model"; "the same leaves" when none differs.
    """
    mine, other = {leaf.path: leaf for leaf in ours}, {leaf.path: leaf for leaf in theirs}
    for path in sorted(set(mine) | set(other)):
        a, b = mine.get(path), other.get(path)
        if a is None:
            return f"leaf {path!r} is {there} only"
        if b is None:
            return f"leaf {path!r} is {here} only"
        if tuple(a.shape) != tuple(b.shape) or str(a.dtype) != str(b.dtype):
            return (
                f"leaf {path!r} is {a.dtype}{list(a.shape)} {here}, "
                f"{b.dtype}{list(b.shape)} {there}"
            )
    return "the same leaves"
