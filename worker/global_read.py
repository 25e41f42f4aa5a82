"""The cluster's global model read from the shards, as the user's own pytree (`worker.global_model`).

One call for the final model of a run: wait until every shard has merged every
delta it acked (after the islands closed), read a snapshot of every fragment from
its owning shard (`paramserver.plumbing.probe`, the reads of the final eval) and
rebuild the tree of `like` with `worker.param_tree.TreeLayout`, the naming rule
`worker.join` uses: same pytree type and structure, each leaf in `like`'s dtype and
placed on `like`'s sharding (numpy leaves stay numpy). It joins no island: the
shards see only status and snapshot requests, and a hello under a probe id.

`global_flat` is the same read without a tree: the plan's flat {"a/b": float32
array} mapping, which `diloco-worker export` writes as an Orbax checkpoint; it
imports no JAX.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np

from paramserver.plumbing import probe
from paramserver.plumbing.curve import ClientKeys, CurveError
from paramserver.plumbing.exposure import plain_tcp_problem
from paramserver.plumbing.peer_peek import silence_cause
from paramserver.plumbing.validate import endpoint_problem

WAIT_S = 60.0  # how long `global_model` waits for the shards to merge what they acked
PEEK_S = 1.0  # a first look at `connect`: a server that is down fails at once, not after a timeout


@dataclasses.dataclass(eq=False)
class GlobalModelError(RuntimeError):
    """The global model could not be read: a shard is down or silent, the cluster is not
    initialized, deltas stayed pending, or plain TCP to a host that is not loopback.

    Attributes:
        connect: the endpoint the read started from.
        detail: what went wrong, naming the shard's endpoint where one failed.
    """

    connect: str
    detail: str

    def __str__(self) -> str:
        return f"cannot read the global model from {self.connect}: {self.detail}"


@dataclasses.dataclass(frozen=True)
class FlatModel:
    """The global parameters as the plan names them.

    Attributes:
        params: {"a/b": float32 array of the leaf's shape}, one entry per leaf.
        versions: {fragment index: version of the values read}.
    """

    params: dict[str, np.ndarray]
    versions: dict[int, int]

    @property
    def version(self) -> int:
        """The sum of the fragments' versions (what `Session.version` counts)."""
        return int(sum(self.versions.values()))


def global_flat(
    connect: str,
    *,
    wait_merged: bool = True,
    wait_s: float = WAIT_S,
    stop: threading.Event | None = None,
    curve_secret_key_file: str = "",
    curve_server_key_file: str = "",
    island: str | None = None,
    insecure: bool = False,
) -> FlatModel:
    """The global parameters as flat float32 arrays, read from the shards.

    Args:
        connect: ROUTER endpoint of any shard, e.g. "tcp://127.0.0.1:5555".
        wait_merged: first wait until no shard holds an acked but unmerged delta
            (call it after the islands closed); False reads what is there now.
        wait_s: how long to wait for that.
        stop: an event that, once set, ends the wait (GlobalModelError).
        curve_secret_key_file: an island's CURVE secret key file ("" = plain TCP).
        curve_server_key_file: the server's public key file (with the secret key).
        island: the id the hello of a CURVE read says (an id its key may act as, not
            live elsewhere); None = a probe id of its own.
        insecure: allow plain TCP to a host that is not loopback.

    Returns:
        The `FlatModel` (params by plan name, versions per fragment).

    Raises:
        ValueError: `connect` is not a tcp:// or ipc:// endpoint (naming what is wrong).
        GlobalModelError: see the class (one line, naming the endpoint).
    """
    malformed = endpoint_problem(connect, ("tcp://", "ipc://"))
    if malformed is not None:
        raise ValueError(f"connect={connect!r} is not a shard's endpoint: {malformed}")
    problem = plain_tcp_problem(connect, curve=bool(curve_secret_key_file), insecure=insecure)
    if problem is not None:
        raise GlobalModelError(
            connect, f"{problem}; give an island's CURVE key files, or insecure=True"
        )
    cause = silence_cause(connect, PEEK_S, curve=bool(curve_secret_key_file))
    if cause is not None:  # nothing listens there, or not a shard's ROUTER: say so at once
        raise GlobalModelError(connect, cause)
    try:
        curve = (
            ClientKeys.load(curve_secret_key_file, curve_server_key_file)
            if curve_secret_key_file
            else None
        )
        if wait_merged:
            probe.wait_merged(connect, wait_s, stop=stop, curve=curve)
        _plan, flat, versions = probe.global_params(connect, curve=curve, island=island)
    except (probe.ProbeError, CurveError) as exc:
        raise GlobalModelError(connect, str(exc)) from None
    return FlatModel(flat, {int(f): int(v) for f, v in versions.items()})


def global_model(
    connect: str,
    like: Any,
    wait_merged: bool = True,
    *,
    wait_s: float = WAIT_S,
    stop: threading.Event | None = None,
    **read: Any,
) -> tuple[Any, int]:
    """The cluster's global model as a tree like `like`, and its version.

    Args:
        connect: ROUTER endpoint of any shard, e.g. "tcp://127.0.0.1:5555".
        like: a params pytree of the cluster's model (the tree given to `worker.join`);
            only its structure, shapes, dtypes and placements are used.
        wait_merged: first wait until every acked delta is merged (do this after the
            islands closed, for the final model); False reads the shards' values now.
        wait_s: how long to wait for the merge.
        stop: an event that, once set, ends the wait.
        **read: `global_flat`'s CURVE and plain-TCP options (curve_secret_key_file,
            curve_server_key_file, island, insecure).

    Returns:
        (params, version): params has `like`'s pytree type and structure, each leaf
        `like`'s dtype (the shards keep float32; a bfloat16 leaf is rounded) on
        `like`'s sharding (a numpy leaf comes back as numpy); version is the sum over
        fragments of the version read, as `Session.version` counts it (fragments step
        on their own; the sum grows by one at every outer step of any fragment, and
        `global_flat(...).versions` has the version of each).

    Raises:
        TreeError (a ValueError): `like` is not a tree of floating arrays, or it
            differs from the cluster's model (naming the first differing leaf).
        ValueError: `connect` is not a tcp:// or ipc:// endpoint.
        GlobalModelError: a shard is down or silent, the cluster is not initialized,
            or deltas stayed pending past `wait_s` (one line, naming the endpoint).
    """
    from worker.param_tree import TreeError, TreeLayout  # JAX: `global_flat` needs none

    layout = TreeLayout.of(like)
    model = global_flat(connect, wait_merged=wait_merged, wait_s=wait_s, stop=stop, **read)
    theirs = [_Spec(name, value.shape) for name, value in model.params.items()]
    ours = dataclasses.replace(layout, dtypes=tuple(np.dtype(np.float32) for _ in layout.dtypes))
    difference = ours.first_difference(theirs)  # the shards hold every leaf as float32
    if difference is not None:
        raise TreeError(f"like differs from the model of the cluster at {connect}: {difference}")
    return layout.build(model.params), model.version


@dataclasses.dataclass(frozen=True)
class _Spec:
    """A leaf as `TreeLayout.first_difference` compares it: path, shape, dtype name."""

    path: str
    shape: tuple[int, ...]
    dtype: str = "float32"
