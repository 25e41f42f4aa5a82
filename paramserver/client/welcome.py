"""What a shard's welcome tells an island, checked against the island's own plan.

This module owns, with no I/O (but the name lookup of a shard given by host
name in a plain-TCP cluster), the checks of a `welcome` reply: the cluster
map, whether this client may reach every shard it names (plain TCP only on
loopback unless `insecure`), and the plan this island computes from it
(`read_welcome`), whether a shard is initialised with that plan
(`shard_initialized`), the size limit it announces (`welcome_limit`), the
welcome of a shard said hello to again after a reconnect (`check_rewelcome`),
and the error message of a plan mismatch.
The join's handshake (`paramserver.client.handshake`) and the client's core
(`paramserver.client.core`) call them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from paramserver.client.types import ClientConfig, ClientError, PlanMismatch
from paramserver.plumbing.model_diff import FRESH_CLUSTER, first_difference, model_size
from paramserver.wire.plan import LeafSpec, Plan, PlanError, leaf_specs, make_plan


def leaves_of(flat: Mapping[str, np.ndarray]) -> list[LeafSpec]:
    """The leaf specs of this island's parameters (checked before anything is sent)."""
    try:
        return leaf_specs(flat)
    except (PlanError, ValueError, TypeError) as exc:
        raise ClientError(f"join: cannot use these parameters: {exc}") from None


@dataclass(frozen=True)
class Cluster:
    """What the first shard's welcome says about the cluster, checked against this island."""

    plan: Plan  # this island's plan over the cluster's shards and fragments
    endpoints: list[tuple[str, str]]  # (ROUTER, PUB) of every shard, by index
    shard: int  # the index of the shard that answered
    initialized: bool  # False: the first joiner initializes it
    pub_interval_s: float  # the PUB stream's heartbeat: the slower of ours and the server's
    pub_liveness: int
    max_message_bytes: int | None  # the shards' size limit, when the welcome says
    mode: str  # the cluster's merge mode


def welcome_limit(welcome: dict) -> int | None:
    """The `max_message_bytes` a welcome carries (an optional field), or None.

    Args:
        welcome: a welcome header.

    Returns:
        The shard's size limit of a request in bytes, or None when it does not say.
    """
    limit = welcome.get("max_message_bytes")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        return limit
    return None


def shard_initialized(welcome: dict, plan: Plan, shard: int) -> bool:
    """Whether a shard's welcome says it is initialised (with this island's plan).

    Args:
        welcome: the shard's welcome header.
        plan: this island's plan.
        shard: the shard's index.

    Returns:
        True when initialised, False when it waits for its init.

    Raises:
        ClientError: it is initialised with another plan.
    """
    if welcome["initialized"] and welcome["plan_hash"] != plan.hash:
        raise mismatch(welcome, plan)
    return bool(welcome["initialized"])


def read_welcome(welcome: dict, cfg: ClientConfig, leaves: list[LeafSpec]) -> Cluster:
    """Check the first shard's welcome and make this island's plan of the cluster.

    Args:
        welcome: the welcome header.
        cfg: client settings (heartbeat interval and liveness).
        leaves: this island's leaf specs (`leaves_of`).

    Returns:
        The cluster as this island will use it.

    Raises:
        ClientError: the map is inconsistent, names a shard this client may not
            reach in plain TCP (`ClientConfig.plain_tcp_refusal`), the model cannot
            be sharded over the cluster, or an initialized cluster's plan differs from ours.
    """
    endpoints = welcome["endpoints"]
    pub_interval_s = max(cfg.heartbeat_interval_s, welcome["heartbeat_interval_s"])
    pub_liveness = max(cfg.liveness, welcome["liveness"])
    num_shards, num_fragments = welcome["num_shards"], welcome["num_fragments"]
    if len(endpoints) != num_shards or not 0 <= welcome["shard"] < num_shards:
        raise ClientError(
            f"join: welcome lists {len(endpoints)} endpoints for {num_shards} shards "
            f"(shard {welcome['shard']}); the cluster is misconfigured"
        )
    for index, pair in enumerate(endpoints):
        for endpoint in pair:  # a loopback shard may name shards elsewhere
            refusal = cfg.plain_tcp_refusal(str(endpoint))
            if refusal is not None:
                raise ClientError(
                    f"join: the welcome of {cfg.connect} names shard {index} at {endpoint}: "
                    f"{refusal}"
                )
    try:
        plan = make_plan(leaves, num_shards, num_fragments)
    except PlanError as exc:
        raise ClientError(f"join: cannot shard this model over the cluster: {exc}") from None
    if welcome["initialized"] and welcome["plan_hash"] != plan.hash:
        raise mismatch(welcome, plan)
    return Cluster(
        plan=plan,
        endpoints=[(str(router), str(pub)) for router, pub in endpoints],
        shard=welcome["shard"],
        initialized=welcome["initialized"],
        pub_interval_s=pub_interval_s,
        pub_liveness=pub_liveness,
        max_message_bytes=welcome_limit(welcome),
        mode=str(welcome.get("mode", "quorum")),
    )


def check_rewelcome(welcome: dict, plan: Plan | None, shard: int) -> None:
    """Check the welcome of a shard this island said hello to again (after a reconnect).

    Args:
        welcome: the welcome header.
        plan: this island's plan (None: not joined yet).
        shard: the shard's index.

    Raises:
        ClientError: the shard lost its state, or now runs another plan.
    """
    if not welcome["initialized"]:
        raise ClientError(
            f"shard {shard} restarted without its state (not initialized); "
            "restart the cluster from a checkpoint or re-join with a new client"
        )
    if plan is not None and welcome["plan_hash"] != plan.hash:
        raise mismatch(welcome, plan)


def mismatch(welcome: Mapping, plan: Plan) -> PlanMismatch:
    """The error for a cluster whose plan hash differs from this island's.

    Args:
        welcome: the shard's welcome (its `plan`, when initialized, names the cluster's leaves).
        plan: this island's plan.

    Returns:
        A PlanMismatch whose message is one line: both models' sizes, the first leaf
        that differs, what to do, both hashes; its fields carry the same facts.
    """
    cluster_hash = str(welcome.get("plan_hash") or "")
    hashes = f"(plan hashes: cluster {str(welcome.get('plan_hash'))[:12]}, island {plan.hash[:12]})"
    try:
        theirs = Plan.from_wire(welcome["plan"]).leaves if welcome.get("plan") else None
    except PlanError:
        theirs = None
    if theirs is None:
        return PlanMismatch(
            f"plan mismatch: this model's parameter names, shapes or dtypes ({model_size(plan.leaves)}) "
            f"differ from the cluster's {hashes}; join with the cluster's model, or {FRESH_CLUSTER}",
            island_hash=plan.hash,
            cluster_hash=cluster_hash,
        )
    where = first_difference(plan.leaves, theirs, "here", "in the cluster's model")
    if where == "the same leaves":
        where = (
            f"the same leaves cut into another plan ({welcome.get('num_shards')} shards, "
            f"{welcome.get('num_fragments')} fragments): an island of another version?"
        )
    return PlanMismatch(
        f"plan mismatch: this island's model ({model_size(plan.leaves)}) is not the cluster's "
        f"({model_size(theirs)}): {where}; join with the cluster's model, or {FRESH_CLUSTER} "
        f"{hashes}",
        island_hash=plan.hash,
        cluster_hash=cluster_hash,
        cluster_leaves=list(theirs),
        detail=where,
    )
