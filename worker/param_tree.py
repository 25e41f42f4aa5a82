"""A user's parameter pytree as the flat {name: array} mapping the parameter server's plan uses.

Any JAX pytree of floating arrays works (dicts, lists, tuples, NamedTuples,
registered dataclasses, Flax NNX ``State``): `TreeLayout.of` flattens it with
`jax.tree_util.tree_flatten_with_path` and names every leaf by its path, the
keys joined with "/" (dict keys, sequence indexes, attribute names), so a
nested dict gets the names `codec.flatten` gives it. The layout remembers the
tree's structure, each leaf's shape, dtype and (for a `jax.Array`) sharding,
checks that later trees match it (a `ValueError` naming the first differing
path), and rebuilds the same pytree type from flat host values, placed like
the original leaves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np


class TreeError(ValueError):
    """A parameter tree cannot be used or does not match; the message names the path."""


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):  # DictKey, SequenceKey / FlattenedIndexKey, GetAttrKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_name(path: tuple) -> str:
    """The plan name of a leaf: its path keys joined with "/".

    Args:
        path: a key path from `jax.tree_util.tree_flatten_with_path`.

    Returns:
        e.g. "layers/0/w"; "." for the root of a tree that is a single array.
    """
    return "/".join(_key_name(k) for k in path) or "."


def _is_floating(dtype: np.dtype) -> bool:
    return np.issubdtype(dtype, np.floating) or (dtype.kind == "V" and "float" in dtype.name)


def _first_other_name(expected: tuple[str, ...], got: list[str]) -> str:
    for a, b in zip(expected, got, strict=False):
        if a != b:
            return repr(a)
    if len(expected) != len(got):
        return repr((expected if len(expected) > len(got) else got)[min(len(expected), len(got))])
    return "a node of another type (same leaf names)"


@dataclasses.dataclass(frozen=True)
class TreeLayout:
    """What a parameter tree looks like: structure, leaf names, shapes, dtypes, placements."""

    treedef: Any
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    shardings: tuple[Any, ...]  # a leaf's jax sharding, or None for a host array

    @classmethod
    def of(cls, tree: Any) -> TreeLayout:
        """The layout of a parameter tree.

        Args:
            tree: a pytree whose leaves are floating arrays (jax or numpy).

        Returns:
            Its layout.

        Raises:
            TreeError: the tree is empty, a leaf is not an array or not floating,
                or two leaves get the same name.
        """
        pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
        if not pairs:
            raise TreeError("params has no array leaves; pass the model's parameter pytree")
        names, shapes, dtypes, shardings = [], [], [], []
        for path, leaf in pairs:
            name = leaf_name(path)
            if not isinstance(leaf, jax.Array | np.ndarray | np.generic):
                raise TreeError(
                    f"params leaf {name!r} is a {type(leaf).__name__}, not an array: "
                    "keep only the parameters' arrays in the tree"
                )
            if not _is_floating(leaf.dtype):
                raise TreeError(
                    f"params leaf {name!r} has dtype {leaf.dtype}: only floating arrays are "
                    "synchronised; keep counters and integer state out of the tree"
                )
            names.append(name)
            shapes.append(tuple(int(d) for d in leaf.shape))
            dtypes.append(np.dtype(leaf.dtype))
            shardings.append(leaf.sharding if isinstance(leaf, jax.Array) else None)
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise TreeError(f"two params leaves are both named {name!r}; rename one key")
            seen.add(name)
        return cls(treedef, tuple(names), tuple(shapes), tuple(dtypes), tuple(shardings))

    def leaves(self, tree: Any) -> list[Any]:
        """The leaves of a tree that must match this layout (no copy, no transfer).

        Args:
            tree: a pytree of the same structure, shapes and dtypes.

        Returns:
            Its leaves in layout order.

        Raises:
            TreeError: the structure, a shape or a dtype differs (naming the path).
        """
        leaves, treedef = jax.tree_util.tree_flatten(tree)  # cheaper than with paths
        if treedef != self.treedef:
            pairs, _ = jax.tree_util.tree_flatten_with_path(tree)
            where = _first_other_name(self.names, [leaf_name(p) for p, _ in pairs])
            raise TreeError(
                f"params tree differs from the session's at {where}: expected structure "
                f"{self.treedef}, got {treedef}"
            )
        for name, leaf, shape, dtype in zip(
            self.names, leaves, self.shapes, self.dtypes, strict=True
        ):
            got_shape, got_dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
            if got_shape != shape or got_dtype != dtype:
                got = f"{got_dtype}{list(got_shape)}" if got_shape is not None else repr(leaf)
                raise TreeError(
                    f"params leaf {name!r} is {got}, the session's is {dtype}{list(shape)}"
                )
        return leaves

    def first_difference(self, leaves: list[Any]) -> str | None:
        """The first leaf (path, shape or dtype) where a cluster's leaf specs differ from ours.

        Args:
            leaves: the cluster's `LeafSpec`s (path, shape, dtype name).

        Returns:
            A phrase naming the difference, or None when they agree.
        """
        theirs = {leaf.path: leaf for leaf in leaves}
        for name, shape, dtype in sorted(zip(self.names, self.shapes, self.dtypes, strict=True)):
            spec = theirs.pop(name, None)
            if spec is None:
                return f"leaf {name!r} is not in the cluster's model"
            if tuple(spec.shape) != shape or spec.dtype != str(dtype):
                return (
                    f"leaf {name!r} is {dtype}{list(shape)} here, "
                    f"{spec.dtype}{list(spec.shape)} in the cluster's model"
                )
        if theirs:
            return f"the cluster's model has leaf {sorted(theirs)[0]!r}, which params lacks"
        return None

    def to_host(self, leaves: list[Any]) -> dict[str, np.ndarray]:
        """Host float32 copies of the leaves, by name (a device-to-host transfer).

        Args:
            leaves: from `leaves`; a sharded array spanning processes must be fully
                replicated or gathered first (`worker.leader_sync.gather`).

        Returns:
            name -> a fresh float32 array of the leaf's shape.
        """
        return {
            name: np.array(leaf, dtype=np.float32, copy=True)
            for name, leaf in zip(self.names, leaves, strict=True)
        }

    def build(self, flat: Mapping[str, np.ndarray], place: bool = True) -> Any:
        """The tree of this layout holding `flat`'s values.

        Args:
            flat: name -> host array of the leaf's shape (any float dtype).
            place: put each value where the original leaf lived (its sharding, its
                dtype); False gives numpy leaves of the original dtypes.

        Returns:
            A pytree of the original type.
        """
        out = []
        for name, dtype, sharding in zip(self.names, self.dtypes, self.shardings, strict=True):
            if place and sharding is not None:
                host = np.asarray(flat[name]).astype(dtype, copy=False)
                out.append(
                    jax.make_array_from_callback(host.shape, sharding, lambda i, h=host: h[i])
                )
            else:  # a fresh array, in one copy
                out.append(np.array(flat[name], dtype=dtype, copy=True))
        return jax.tree_util.tree_unflatten(self.treedef, out)
