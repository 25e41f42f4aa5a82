"""Heartbeat round trips to a shard while one large push is on its way (docs/protocol.md section 1).

A raw protocol client (pyzmq and the wire format, like an outside client):

    python -m bench.children.control_probe init --connect EP --params N
    python -m bench.children.control_probe push --connect EP --params N --links 1|2 --round R

`init` initialises a one-shard, one-fragment cluster with N float32 zeros
(run it next to the shard: the values cross no thin link). `push` says hello
on a control DEALER, times a few idle heartbeats (the link's round trip),
then sends one raw float32 delta of N elements (4N bytes and a few hundred of
headers) and, until its ack arrived, a `heartbeat` every `--beat-s` on the
control DEALER, timing each reply. With `--links 1` the push goes on that same
DEALER (one TCP connection: the heartbeats queue behind the push); with
`--links 2` on a second DEALER attached to the island (a hello with `attach`
and the session: its own TCP connection). Prints one JSON line: the idle
round trips, the push's seconds and Mbit/s, and the round trips of the
heartbeats sent while the push was in flight (p50, p99, max, count).
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
from typing import Any

import numpy as np
import zmq

import codec
from paramserver.wire import protocol
from paramserver.wire.plan import leaf_specs, make_plan

IDLE_BEATS = 5  # heartbeats timed before the push: the link's round trip


def _plan(params: int) -> Any:
    return make_plan(leaf_specs({"w": np.zeros(params, np.float32)}), 1, 1)


class Probe:
    """One island's DEALERs to one shard, and the replies they got."""

    def __init__(self, connect: str, island: str) -> None:
        self.ctx = zmq.Context()
        self.connect, self.island = connect, island
        self.session = secrets.token_hex(16)
        self.sockets: list[zmq.Socket] = []
        self.ids = 0

    def dealer(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.connect)
        self.sockets.append(sock)
        return sock

    def send(self, sock: zmq.Socket, header: dict[str, Any], payload: list[Any] = ()) -> int:
        self.ids += 1
        sock.send_multipart(
            protocol.pack({"island": self.island, "id": self.ids, **header}, list(payload)),
            copy=False,
        )
        return self.ids

    def request(self, sock: zmq.Socket, header: dict, payload: list = (), timeout_s=60.0) -> dict:
        rid = self.send(sock, header, payload)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sock.poll(100):
                reply, _ = protocol.unpack(sock.recv_multipart(), protocol.REPLY)
                if reply.get("id") == rid:
                    return reply
        raise TimeoutError(f"no reply to {header['kind']} within {timeout_s:g} s")

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(0)
        self.ctx.term()


def init(args: argparse.Namespace) -> dict[str, Any]:
    """Initialise the shard with zeros; the plan's hash."""
    plan = _plan(args.params)
    probe = Probe(args.connect, "probe-init")
    try:
        sock = probe.dealer()
        probe.request(sock, {"kind": "hello"})
        frames, _ = codec.raw("float32").encode({"0": np.zeros(args.params, np.float32)})
        reply = probe.request(sock, {"kind": "init", "plan": plan.to_wire()}, frames)
        if reply["kind"] != "init_ok" and reply.get("reason") != "already_initialized":
            raise RuntimeError(f"init refused: {reply}")
        probe.request(sock, {"kind": "bye"})
    finally:
        probe.close()
    return {"plan_hash": plan.hash}


def _quantiles(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"count": 0}
    arr = np.asarray(values) * 1000
    return {
        "count": len(values),
        "p50_ms": round(float(np.percentile(arr, 50)), 1),
        "p99_ms": round(float(np.percentile(arr, 99)), 1),
        "max_ms": round(float(arr.max()), 1),
    }


def push(args: argparse.Namespace) -> dict[str, Any]:
    """One push with heartbeats beside it; the figures (see the module docstring)."""
    plan = _plan(args.params)
    probe = Probe(args.connect, args.island)
    try:
        control = probe.dealer()
        welcome = probe.request(control, {"kind": "hello", "session": probe.session})
        if welcome["kind"] != "welcome":
            raise RuntimeError(f"hello refused: {welcome}")
        bulk = control
        if args.links == 2:
            bulk = probe.dealer()
            hello = {"kind": "hello", "session": probe.session, "attach": True}
            if (reply := probe.request(bulk, hello))["kind"] != "welcome":
                raise RuntimeError(f"attach refused: {reply}")
        idle = []
        for _ in range(IDLE_BEATS):
            t = time.monotonic()
            probe.request(control, {"kind": "heartbeat"})
            idle.append(time.monotonic() - t)
        frames, _ = codec.raw("float32").encode({"delta": np.zeros(args.params, np.float32)})
        header = {
            "kind": "push", "round": args.round, "fragment": 0, "base_version": 0,
            "tokens": 1000, "steps": 10, "plan_hash": plan.hash,
        }  # fmt: skip
        nbytes = protocol.message_bytes(protocol.pack(header, frames))
        sent: dict[int, float] = {}
        rtts: list[float] = []
        t0 = time.monotonic()
        push_id = probe.send(bulk, header, frames)
        ack: dict[str, Any] | None = None
        ack_s = None
        next_beat = t0
        poller = zmq.Poller()
        for sock in {control, bulk}:
            poller.register(sock, zmq.POLLIN)
        deadline = t0 + args.timeout_s
        while (ack is None or any(when < t0 + ack_s for when in sent.values())) and (
            time.monotonic() < deadline
        ):
            now = time.monotonic()
            if ack is None and now >= next_beat:
                sent[probe.send(control, {"kind": "heartbeat"})] = now
                next_beat = now + args.beat_s
            for sock, _ in poller.poll(max(1, int((next_beat - time.monotonic()) * 1000))):
                while sock.poll(0):
                    reply, _ = protocol.unpack(sock.recv_multipart(), protocol.REPLY)
                    at = time.monotonic()
                    if reply.get("id") == push_id:
                        ack, ack_s = reply, at - t0
                    elif reply.get("id") in sent:
                        rtts.append(at - sent.pop(reply["id"]))
        if ack is None:
            raise TimeoutError(f"no ack within {args.timeout_s:g} s")
        probe.request(control, {"kind": "bye"})
    finally:
        probe.close()
    return {
        "links": args.links,
        "push_bytes": nbytes,
        "push_s": round(ack_s, 3),
        "push_mbit_s": round(nbytes * 8 / ack_s / 1e6, 3),
        "outcome": ack["outcome"],
        "idle_rtt": _quantiles(idle),
        "heartbeat_rtt_during_push": _quantiles(rtts),
        "heartbeats_unanswered": len(sent),
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point: prints one JSON line; 1 when the shard did not answer."""
    parser = argparse.ArgumentParser(prog="python -m bench.children.control_probe")
    parser.add_argument("command", choices=["init", "push"])
    parser.add_argument("--connect", required=True, help="the shard's ROUTER endpoint")
    parser.add_argument("--params", type=int, required=True, help="float32 elements")
    parser.add_argument("--island", default="probe")
    parser.add_argument("--links", type=int, choices=[1, 2], default=2)
    parser.add_argument("--round", type=int, default=1)
    parser.add_argument("--beat-s", type=float, default=0.1, help="heartbeat period in the push")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    try:
        out = init(args) if args.command == "init" else push(args)
    except (TimeoutError, RuntimeError) as exc:
        print(f"control_probe: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
