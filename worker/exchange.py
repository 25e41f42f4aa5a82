"""What an island sends and how it folds a published version into its local parameters.

Per fragment an island keeps three 1-D float32 vectors:

- `base`: the global values of the newest version it adopted (`base_version`);
- `anchor`: the local values already accounted for (sent in a delta, or
  adopted from the global state), so progress since the anchor is unsent work;
- the local values themselves (inside the trainer).

At the end of a round the island sends ``delta = anchor - local`` (the
pseudo-gradient of the work not sent yet; right after an adoption the anchor is
the global base, so this is the usual ``base - local``) and moves its anchor to
the local values. Two rounds pushed without a new version in between thus send
disjoint progress, never the first round's work twice. When a new global
version G arrives the island adopts G and keeps the local progress made since
the anchor: ``local = G + (local - anchor)``; then ``base = anchor = G``.
Nothing is counted twice (progress before the anchor reaches the model through
the sent deltas) and nothing is thrown away. The "overwrite" rule, ``local =
G``, is the ablation: it discards the work done between the push and the
adoption.

The rule is written once, as plain array arithmetic (`delta_since`, `folded`):
the host exchange runs it on numpy vectors (`FragmentSync`), the device
exchange (`worker.device_exchange`) on traced JAX arrays inside its jitted push
and folds, with the same float32 operations.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MERGE_RULES = ("keep-progress", "overwrite")


class ExchangeError(ValueError):
    """An exchange setting or input is invalid."""


class UnfoldableUpdate(ExchangeError):
    """A published version the exchange cannot fold in: it holds neither codes that follow
    the adopted version nor full values of the fragment's size.

    Attributes:
        fragment: the update's fragment.
        version: the update's version.
        held_version: the fragment's version the exchange holds (codes must follow it).
        has_increment: the update carries increment codes (of another base version).
        values_size: the length of its values, None without values.
        fragment_size: the length its values must have.
    """

    def __init__(
        self,
        fragment: int,
        version: int,
        held_version: int,
        has_increment: bool,
        values_size: int | None,
        fragment_size: int,
    ) -> None:
        codes = (
            f"its increment codes follow version {version - 1}, not {held_version}"
            if has_increment
            else "it has no increment codes"
        )
        values = (
            "no values"
            if values_size is None
            else f"{values_size} values, not the fragment's {fragment_size}"
        )
        super().__init__(
            f"update of fragment {fragment} to version {version} cannot be folded in: "
            f"{codes} and {values} (a client kept for increments hands out full values "
            "after a gap)"
        )
        self.fragment, self.version, self.held_version = fragment, version, held_version
        self.has_increment, self.values_size = has_increment, values_size
        self.fragment_size = fragment_size


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


def delta_since(anchor, local):
    """The rule's delta: ``anchor - local``, the work not sent yet (its one definition).

    Plain array arithmetic, so the host path (numpy) and the device path (traced
    JAX arrays inside `worker.device_exchange`'s jitted push) compute it alike.

    Args:
        anchor: float32 values already accounted for.
        local: float32 current local values (same shape).

    Returns:
        ``anchor - local`` (float32).
    """
    return anchor - local


def folded(local, anchor, new_global, rule: str):
    """The rule's fold of a new global version into the local values (its one definition).

    Plain array arithmetic, for numpy (`fold_update`) and traced JAX arrays
    (`worker.device_exchange`'s jitted folds) alike.

    Args:
        local: float32 current local values.
        anchor: float32 values already accounted for.
        new_global: float32 new global values.
        rule: "keep-progress" (``new_global + (local - anchor)``) or "overwrite"
            (``new_global`` itself, not a copy).

    Returns:
        The new local values.
    """
    if check_merge_rule(rule) == "overwrite":
        return new_global
    return new_global + (local - anchor)


def take_delta(base: np.ndarray, local: np.ndarray) -> np.ndarray:
    """The pseudo-gradient of one fragment: reference values minus local values.

    Args:
        base: 1-D float32 reference values (an island passes its anchor: the
            values already accounted for).
        local: 1-D float32 current local values.

    Returns:
        ``base - local`` as a fresh float32 array (`delta_since`).
    """
    if base.shape != local.shape:
        raise ExchangeError(f"base shape {base.shape} differs from local shape {local.shape}")
    return delta_since(np.asarray(base, np.float32), np.asarray(local, np.float32))


def fold_update(
    local: np.ndarray, anchor: np.ndarray, global_values: np.ndarray, rule: str
) -> np.ndarray:
    """Local values after adopting a new global version (`folded`, in numpy).

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
    new_global = np.asarray(global_values, np.float32)
    out = folded(np.asarray(local, np.float32), np.asarray(anchor, np.float32), new_global, rule)
    return out.copy() if out is new_global else out


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

    def take(self, local: np.ndarray) -> np.ndarray:
        """The delta to send now (the work since the anchor); moves the anchor to `local`.

        Args:
            local: current local values of this fragment.

        Returns:
            ``anchor - local`` as a fresh float32 array.
        """
        delta = take_delta(self.anchor, local)
        np.copyto(self.anchor, local)
        return delta

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
