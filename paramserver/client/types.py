"""The client's public types: settings, errors, and what join, poll_updates and push carry.

This module owns `ClientConfig` (with its validation), `ClientError`,
`ClientConfigError`, `JoinTimeout`, `PlanMismatch`, `JoinResult`, `Update` and `PushRequest` (a delta). Users import
them from `paramserver.client`, which re-exports them; the client's other
modules import them from here (this module imports none of them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from codec.coded import Coded
from paramserver.plumbing.exposure import refusal
from paramserver.plumbing.validate import Checks
from paramserver.wire.plan import Plan
from paramserver.wire.protocol import is_island_id

# What a client keeps of the global parameters (`ClientConfig.keep`).
KEEP = ("values", "increments", "versions")


class ClientError(RuntimeError):
    """The client cannot do what was asked; the message says why and what to do."""


class ClientConfigError(ClientError, ValueError):
    """A `ClientConfig` value is invalid (a ValueError too, so settings loaders report it)."""


class JoinTimeout(ClientError):
    """A shard did not answer the join in time (the message says which and what to check).

    Attributes:
        endpoint: the ROUTER endpoint that stayed silent.
        request: what it did not answer ("hello", "init").
        timeout_s: the join timeout that ran out.
    """

    def __init__(self, message: str, *, endpoint: str, request: str, timeout_s: float) -> None:
        super().__init__(message)
        self.endpoint, self.request, self.timeout_s = endpoint, request, timeout_s


class PlanMismatch(ClientError):
    """The cluster holds another model (or another cut of it) than this island's.

    Attributes:
        island_hash: this island's plan hash.
        cluster_hash: the cluster's plan hash ("" when the shard did not say).
        cluster_leaves: the cluster's leaves as its welcome named them (`LeafSpec`s),
            or None when unknown (e.g. a shard refused an init with another plan).
        detail: what differs, in words (the first differing leaf when known).
    """

    def __init__(
        self,
        message: str,
        *,
        island_hash: str,
        cluster_hash: str = "",
        cluster_leaves: list[Any] | None = None,
        detail: str = "",
    ) -> None:
        super().__init__(message)
        self.island_hash, self.cluster_hash = island_hash, cluster_hash
        self.cluster_leaves, self.detail = cluster_leaves, detail


FLOW_WINDOW_BYTES = 4 * 1024 * 1024  # what one TCP flow's autotuned window reaches (tcp_wmem)
MAX_BULK_LINKS = 8  # bulk links per shard at most (the shard attaches up to 16)


def bulk_flows(control_link: bool, bulk_links: int, bdp_bytes: int) -> int:
    """How many bulk links per shard a client opens.

    Args:
        control_link: whether control traffic gets a connection of its own.
        bulk_links: the configured count; 0 = from `bdp_bytes`.
        bdp_bytes: the links' bandwidth-delay product (0: unknown).

    Returns:
        0 without a control link (one connection carries everything), else
        `bulk_links`, or ceil(bdp_bytes / FLOW_WINDOW_BYTES) clamped to
        [1, MAX_BULK_LINKS] when it is 0.
    """
    if not control_link:
        return 0
    if bulk_links > 0:
        return bulk_links
    return max(1, min(MAX_BULK_LINKS, -(-bdp_bytes // FLOW_WINDOW_BYTES)))


@dataclass(frozen=True)
class ClientConfig:
    """Settings of one island's connection to the parameter server."""

    connect: str  # ROUTER endpoint of any shard (normally shard 0), e.g. tcp://host:5555
    island: str  # stable island id, 1-128 characters
    heartbeat_interval_s: float = 1.0  # heartbeat period to every shard; liveness unit
    liveness: int = 5  # a shard silent this many intervals is down (reconnect, re-snapshot)
    # Re-send an unacked delta after this, until ack latencies are measured; then after
    # SRTT + 4 RTTVAR of them (paramserver.client.ledger), doubling per attempt.
    ack_timeout_s: float = 5.0
    ack_timeout_cap_s: float = 60.0  # upper bound of the re-send back-off
    # Lower bound of the measured timeout (at most ack_timeout_s). Above TCP's 1 s: TCP
    # already re-sends lost segments below us, so this timeout only has to catch a lost
    # connection, while a needless re-send costs a whole delta on a thin link.
    ack_timeout_floor_s: float = 2.0
    reconnect_cap_s: float = 10.0  # upper bound of the reconnect back-off
    max_unacked: int = 16  # deltas outstanding before push blocks (back-pressure)
    push_timeout_s: float = 300.0  # push waiting for a free slot longer than this fails
    join_timeout_s: float = 60.0  # join (hello, init, snapshots) must finish within this
    snapshot_timeout_s: float = 30.0  # a re-snapshot of a shard not done by then is restarted
    in_use_wait_s: float = 5.0  # an id live on another connection: ask again this long (a
    # restarted island's old connection falls silent within two heartbeats), then fail
    init_grace_s: float = 5.0  # a shard left uninitialised this long by shard 0's initialiser
    # (it died half-way?) is initialised by the joining island with its own values
    curve_secret_key_file: str = ""  # island key pair (NAME.key_secret); "" = no CURVE
    curve_server_key_file: str = ""  # with CURVE: the shards' public key (NAME.key)
    # What the client keeps of the global parameters (`KEEP`): "values": a float32 replica
    # (JoinResult.params and every Update.values hold the full values); "increments": no
    # replica (an island whose exchange keeps the global values itself, e.g. on its devices):
    # JoinResult.params and the values of snapshots and "full" updates are handed over once,
    # an int8/int4 increment as its codes only (Update.values None, Update.increment set),
    # and poll_updates hands out every version in order, so the caller must take them all;
    # "versions": versions only (a monitor, a load tool, an island that only pushes): the
    # join reads no values, updates are not decoded, JoinResult.params is {} and
    # Update.values None. Versions, pushes, acks, round_merged and stats work alike in all
    # three; without "values" the client's memory does not grow with the model.
    keep: str = "values"
    # True: send in plain TCP (no CURVE) to endpoints that are not loopback, here `connect`
    # and every shard a welcome names; only on a trusted, firewalled network
    insecure: bool = False
    # The token every hello carries (docs/protocol.md, `session`): a shard lets a hello with
    # the token of the connection an island id is bound to take the id over at once. Keep it
    # (secret) where the island keeps its state, so a restart after a crash is welcomed at
    # once (`worker.session_token`); "" = a fresh random token per Client.
    session: str = ""
    # Hello, heartbeats, status and bye on a DEALER of their own per shard, apart from the
    # bulk (pushes, snapshots, init pieces), so that a long push on a thin link cannot delay
    # them (docs/protocol.md section 1); False: one DEALER per shard carries everything.
    control_link: bool = True
    # Bulk DEALERs per shard (with control_link): each push, init or snapshot piece goes
    # whole on the one with the fewest bytes in flight, and one that dies is replaced and
    # its messages sent again; 0 = one per 4 MiB of link_bdp_bytes, at least 1, at most 8.
    bulk_links: int = 0
    # The links' bandwidth-delay product (rate x round-trip time) in bytes, e.g.
    # 2 Gbit/s x 60 ms = 15_000_000: sets bulk_links when that is 0, and each bulk socket's
    # send/receive buffers to its share when that exceeds what the kernel's autotuning
    # reaches and fits net.core.wmem_max/rmem_max; 0 = unknown (the kernel's autotuning).
    link_bdp_bytes: int = 0

    def __post_init__(self) -> None:
        check = Checks("ClientConfig", ClientConfigError)
        check.endpoint("connect", self.connect)
        check.island_id("island", self.island)
        for name in (
            "heartbeat_interval_s",
            "ack_timeout_s",
            "ack_timeout_cap_s",
            "ack_timeout_floor_s",
            "reconnect_cap_s",
            "push_timeout_s",
            "join_timeout_s",
            "snapshot_timeout_s",
            "init_grace_s",
            "in_use_wait_s",
        ):
            check.number(name, getattr(self, name), above=0.0)
        for name in ("liveness", "max_unacked"):
            check.integer(name, getattr(self, name), 1)
        check.require(
            self.ack_timeout_cap_s >= self.ack_timeout_s,
            "ack_timeout_cap_s",
            self.ack_timeout_cap_s,
            f"must be >= ack_timeout_s={self.ack_timeout_s}",
        )
        check.choice("keep", self.keep, KEEP)
        check.require(
            isinstance(self.control_link, bool),
            "control_link", self.control_link, "must be True or False",
        )  # fmt: skip
        check.integer("bulk_links", self.bulk_links, 0)
        check.require(
            self.bulk_links <= MAX_BULK_LINKS,
            "bulk_links", self.bulk_links, f"must be at most {MAX_BULK_LINKS}",
        )  # fmt: skip
        check.integer("link_bdp_bytes", self.link_bdp_bytes, 0)
        check.require(
            self.session == "" or is_island_id(self.session),
            "session",
            self.session,
            'give a string of 1-128 characters, or "" for a fresh token per client',
        )
        check.together(
            "curve_secret_key_file",
            self.curve_secret_key_file,
            "curve_server_key_file",
            self.curve_server_key_file,
        )
        check.require(
            isinstance(self.insecure, bool), "insecure", self.insecure, "must be True or False"
        )
        refused = self.plain_tcp_refusal(self.connect)
        check.require(refused is None, "connect", self.connect, str(refused))
        check.require(
            self.reconnect_cap_s >= self.heartbeat_interval_s,
            "reconnect_cap_s",
            self.reconnect_cap_s,
            f"must be >= heartbeat_interval_s={self.heartbeat_interval_s}",
        )

    @property
    def bulk_flows(self) -> int:
        """Bulk DEALERs per shard (`bulk_flows`); 0 without control_link."""
        return bulk_flows(self.control_link, self.bulk_links, self.link_bdp_bytes)

    def plain_tcp_refusal(self, endpoint: str) -> str | None:
        """Why this client may not talk plain TCP to `endpoint`, or None when it may.

        Args:
            endpoint: a shard's ROUTER or PUB endpoint.

        Returns:
            One line naming the endpoint's host, the risk and both ways out (CURVE
            keys or `insecure`); None under CURVE, with `insecure`, on loopback
            and for ipc:// and inproc:// (`paramserver.plumbing.exposure`).
        """
        return refusal(
            endpoint,
            curve=bool(self.curve_secret_key_file),
            insecure=self.insecure,
            risk="anyone on the way could read the deltas or pose as the server",
            keys="curve_secret_key_file and curve_server_key_file",
            opt_out="insecure=True (--insecure)",
        )


@dataclass(frozen=True)
class JoinResult:
    """What `Client.join` returns: the plan and the global parameters as of `versions`.

    `params` is {} for a client that keeps versions only (`ClientConfig(keep="versions")`);
    with `keep="increments"` the client keeps no reference to them (they are the caller's).
    """

    plan: Plan
    params: dict[str, np.ndarray]
    versions: dict[int, int]
    mode: str = "quorum"  # the cluster's merge mode ("sync": wait for each round's merge)


@dataclass(frozen=True)
class Update:
    """A new global version of one fragment: `values` is the full 1-D float32 vector.

    `values` is read-only: with `ClientConfig(keep="values")` it is the client's replica
    itself (a new array per version, never changed in place), not a copy.

    `increment`, when not None, holds the int8/int4 codes and scales of the published
    change from `version - 1` (`codec.coded.Coded`): a reader that holds
    version - 1 can add their dequantized values (in float32, as the replica does)
    instead of taking `values`, e.g. on its accelerator. None when `version` came
    from a snapshot or a full-values update.

    With `keep="increments"` an update is either the values (after a snapshot or a
    full-values update; `increment` None) or the increment alone (`values` None), and
    `poll_updates` hands out every version in order, each increment following the
    version handed out before it (by `join` or an earlier update). With
    `keep="versions"` both are None: the update says its version only.
    """

    fragment: int
    version: int
    values: np.ndarray | None
    increment: Coded | None = None


@dataclass
class PushRequest:
    """One delta: what `Client.push` hands the I/O thread, and what `Client.unacked` gives back.

    Its fields are `push`'s arguments, so an unacked delta kept elsewhere (an
    island's outbox file) is re-sent by passing them to `push` again.
    """

    fragment: int
    round: int
    base_version: int
    tokens: int
    steps: int
    frames: list[Any]
