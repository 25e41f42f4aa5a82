"""What an island sends and how it folds a published version into its local parameters.

Per fragment an island keeps three 1-D float32 vectors:

- `base`: the global values of the version its next delta is computed against;
- `anchor`: the local values already accounted for (sent in a delta, or
  adopted from the global state), so progress since the anchor is unsent work;
- the local values themselves (inside the trainer).

At the end of a round the island sends ``delta = base - local`` (the
pseudo-gradient) and moves its anchor to the local values. When a new global
version G arrives it adopts G and keeps the local progress made since the
anchor: ``local = G + (local - anchor)``; then ``base = anchor = G``. Nothing is
counted twice (progress before the anchor reaches the model through the sent
delta) and nothing is thrown away. The "overwrite" rule, ``local = G``, is the
ablation: it discards the work done between the push and the adoption.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MERGE_RULES = ("keep-progress", "overwrite")


class ExchangeError(ValueError):
    """An exchange setting or input is invalid."""


def check_merge_rule(rule: str) -> str:
    """Validate a merge rule name.

    Args:
        rule: one of `MERGE_RULES`.

    Returns:
        The rule, unchanged.
    """
    if rule not in MERGE_RULES:
        raise ExchangeError(f"unknown merge rule {rule!r}: use one of {', '.join(MERGE_RULES)}")
    return rule


def take_delta(base: np.ndarray, local: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The pseudo-gradient of one fragment: global base minus local values.

    Args:
        base: 1-D float32 global values the round started from.
        local: 1-D float32 current local values.
        out: optional float32 buffer of the same shape to write into.

    Returns:
        ``base - local`` as float32.
    """
    if base.shape != local.shape:
        raise ExchangeError(f"base shape {base.shape} differs from local shape {local.shape}")
    return np.subtract(base, local, out=out, dtype=np.float32)


def fold_update(
    local: np.ndarray, anchor: np.ndarray, global_values: np.ndarray, rule: str
) -> np.ndarray:
    """Local values after adopting a new global version.

    Args:
        local: 1-D float32 current local values.
        anchor: 1-D float32 values already accounted for (see module docstring).
        global_values: 1-D float32 new global values.
        rule: "keep-progress" (global + local progress since the anchor) or "overwrite".

    Returns:
        New 1-D float32 local values (a fresh array).
    """
    check_merge_rule(rule)
    if not (local.shape == anchor.shape == global_values.shape):
        raise ExchangeError(
            f"shapes differ: local {local.shape}, anchor {anchor.shape}, global {global_values.shape}"
        )
    if rule == "overwrite":
        return np.array(global_values, dtype=np.float32, copy=True)
    progress = np.subtract(local, anchor, dtype=np.float32)
    return np.add(global_values, progress, out=progress)


@dataclasses.dataclass
class FragmentSync:
    """Bookkeeping of one fragment: the base the next delta refers to, and the anchor.

    Attributes:
        base: global values of `base_version` (1-D float32).
        base_version: version of `base` on the server.
        anchor: local values already accounted for (1-D float32).
    """

    base: np.ndarray
    base_version: int
    anchor: np.ndarray

    @classmethod
    def start(cls, values: np.ndarray, version: int) -> FragmentSync:
        """Bookkeeping right after adopting `values` (e.g. from the join snapshot)."""
        values = np.array(values, dtype=np.float32, copy=True)
        return cls(base=values, base_version=version, anchor=values.copy())

    def sent(self, local: np.ndarray) -> None:
        """Record that the progress up to `local` went out in a delta."""
        np.copyto(self.anchor, local)

    def adopt(self, local: np.ndarray, global_values: np.ndarray, version: int, rule: str):
        """Adopt a new global version; returns the new local values.

        Args:
            local: current local values of this fragment.
            global_values: the new global values.
            version: their version.
            rule: merge rule (see `fold_update`).

        Returns:
            New local values (1-D float32).
        """
        new_local = fold_update(local, self.anchor, global_values, rule)
        np.copyto(self.base, global_values)
        np.copyto(self.anchor, global_values)
        self.base_version = version
        return new_local
