"""Where an island's parameters and optimizer state live on its mesh.

Two layouts over the island's 1-D mesh (axis "data", every device of every process):

- ``replicated``: every device holds a full copy (plain data parallel).
- ``fsdp``: each array is cut along its largest dimension that the device count
  divides, one slice per device; arrays with no such dimension (scalars, small
  vectors) stay replicated. AdamW's moments have the parameters' shapes, so the
  same rule shards them the same way.

The rule is a pure function of a shape and the device count, so the parameters,
the optimizer state and a memory report all agree without passing specs around.
Nothing here names a device type.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from worker.config import PARAM_SHARDINGS

AXIS = "data"


def fsdp_spec(shape: tuple[int, ...], devices: int) -> PartitionSpec:
    """The fsdp partition of one array: its largest dimension divisible by `devices`.

    Args:
        shape: the array's shape.
        devices: number of devices on the mesh axis.

    Returns:
        A PartitionSpec naming AXIS at that dimension (the first of equal sizes),
        or PartitionSpec() (replicated) when no dimension is divisible or devices == 1.
    """
    if devices <= 1:
        return PartitionSpec()
    best = -1
    for dim, size in enumerate(shape):
        if size % devices == 0 and (best < 0 or size > shape[best]):
            best = dim
    if best < 0:
        return PartitionSpec()
    return PartitionSpec(*([None] * best), AXIS)


def leaf_spec(shape: tuple[int, ...], devices: int, mode: str) -> PartitionSpec:
    """The partition of one array under a layout.

    Args:
        shape: the array's shape.
        devices: number of devices on the mesh axis.
        mode: "replicated" or "fsdp".

    Returns:
        The PartitionSpec for that array.
    """
    if mode not in PARAM_SHARDINGS:
        raise ValueError(f"param sharding must be one of {PARAM_SHARDINGS}, got {mode!r}")
    return fsdp_spec(shape, devices) if mode == "fsdp" else PartitionSpec()


def tree_shardings(tree: Any, mesh: Mesh, mode: str) -> Any:
    """NamedShardings for every leaf of a tree (arrays or ShapeDtypeStructs).

    Args:
        tree: a pytree whose leaves have a `.shape` (or are Python scalars).
        mesh: the island's mesh (1-D, axis AXIS).
        mode: "replicated" or "fsdp".

    Returns:
        A tree of the same structure holding NamedShardings.
    """
    devices = mesh.shape[AXIS]
    return jax.tree_util.tree_map(
        lambda leaf: NamedSharding(
            mesh, leaf_spec(tuple(getattr(leaf, "shape", ())), devices, mode)
        ),
        tree,
    )


def bytes_per_device(*trees: Any) -> dict[str, int]:
    """Bytes each device holds for the jax arrays of some trees (local devices only).

    Args:
        trees: pytrees of jax arrays (e.g. parameters and optimizer state).

    Returns:
        str(device) -> bytes of the shards that live on it, for this process's devices.
    """
    held: dict[str, int] = defaultdict(int)
    for tree in trees:
        for leaf in jax.tree_util.tree_leaves(tree):
            for shard in getattr(leaf, "addressable_shards", ()):
                held[str(shard.device)] += shard.data.nbytes
    return dict(held)
