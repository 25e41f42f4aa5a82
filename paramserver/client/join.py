"""An island's join conversation: hello, the cluster's map, plan check, init, snapshots.

This module owns the rules of `Client.join` and of the welcome a reconnected
shard sends. `join` runs inside the I/O thread (`paramserver.client.io_thread`),
which lends it a `Loop`: a `call` (send one request, run the loop until the
reply arrives or the deadline passes), a `pump` (one round of the loop), a
`resync` (snapshot a shard's fragments) and an `adopt` (the cluster is known).
The steps: check the parameters before anything is sent; hello to the
configured shard; check its welcome and make the plan (`read_welcome`, no
I/O); connect a DEALER to every other shard and say hello to it (each
welcome says whether that shard is initialised, and with which plan);
initialise what is not (`_initialize`); subscribe to every shard, then
snapshot it (Clone pattern). `check_rewelcome` checks a reconnected shard's
welcome.

Initialisation: the island that initialises shard 0 (the first joiner; a
lost race for it is fine, the winner's values count) initialises every other
shard with its own values, in index order. A shard still uninitialised
`init_grace_s` after another island took shard 0 (that island died half-way)
is initialised by the joining island with its own values, so that a
half-initialised cluster can always be joined.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

import codec
from paramserver.client.links import Links, ShardLink
from paramserver.client.replica import ReplicaFragment, ShardFeed
from paramserver.client.types import ClientConfig, ClientError, JoinResult
from paramserver.wire.plan import LeafSpec, Plan, PlanError, leaf_specs, make_plan

logger = logging.getLogger(__name__)

_RAW = codec.raw("float32")

Call = Callable[..., tuple[dict, list]]
"""call(shard, kind, deadline, payload=(), **fields) -> (reply header, reply payload)."""


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


@dataclass(frozen=True)
class Loop:
    """What `join` borrows from the I/O thread that runs it."""

    call: Call  # send a request, run the loop until its reply arrives
    pump: Callable[[], None]  # one round of the loop (replies and snapshots arrive there)
    resync: Callable[[ShardLink, float], None]  # snapshot (again) all fragments of a shard
    adopt: Callable[[Cluster], None]  # the cluster is known and initialized; snapshots follow


def join(
    cfg: ClientConfig,
    links: Links,
    replica: dict[int, ReplicaFragment],
    flat: Mapping[str, np.ndarray],
    deadline: float,
    loop: Loop,
) -> JoinResult:
    """Join the cluster: the whole conversation, from the first hello to the last snapshot.

    Args:
        cfg: client settings (the shard to say hello to, island, timeouts).
        links: the client's sockets; `links.shards` becomes the cluster's shards.
        replica: the replica the shards' feeds fill.
        flat: path -> this island's parameters (initial values of an empty cluster).
        deadline: monotonic time the join must finish by.
        loop: the I/O thread's request, loop and resync functions.

    Returns:
        The plan, the parameters assembled from the replica, the versions and
        the cluster's merge mode.

    Raises:
        ClientError: no answer in time, a plan mismatch, or a shard refused.
    """
    leaves = _leaves_of(flat)
    first = ShardLink(-1, cfg.connect, "")
    links.shards = [first]
    links.open_dealer(first)
    logger.info(
        "island %s: waiting for the server at %s (join timeout %gs)",
        cfg.island,
        cfg.connect,
        cfg.join_timeout_s,
    )
    cluster = read_welcome(_hello(cfg, first, loop, deadline), cfg, leaves)
    _open_shards(links, first, cluster)
    plan = cluster.plan
    initialized = {cluster.shard: cluster.initialized}
    for shard in links.shards:
        if shard is not first:
            welcome = _hello(cfg, shard, loop, deadline)
            initialized[shard.index] = shard_initialized(welcome, plan, shard.index)
    logger.info(
        "island %s: cluster of %d shards, %d fragments, initialized %s, plan %s",
        cfg.island,
        plan.num_shards,
        plan.num_fragments,
        [i for i in sorted(initialized) if initialized[i]],
        plan.hash,
    )
    if not all(initialized.values()):
        _initialize(cfg, plan, flat, links.shards, initialized, loop, deadline)
    loop.adopt(cluster)
    joined = _sync_all(cfg, links, plan, replica, deadline, loop)
    return dataclasses.replace(joined, mode=cluster.mode)


def _leaves_of(flat: Mapping[str, np.ndarray]) -> list[LeafSpec]:
    """The leaf specs of this island's parameters (checked before anything is sent)."""
    try:
        return leaf_specs(flat)
    except (PlanError, ValueError, TypeError) as exc:
        raise ClientError(f"join: cannot use these parameters: {exc}") from None


def _expect(header: dict, kind: str, what: str) -> dict:
    """The reply `header` when it is of `kind`; otherwise a ClientError naming the refusal."""
    if header["kind"] != kind:
        raise ClientError(f"join: {what} refused: {header.get('reason')}: {header.get('detail')}")
    return header


def _hello(cfg: ClientConfig, shard: ShardLink, loop: Loop, deadline: float) -> dict:
    """Say hello to a shard; its welcome, or a ClientError saying why it refused.

    An id in use on another connection is asked again every 0.2 s for up to
    `in_use_wait_s`: a restarted island's old connection falls silent within two
    heartbeats and the shard then lets it in; a second running island with the
    same id stays refused.
    """
    give_up = min(deadline, time.monotonic() + cfg.in_use_wait_s)
    while True:
        reply, _ = loop.call(shard, "hello", deadline)
        in_use = reply["kind"] == "rejected" and reply.get("reason") == "island_in_use"
        if not in_use or time.monotonic() >= give_up:
            break
        pause_end = min(give_up, time.monotonic() + 0.2)
        while time.monotonic() < pause_end:
            loop.pump()
    if in_use:
        raise ClientError(
            f"join: island id {cfg.island!r} is in use by another running island "
            f"(shard at {shard.router}: {reply.get('detail')}); give each island its own id "
            "or stop the other one"
        )
    return _expect(reply, "welcome", "hello")


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
        raise ClientError(mismatch(welcome["plan_hash"], plan, plan.num_shards, plan.num_fragments))
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
        ClientError: the map is inconsistent, the model cannot be sharded over
            the cluster, or an initialized cluster's plan differs from ours.
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
    try:
        plan = make_plan(leaves, num_shards, num_fragments)
    except PlanError as exc:
        raise ClientError(f"join: cannot shard this model over the cluster: {exc}") from None
    if welcome["initialized"] and welcome["plan_hash"] != plan.hash:
        raise ClientError(mismatch(welcome["plan_hash"], plan, num_shards, num_fragments))
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


def _open_shards(links: Links, first: ShardLink, cluster: Cluster) -> None:
    """Make `links.shards` the cluster's shards: `first` (which answered) and a new DEALER each."""
    shards = []
    for i, (router, pub) in enumerate(cluster.endpoints):
        if i == cluster.shard:
            first.index, first.pub = i, pub
            shards.append(first)
        else:
            shard = ShardLink(i, router, pub)
            links.open_dealer(shard)
            shards.append(shard)
    links.shards = shards


def _initialize(
    cfg: ClientConfig,
    plan: Plan,
    flat: Mapping[str, np.ndarray],
    shards: list[ShardLink],
    initialized: dict[int, bool],
    loop: Loop,
    deadline: float,
) -> None:
    """Init every shard not initialised yet with this island's values, shard 0 first.

    When another island took shard 0 (before this join, or in a race just
    now), the other shards are its to initialise: each is awaited up to
    `init_grace_s`, then initialised with this island's values (that island
    died half-way).

    Args:
        cfg: client settings (island, init_grace_s).
        plan: this island's plan (checked against every initialised shard's).
        flat: path -> this island's initial values.
        shards: every shard, by index.
        initialized: shard index -> whether its welcome said initialised.
        loop: the I/O thread's request and loop functions.
        deadline: monotonic time the join must finish by.

    Raises:
        ClientError: a shard refused init for another reason than a lost race,
            or a shard runs another plan.
    """
    ours = not initialized[0]  # shard 0 is ours to initialise: then so are the others
    grace_until = time.monotonic() + cfg.init_grace_s
    for shard in shards:
        if initialized[shard.index]:
            continue
        if not ours:
            if _initialized_within(cfg, shard, plan, loop, min(grace_until, deadline), deadline):
                continue
            logger.warning(
                "shard %d is still not initialised %.1fs after another island initialised "
                "shard 0 (it stopped half-way?): island %s initialises it with its own values",
                shard.index,
                cfg.init_grace_s,
                cfg.island,
            )
        won = _init(cfg.island, plan, flat, shard, loop.call, deadline)
        if shard.index == 0 and not won:  # lost the race: the winner initialises the rest
            ours, grace_until = False, time.monotonic() + cfg.init_grace_s


def _init(
    island: str,
    plan: Plan,
    flat: Mapping[str, np.ndarray],
    shard: ShardLink,
    call: Call,
    deadline: float,
) -> bool:
    """Init one shard with this island's values.

    Returns:
        True when this island initialised it, False when another one did first
        (with the same plan).

    Raises:
        ClientError: the shard refused for another reason, or runs another plan.
    """
    tree = {str(f.index): plan.gather(flat, f.index) for f in plan.fragments_of(shard.index)}
    frames, _ = _RAW.encode(tree, None)
    reply, _ = call(shard, "init", deadline, frames, plan=plan.to_wire())
    if reply["kind"] == "init_ok":
        logger.info("island %s initialized shard %d", island, shard.index)
        return True
    reason = reply.get("reason")
    if reason == "already_initialized":
        logger.info("shard %d already initialized by another island", shard.index)
        welcome, _ = call(shard, "hello", deadline)
        shard_initialized(_expect(welcome, "welcome", "hello"), plan, shard.index)
        return False
    if reason == "plan_mismatch":
        raise ClientError(f"join: plan mismatch: {reply.get('detail')}")
    raise ClientError(f"join: shard {shard.index} refused init: {reason}: {reply.get('detail')}")


def _initialized_within(
    cfg: ClientConfig, shard: ShardLink, plan: Plan, loop: Loop, until: float, deadline: float
) -> bool:
    """Ask a shard (hello, every 0.2 s) until it is initialised or `until` passes.

    Returns:
        True when it became initialised (with this island's plan) by `until`.
    """
    while True:
        if shard_initialized(_hello(cfg, shard, loop, deadline), plan, shard.index):
            return True
        if time.monotonic() >= until:
            return False
        pause_end = min(until, time.monotonic() + 0.2)
        while time.monotonic() < pause_end:
            loop.pump()


def _sync_all(
    cfg: ClientConfig,
    links: Links,
    plan: Plan,
    replica: dict[int, ReplicaFragment],
    deadline: float,
    loop: Loop,
) -> JoinResult:
    """Subscribe to every shard, snapshot its fragments, and wait until all arrived.

    Args:
        cfg: client settings (island, timeouts).
        links: the sockets, `links.shards` set by `open_shards`.
        plan: the cluster's plan.
        replica: the replica the shards' feeds fill.
        deadline: monotonic time the join must finish by.
        loop: the I/O thread's loop and resync functions.

    Returns:
        The plan, the parameters assembled from the replica, and the versions.

    Raises:
        ClientError: snapshots still missing at the deadline.
    """
    now = time.monotonic()
    for shard in links.shards:
        links.open_sub(shard)  # Clone pattern: subscribe before the snapshot
        fragments = tuple(f.index for f in plan.fragments_of(shard.index))
        shard.feed = ShardFeed(shard.index, fragments, replica)
        shard.heard = shard.sub_heard = now
        loop.resync(shard, now)
    while any(s.feed.syncing for s in links.shards):
        if time.monotonic() > deadline:
            missing = [s.index for s in links.shards if s.feed.syncing]
            raise ClientError(
                f"join: snapshots of shard(s) {missing} not received within {cfg.join_timeout_s:g}s"
            )
        loop.pump()
        now = time.monotonic()
        for shard in links.shards:  # e.g. a shard the winner of an init race has not reached
            if shard.feed.syncing and now - shard.feed.sync_started > cfg.snapshot_timeout_s:
                loop.resync(shard, now)
    params = {leaf.path: np.zeros(leaf.shape, dtype=np.float32) for leaf in plan.leaves}
    for index, state in replica.items():
        plan.scatter(index, state.values, params)
    versions = {index: state.version for index, state in sorted(replica.items())}
    now = time.monotonic()
    for shard in links.shards:
        shard.heard = shard.sub_heard = shard.next_heartbeat = now
    logger.info("island %s joined: versions %s", cfg.island, versions)
    return JoinResult(plan, params, versions)


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
        raise ClientError(
            mismatch(welcome["plan_hash"], plan, welcome["num_shards"], welcome["num_fragments"])
        )


def mismatch(theirs: str | None, plan: Plan, num_shards: int, num_fragments: int) -> str:
    """The error message for a cluster whose plan hash differs from this island's."""
    return (
        f"plan mismatch: the cluster's plan hash is {theirs}, this island's is {plan.hash} "
        f"({len(plan.leaves)} leaves over {num_shards} shards, {num_fragments} fragments): "
        "this model's parameter names, shapes or dtypes differ from the cluster's"
    )
