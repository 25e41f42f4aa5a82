"""Asking running shards for their status over the wire (for `diloco-server status` and metrics).

This module owns the read-only queries an operator tool makes: one `status`
request per shard, and learning the cluster map from the shard it was
pointed at. Every request has a finite timeout; nothing here keeps state.

The cluster map comes from the `status` reply when it lists `endpoints`,
otherwise from a `welcome` (hello, immediately followed by bye, under an
island id starting with ``diloco-status-`` so it is recognisable in logs).
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any

import zmq

from paramserver import protocol

logger = logging.getLogger(__name__)

_IDS = itertools.count(1)


class ProbeError(RuntimeError):
    """A shard did not answer in time, or answered something unusable."""


def _request(
    ctx: zmq.Context, endpoint: str, header: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        rid = next(_IDS)
        sock.send_multipart(protocol.pack({**header, "id": rid}))
        deadline_ms = int(timeout_s * 1000)
        while True:
            if not sock.poll(deadline_ms):
                raise ProbeError(
                    f"no reply from {endpoint} within {timeout_s:g}s: is the server running there?"
                )
            try:
                reply, _ = protocol.unpack(sock.recv_multipart(), protocol.REPLY)
            except protocol.ProtocolError as exc:
                raise ProbeError(f"{endpoint} sent an unusable reply: {exc}") from None
            if reply.get("id") == rid:
                break
        if reply["kind"] == "rejected":
            raise ProbeError(
                f"{endpoint} refused {header['kind']}: {reply['reason']}: {reply['detail']}"
            )
        return reply
    except zmq.ZMQError as exc:
        raise ProbeError(f"cannot reach {endpoint}: {exc}") from None
    finally:
        sock.close(linger=0)


def shard_status(ctx: zmq.Context, endpoint: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """The status map of one shard.

    Args:
        ctx: a ZeroMQ context.
        endpoint: the shard's ROUTER, e.g. tcp://127.0.0.1:5555.
        timeout_s: how long to wait for the reply.

    Returns:
        The shard's status dict (see `paramserver.state.ShardState.status`).

    Raises:
        ProbeError: no reply in time or an unusable one.
    """
    reply = _request(ctx, endpoint, {"kind": "status"}, timeout_s)
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
    island = f"diloco-status-{os.getpid()}"
    welcome = _request(ctx, connect, {"kind": "hello", "island": island}, timeout_s)
    try:
        _request(ctx, connect, {"kind": "bye", "island": island}, timeout_s)
    except ProbeError as exc:
        logger.debug("bye after status hello failed: %s", exc)
    if welcome["kind"] != "welcome":
        raise ProbeError(f"{connect} answered hello with {welcome['kind']!r}")
    endpoints = [(str(r), str(p)) for r, p in welcome["endpoints"]]
    index = welcome["shard"]
    if 0 <= index < len(endpoints):
        endpoints[index] = (connect, endpoints[index][1])
    return endpoints


def cluster_status(connect: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """Status of every shard of the cluster that `connect` belongs to.

    Args:
        connect: ROUTER endpoint of any shard (normally shard 0).
        timeout_s: per-request timeout.

    Returns:
        {"connect": connect, "shards": [status dict + "endpoint" per shard]};
        a shard that did not answer has {"shard", "endpoint", "error"} instead.

    Raises:
        ProbeError: the shard at `connect` did not answer.
    """
    ctx = zmq.Context()
    try:
        first = shard_status(ctx, connect, timeout_s)
        if "endpoints" in first:
            endpoints = [(str(r), str(p)) for r, p in first["endpoints"]]
        else:
            endpoints = cluster_endpoints(ctx, connect, timeout_s)
        shards = []
        for index, (router, _pub) in enumerate(endpoints):
            if index == first.get("shard"):
                shards.append({**first, "endpoint": connect})
                continue
            try:
                shards.append({**shard_status(ctx, router, timeout_s), "endpoint": router})
            except ProbeError as exc:
                shards.append({"shard": index, "endpoint": router, "error": str(exc)})
        return {"connect": connect, "shards": shards}
    finally:
        ctx.destroy(linger=0)
