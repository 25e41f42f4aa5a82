"""Our island client pushing one large delta over a thin link, watched from the shard's side.

    python -m bench.children.control_client --connect EP --params N --control-link 0|1 --round R

A `paramserver.client.Client` (keep="versions": its join reads no values)
joins a one-shard, one-fragment cluster of N float32 parameters (initialised
already, e.g. by `bench.children.control_probe init`) with
`ClientConfig.control_link` off (one DEALER carries its heartbeats and the
push) or on (a control DEALER and a bulk DEALER, docs/protocol.md section 1),
and pushes one raw float32 delta of N elements with a long ack timeout (no
re-send while it is in flight). Meanwhile a watcher DEALER of its own asks
the shard's `status` every `--poll-s` and records how long the shard had not
heard the island (`islands[id].heard`, wall clock: every namespace shares the
host's clock) and whether it counted the island live. Prints one JSON line:
the push's seconds (None when it was not acked within `--timeout-s`), the
client's reconnects and re-sends, and the shard's view (largest silence,
polls where the island was not live).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np
import zmq

import codec
from paramserver.client import Client, ClientConfig
from paramserver.wire import protocol


def _status(sock: zmq.Socket, rid: int, timeout_s: float) -> dict[str, Any] | None:
    sock.send_multipart(protocol.pack({"kind": "status", "id": rid}))
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000) + 1):
            reply, _ = protocol.unpack(sock.recv_multipart(), protocol.REPLY)
            if reply.get("id") == rid:
                return reply.get("status")
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Join, push, watch; the figures (see the module docstring)."""
    island = f"client-{args.round}"
    cfg = ClientConfig(
        connect=args.connect, island=island, keep="versions", insecure=True,
        control_link=bool(args.control_link), ack_timeout_s=args.timeout_s,
        ack_timeout_cap_s=args.timeout_s, join_timeout_s=120.0,
    )  # fmt: skip
    ctx = zmq.Context()
    watcher = ctx.socket(zmq.DEALER)
    watcher.setsockopt(zmq.LINGER, 0)
    watcher.connect(args.connect)
    client = Client(cfg)
    silences: list[float] = []
    not_live = polls = 0
    push_s = None
    try:
        joined = client.join({"w": np.zeros(args.params, np.float32)})
        frames, _ = codec.raw("float32").encode({"delta": np.zeros(args.params, np.float32)})
        t0 = time.monotonic()
        client.push(0, args.round, joined.versions[0], 1000, 10, frames)
        deadline = t0 + args.timeout_s
        while time.monotonic() < deadline:
            if client.wait_settled(timeout_s=args.poll_s):
                push_s = time.monotonic() - t0
                break
            polls += 1
            status = _status(watcher, polls, args.poll_s * 10)
            if status is None:
                continue
            heard = status.get("islands", {}).get(island, {}).get("heard")
            if heard is not None:
                silences.append(max(0.0, time.time() - heard))
            not_live += island not in status.get("islands_live", [])
        stats = client.stats()
    finally:
        client.close(flush_timeout_s=1.0)
        watcher.close(0)
        ctx.term()
    return {
        "control_link": bool(args.control_link),
        "push_s": None if push_s is None else round(push_s, 3),
        "acked": stats["acked"],
        "reconnects": stats["reconnects"],
        "resent": stats["resent"],
        "shard_view": {
            "polls": polls,
            "polls_not_live": not_live,
            "max_silence_s": round(max(silences), 3) if silences else None,
        },
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point: prints one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m bench.children.control_client")
    parser.add_argument("--connect", required=True, help="the shard's ROUTER endpoint")
    parser.add_argument("--params", type=int, required=True, help="float32 elements")
    parser.add_argument("--control-link", type=int, choices=[0, 1], default=1)
    parser.add_argument("--round", type=int, default=1)
    parser.add_argument("--poll-s", type=float, default=0.2, help="status poll period")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="bound on the push")
    args = parser.parse_args(argv)
    print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
