"""Asking running shards for their status and parameters over the wire (read-only operator queries).

This module owns the read-only queries an operator tool makes: one `status`
request per shard, learning the cluster map (and plan) from the shard it was
pointed at, waiting until every acked delta is merged (`wait_merged`), and
reading the global parameters from the owning shards' snapshots
(`global_params`, what the final evaluation of a run reads). Every request has
a finite timeout; nothing here keeps state, and nothing imports JAX.

The cluster map comes from the `status` reply when it lists `endpoints`,
otherwise from a `welcome` (hello, immediately followed by bye, under an
island id starting with ``diloco-status-`` so it is recognisable in logs).

Under CURVE, `shard_status`, `cluster_status` and `wait_merged` take the
client keys (`curve.ClientKeys`: an allow-listed key pair, or the server's
own). A shard whose handshake fails (it speaks CURVE and we did not, or it
refused our key) is reported at once with the likely cause
(`curve.HandshakeWatch`) instead of a bare timeout. (Just over 400 lines: four queries and the cluster
map they share.)
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from typing import Any

import numpy as np
import zmq

import codec
from paramserver.plumbing.curve import ClientKeys, HandshakeWatch
from paramserver.plumbing.peer_peek import silence_cause
from paramserver.wire import protocol
from paramserver.wire.plan import Plan, PlanError
from paramserver.wire.snapshot import SnapshotPieces, snapshot_request

logger = logging.getLogger(__name__)

_IDS = itertools.count(1)


def _island() -> str:
    return f"diloco-status-{os.getpid()}"


class ProbeError(RuntimeError):
    """A shard did not answer in time, or answered something unusable."""


def _exchange(
    ctx: zmq.Context,
    endpoint: str,
    header: dict[str, Any],
    timeout_s: float,
    farewell: dict[str, Any] | None = None,
    curve: ClientKeys | None = None,
) -> tuple[dict[str, Any], list[Any]]:
    """One request, its reply header and payload frames; `rejected` raises ProbeError.

    `farewell` (a bye after a hello) is sent after the reply on the same
    connection, as a shard binds an island id to the connection of its hello;
    its answer is awaited (up to `timeout_s`) but not checked. A failed
    handshake ends the wait at once, with its likely cause.
    """
    sock = ctx.socket(zmq.DEALER)
    watch: HandshakeWatch | None = None
    try:
        sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(sock)
        watch = HandshakeWatch(sock, curve=curve is not None)
        sock.connect(endpoint)
        rid = next(_IDS)
        sock.send_multipart(protocol.pack({**header, "id": rid}))
        deadline_ms = int(timeout_s * 1000)
        deadline = time.monotonic() + timeout_s
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(watch.monitor, zmq.POLLIN)
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            ready = dict(poller.poll(remaining_ms)) if remaining_ms > 0 else {}
            if sock in ready:
                try:
                    reply, payload = protocol.unpack(sock.recv_multipart(), protocol.REPLY)
                except protocol.ProtocolError as exc:
                    raise ProbeError(f"{endpoint} sent an unusable reply: {exc}") from None
                if reply.get("id") == rid:
                    break
                continue
            advice = watch.failure(endpoint)  # a failed handshake: no reply will come
            if advice is not None or not ready:  # a PUB port fails it too: say so, not "CURVE"
                cause = silence_cause(endpoint, 0.5, curve is not None)
                if advice is not None:
                    raise ProbeError(f"no reply from {endpoint}: {cause or advice}")
                raise ProbeError(
                    f"no reply from {endpoint} within {timeout_s:g}s: "
                    f"{cause or 'is the server running there?'}"
                )
        if reply["kind"] == "rejected":
            raise ProbeError(
                f"{endpoint} refused {header['kind']}: {reply['reason']}: {reply['detail']}"
            )
        if farewell is not None:
            sock.send_multipart(protocol.pack({**farewell, "id": next(_IDS)}))
            if not sock.poll(deadline_ms):
                logger.debug("no answer from %s to %s", endpoint, farewell["kind"])
        return reply, payload
    except zmq.ZMQError as exc:
        raise ProbeError(f"cannot reach {endpoint}: {exc}") from None
    finally:
        if watch is not None:
            watch.close()
        sock.close(linger=0)


def shard_status(
    ctx: zmq.Context, endpoint: str, timeout_s: float = 5.0, curve: ClientKeys | None = None
) -> dict[str, Any]:
    """The status map of one shard.

    Args:
        ctx: a ZeroMQ context.
        endpoint: the shard's ROUTER, e.g. tcp://127.0.0.1:5555.
        timeout_s: how long to wait for the reply.
        curve: client keys for a CURVE shard (None: plain).

    Returns:
        The shard's status dict (see `paramserver.server.state.ShardState.status`).

    Raises:
        ProbeError: no reply in time (the message names a failed CURVE
            handshake when there was one) or an unusable one.
    """
    reply, _ = _exchange(ctx, endpoint, {"kind": "status"}, timeout_s, curve=curve)
    if reply["kind"] != "status_reply":
        raise ProbeError(f"{endpoint} answered status with {reply['kind']!r}")
    return dict(reply["status"])


def cluster_endpoints(
    ctx: zmq.Context, connect: str, timeout_s: float = 5.0
) -> list[tuple[str, str]]:
    """The (router, pub) endpoints of every shard, learnt from the shard at `connect`.

    Args:
        ctx: a ZeroMQ context.
        connect: ROUTER endpoint of any shard.
        timeout_s: per-request timeout.

    Returns:
        [(router, pub), ...] in shard order; the entry of the asked shard is
        replaced by `connect` (the address that is known to work from here).

    Raises:
        ProbeError: no usable answer.
    """
    return _endpoints_of(_welcome(ctx, connect, timeout_s), connect)


def _welcome(
    ctx: zmq.Context,
    connect: str,
    timeout_s: float,
    curve: ClientKeys | None = None,
    island: str | None = None,
) -> dict[str, Any]:
    """The welcome of the shard at `connect` (hello as `island`, then bye at once)."""
    name = island or _island()
    hello, bye = {"kind": "hello", "island": name}, {"kind": "bye", "island": name}
    welcome, _ = _exchange(ctx, connect, hello, timeout_s, farewell=bye, curve=curve)
    if welcome["kind"] != "welcome":
        detail = (
            f": {welcome.get('reason')} ({welcome.get('detail')})" if "reason" in welcome else ""
        )
        raise ProbeError(f"{connect} answered hello as {name!r} with {welcome['kind']!r}{detail}")
    return welcome


def _endpoints_of(welcome: dict[str, Any], connect: str) -> list[tuple[str, str]]:
    endpoints = [(str(r), str(p)) for r, p in welcome["endpoints"]]
    index = welcome["shard"]
    if 0 <= index < len(endpoints):
        endpoints[index] = (connect, endpoints[index][1])
    return endpoints


def _cluster_map(
    ctx: zmq.Context, connect: str, timeout_s: float, curve: ClientKeys | None
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """The status of the shard at `connect` and every shard's endpoints (its own: `connect`)."""
    first = shard_status(ctx, connect, timeout_s, curve)
    if "endpoints" in first:
        endpoints = [(str(r), str(p)) for r, p in first["endpoints"]]
        index = first.get("shard")
        if isinstance(index, int) and 0 <= index < len(endpoints):
            endpoints[index] = (connect, endpoints[index][1])
    else:  # a shard that does not list them in its status: ask for a welcome
        endpoints = cluster_endpoints(ctx, connect, timeout_s)
    return first, endpoints


def cluster_status(
    connect: str, timeout_s: float = 5.0, curve: ClientKeys | None = None
) -> dict[str, Any]:
    """Status of every shard of the cluster that `connect` belongs to.

    Args:
        connect: ROUTER endpoint of any shard (normally shard 0).
        timeout_s: per-request timeout.
        curve: client keys for a CURVE cluster (None: plain).

    Returns:
        {"connect": connect, "shards": [status dict + "endpoint" per shard]};
        a shard that did not answer has {"shard", "endpoint", "error"} instead.

    Raises:
        ProbeError: the shard at `connect` did not answer.
    """
    ctx = zmq.Context()
    try:
        first, endpoints = _cluster_map(ctx, connect, timeout_s, curve)
        known = {first.get("shard"): {**first, "endpoint": connect}}
        shards = _statuses(ctx, endpoints, timeout_s, known, curve)
        return {"connect": connect, "shards": shards}
    finally:
        ctx.destroy(linger=0)


def _statuses(
    ctx: zmq.Context,
    endpoints: list[tuple[str, str]],
    timeout_s: float,
    known: dict[Any, dict[str, Any]] | None = None,
    curve: ClientKeys | None = None,
) -> list[dict[str, Any]]:
    """Every shard's status + "endpoint"; {"shard", "endpoint", "error"} for a silent one."""
    shards = []
    for index, (router, _pub) in enumerate(endpoints):
        if known and index in known:
            shards.append(known[index])
            continue
        try:
            shards.append({**shard_status(ctx, router, timeout_s, curve), "endpoint": router})
        except ProbeError as exc:
            shards.append({"shard": index, "endpoint": router, "error": str(exc)})
    return shards


def _not_initialized(connect: str) -> ProbeError:
    return ProbeError(
        f"the cluster at {connect} is not initialized: no island has joined it yet, so there "
        "are no global parameters; start an island first"
    )


def _pending_of(shards: list[dict[str, Any]]) -> list[str]:
    """What keeps the cluster from being fully merged, one phrase per shard ([] = merged)."""
    waiting = []
    for s in shards:
        where = f"shard {s.get('shard', '?')} ({s.get('endpoint', '?')})"
        if "error" in s:
            waiting.append(f"{where}: {s['error']}")
            continue
        busy = {f: n for f, n in dict(s.get("pending", {})).items() if n}
        if busy:
            frags = ", ".join(f"fragment {f}: {n}" for f, n in sorted(busy.items()))
            waiting.append(f"{where} has unmerged deltas ({frags})")
    return waiting


def wait_merged(
    connect: str,
    timeout_s: float,
    stop: threading.Event | None = None,
    poll_s: float = 0.1,
    curve: ClientKeys | None = None,
) -> dict[str, Any]:
    """Wait until every shard reports no pending (acked but unmerged) delta on any fragment.

    The cluster map is learnt once (from a status, else one welcome); then every
    shard's `status` is polled every `poll_s` seconds. Call it after every island
    has flushed (stopped): then nothing new arrives, and "nothing pending" means
    every acked delta is in the global parameters.

    Args:
        connect: ROUTER endpoint of any shard (normally shard 0).
        timeout_s: give up after this many seconds.
        stop: optional event; once set, waiting ends with ProbeError.
        poll_s: seconds between polls.
        curve: client keys for a CURVE cluster (None: plain).

    Returns:
        The final cluster status, as `cluster_status` returns it:
        {"connect": connect, "shards": [status dict + "endpoint" per shard]}.

    Raises:
        ProbeError: the cluster is unreachable or not initialized, `stop` was set,
            or deltas are still pending (named per shard and fragment) at the timeout.
    """
    deadline = time.monotonic() + timeout_s
    request_s = max(0.5, min(5.0, timeout_s))
    ctx = zmq.Context()
    try:
        _, endpoints = _cluster_map(ctx, connect, request_s, curve)
        stop = stop or threading.Event()
        while True:
            shards = _statuses(ctx, endpoints, request_s, curve=curve)
            if any(s.get("initialized") is False for s in shards):
                raise _not_initialized(connect)
            waiting = _pending_of(shards)
            if not waiting:
                return {"connect": connect, "shards": shards}
            if stop.is_set():
                raise ProbeError("stopped while waiting for the merge: " + "; ".join(waiting))
            if time.monotonic() >= deadline:
                raise ProbeError(f"not merged within {timeout_s:g}s: " + "; ".join(waiting))
            stop.wait(poll_s)
    finally:
        ctx.destroy(linger=0)


def _fragment_values(
    ctx: zmq.Context,
    router: str,
    fragment: int,
    size: int,
    timeout_s: float,
    curve: ClientKeys | None = None,
    max_message_bytes: int = protocol.DEFAULT_MAX_MESSAGE_BYTES,
) -> tuple[int, np.ndarray]:
    """(version, 1-D float32 values) of one fragment, read in pieces from its owning shard.

    The requests and the checks of their replies are the ones the island's
    client makes when it joins (`paramserver.wire.snapshot`); pieces of an
    older version than one already read are read again.
    """
    read = SnapshotPieces(fragment, size, max_message_bytes)
    todo = list(read.pieces)
    while todo:
        piece = todo.pop(0)
        header = snapshot_request(_island(), fragment, piece=piece)
        reply, payload = _exchange(ctx, router, header, timeout_s, curve=curve)
        if reply["kind"] != "snapshot_reply" or reply["fragment"] != fragment:
            raise ProbeError(
                f"{router} answered the snapshot of fragment {fragment} with {reply['kind']!r}"
                f": {reply.get('detail', '')}"
            )
        try:
            todo += read.take(reply, payload)
        except (protocol.ProtocolError, codec.CodecError) as exc:
            raise ProbeError(
                f"{router} sent an unusable snapshot of fragment {fragment}: {exc}"
            ) from None
    version, _, values = read.result()
    return int(version), values


def global_params(
    connect: str,
    timeout_s: float = 5.0,
    curve: ClientKeys | None = None,
    island: str | None = None,
) -> tuple[Plan, dict[str, np.ndarray], dict[int, int]]:
    """The global parameters, read from a snapshot of every fragment on its owning shard.

    The plan and the cluster map come from one welcome of the shard at `connect`.

    Args:
        connect: ROUTER endpoint of any shard (normally shard 0).
        timeout_s: per-request timeout.
        curve: client keys for a CURVE cluster (None: plain).
        island: the id the welcome's hello uses (None: a probe id of its own). Under
            CURVE it must be an id the key may act as, not live elsewhere.

    Returns:
        (plan, flat params {leaf path: float32 array of the leaf's shape}, versions
        {fragment: version of the values read}).

    Raises:
        ProbeError: a shard did not answer, the cluster is not initialized, or a
            plan or snapshot is unusable.
    """
    ctx = zmq.Context()
    try:
        welcome = _welcome(ctx, connect, timeout_s, curve, island)
        if not welcome["initialized"] or welcome.get("plan") is None:
            raise _not_initialized(connect)
        try:
            plan = Plan.from_wire(welcome["plan"])
        except PlanError as exc:
            raise ProbeError(f"{connect} sent an unusable plan: {exc}") from None
        endpoints = _endpoints_of(welcome, connect)
        if len(endpoints) != plan.num_shards:
            raise ProbeError(
                f"{connect} lists {len(endpoints)} shard endpoints but the plan has "
                f"{plan.num_shards} shards"
            )
        flat = {leaf.path: np.empty(leaf.shape, np.float32) for leaf in plan.leaves}
        limit = welcome.get("max_message_bytes", protocol.DEFAULT_MAX_MESSAGE_BYTES)
        versions = {}
        for frag in plan.fragments:  # the fragments cover every element exactly once
            router = endpoints[frag.shard][0]
            versions[frag.index], values = _fragment_values(
                ctx, router, frag.index, frag.size, timeout_s, curve, limit
            )
            plan.scatter(frag.index, values, flat)
        return plan, flat, versions
    finally:
        ctx.destroy(linger=0)
