"""A peer flooding one shard, for `diloco-bench load --flood`: a flat-out pusher or a hostile sender.

    python -m bench.children.flood_peer --role flooder|hostile --connect ROUTER
        --params N --stats FILE [--rate R] [--window W]

Both speak the wire protocol over one raw DEALER (no client library: they
never wait for a reply, and count every one). Each says `hello` (island
`flooder` / `hostile`), prints ``ready``, floods until SIGTERM and then
writes its counts as JSON to `--stats`.

- flooder: pushes valid int8 deltas of the shard's fragments (the plan of one
  flat float32 leaf of N elements, as `diloco-bench load` initialises it),
  rounds increasing, with no pause: the next as soon as fewer than `--window`
  (256) are outstanding (answered or 2 s old), as a client with a big
  `max_unacked` does; `--window 0` sends as fast as the socket takes them,
  ZeroMQ's queues the only bound (a full send queue is counted `send_blocked`).
- hostile: `--rate` messages a second (default 10,000, in bursts every
  10 ms): random bytes, headers that do not decode or validate (v 2, v true,
  unknown kinds, mistyped fields), and pushes with valid headers from its
  island whose small payloads are corrupt (a flipped bit, NaN, a wrong shape),
  so they get past the header checks to the payload's.

Counts: sent, send_blocked, answered (replies read), expired (flooder: no
reply within 2 s: dropped by the shard), by_reason (reply kind, or
ack outcome, or the refusal's reason -> count), retry_after_s (min, median,
max of the `throttled` replies' values).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

import codec
from bench.child import say_ready, stop_on_signals
from paramserver.wire import protocol
from paramserver.wire.plan import leaf_specs, make_plan

BURSTS_PER_S = 100  # the hostile peer sends its rate in this many bursts a second
POOL = 1000  # distinct hostile messages, made once
EXPIRE_S = 2.0  # the flooder gives up on a reply after this long (our client's ack floor)


class Peer:
    """One DEALER to the shard, counting what it sends and what comes back."""

    def __init__(self, connect: str, island: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(connect)
        self.island = island
        self.sent = self.blocked = self.answered = 0
        self.by_reason: Counter = Counter()
        self.retry_after: list[float] = []
        self.expired = 0  # sent, no reply within EXPIRE_S: dropped by the shard
        self.ids = itertools.count(1)
        self._waiting: dict[int, float] = {}  # id -> when sent, in send order

    @property
    def outstanding(self) -> int:
        """Messages sent and neither answered nor expired."""
        return len(self._waiting)

    def expire(self, before: float) -> None:
        """Give up on the messages sent before `before` without a reply (counted)."""
        while self._waiting:
            rid, sent = next(iter(self._waiting.items()))
            if sent >= before:
                return
            del self._waiting[rid]
            self.expired += 1

    def hello(self) -> dict[str, Any]:
        """Say hello and return the welcome (the only reply waited for)."""
        self.sock.send_multipart(protocol.pack({"kind": "hello", "island": self.island}))
        if not self.sock.poll(60_000):
            raise SystemExit(f"{self.island}: no welcome from the shard")
        welcome, _ = protocol.unpack(self.sock.recv_multipart(), role=protocol.REPLY)
        if welcome["kind"] != "welcome" or not welcome["initialized"]:
            raise SystemExit(f"{self.island}: the shard answered {welcome}")
        return welcome

    def send(self, frames: list[bytes], rid: int | None = None) -> bool:
        """Send without blocking; False (counted) when the send queue is full.

        Args:
            frames: the message.
            rid: its header's id, to wait for its reply (`outstanding`); None: no wait.
        """
        try:
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.blocked += 1
            return False
        self.sent += 1
        if rid is not None:
            self._waiting[rid] = time.monotonic()
        return True

    def drain(self, wait_ms: int = 0) -> None:
        """Read every reply waiting (after up to `wait_ms` for the first) and count it."""
        while self.sock.poll(wait_ms):
            wait_ms = 0
            frames = self.sock.recv_multipart()
            self.answered += 1
            if frames and not frames[0]:  # answer to a message that began with an empty frame
                frames = frames[1:]
            try:
                reply, _ = protocol.unpack(frames, role=protocol.REPLY)
            except protocol.ProtocolError:
                self.by_reason["unreadable"] += 1
                continue
            if reply["kind"] == "ack" and reply["outcome"] != protocol.REJECTED:
                self.by_reason[reply["outcome"]] += 1
            elif reply["kind"] in ("ack", "rejected"):
                self.by_reason[reply["reason"]] += 1
            else:
                self.by_reason[reply["kind"]] += 1
            if reply.get("reason") == "throttled":
                self.retry_after.append(reply["retry_after_s"])
            self._waiting.pop(reply.get("id"), None)

    def counts(self) -> dict[str, Any]:
        """The counts written to --stats."""
        waits = self.retry_after
        return {
            "island": self.island,
            "sent": self.sent,
            "send_blocked": self.blocked,
            "answered": self.answered,
            "expired": self.expired,
            "by_reason": dict(sorted(self.by_reason.items())),
            "retry_after_s": None
            if not waits
            else {"min": min(waits), "p50": statistics.median(waits), "max": max(waits)},
        }

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def owned_fragments(welcome: dict[str, Any], params: int) -> tuple[Any, list[int]]:
    """The plan `diloco-bench load` initialises (one flat leaf "w") and this shard's fragments."""
    plan = make_plan(
        leaf_specs({"w": np.zeros(params, np.float32)}),
        welcome["num_shards"],
        welcome["num_fragments"],
    )
    if plan.hash != welcome["plan_hash"]:
        raise SystemExit(f"the shard's plan {welcome['plan_hash']} is not ours {plan.hash}")
    return plan, [f.index for f in plan.fragments_of(welcome["shard"])]


def push(island: str, plan: Any, rnd: int, fragment: int, payload: list[bytes],
         rid: int | None = None) -> list[bytes]:  # fmt: skip
    """A push message with a valid header (and the id `rid` when given)."""
    header = {"kind": "push", "island": island, "round": rnd, "fragment": fragment,
              "base_version": 0, "tokens": 1000, "steps": 10, "plan_hash": plan.hash}  # fmt: skip
    if rid is not None:
        header["id"] = rid
    return protocol.pack(header, payload)


def flood(peer: Peer, plan: Any, fragments: list[int], window: int, stop: Any) -> None:
    """The flooder: valid pushes, rounds increasing, as fast as its window allows, until `stop`.

    At most `window` pushes are outstanding (0: no bound, ZeroMQ's queues only): one
    is done when its reply comes, or after EXPIRE_S without one (the shard dropped
    it); the next goes out at once. Like a client with a big `max_unacked` that
    re-pushes whenever acked, except that a refused push is not sent again (a new
    round is).
    """
    rng = np.random.default_rng(0)
    payloads = {
        f: [bytes(x) for x in codec.int8().encode({"delta": rng.standard_normal(
            plan.fragments[f].size).astype(np.float32) * 1e-3})[0]]
        for f in fragments
    }  # fmt: skip
    todo = ((rnd, f) for rnd in itertools.count() for f in fragments)
    rnd, f = next(todo)
    while not stop.is_set():
        peer.expire(time.monotonic() - EXPIRE_S)
        if window and peer.outstanding >= window:
            peer.drain(wait_ms=1)
            continue
        rid = next(peer.ids)
        if peer.send(push(peer.island, plan, rnd, f, payloads[f], rid), rid if window else None):
            rnd, f = next(todo)
        else:
            peer.drain(wait_ms=1)
        peer.drain()


def garbage(rng: random.Random, peer: Peer, plan: Any, fragment: int, rnd: int) -> list[bytes]:
    """One hostile message (see the module docstring)."""
    kind = rng.randrange(6)
    if kind == 0:
        return [rng.randbytes(rng.choice((1, 16, 200)))]
    if kind == 1:
        return [msgpack.packb({"v": rng.choice((2, True, "1")), "kind": "push"})]
    if kind == 2:
        return [msgpack.packb({"v": 1, "kind": rng.choice(("pull", "PUSH", "shutdown"))})]
    if kind == 3:  # decodes, fails validation
        return [msgpack.packb({"v": 1, "kind": "push", "island": peer.island, "round": -1})]
    payload = [
        bytes(x) for x in codec.raw("float32").encode({"delta": np.zeros(16, np.float32)})[0]
    ]
    if kind == 5:  # the payload's crc broken (else: a small payload of the wrong shape)
        payload[1] = bytes([payload[1][0] ^ 1]) + payload[1][1:]
    return push(peer.island, plan, rnd, fragment, payload)


def hostile(peer: Peer, plan: Any, fragments: list[int], rate: float, stop: Any) -> None:
    """The hostile sender: `rate` messages a second of garbage, until `stop`.

    The messages are made once (a pool of POOL, sent in turn), so that sending
    them costs this process little: a refused push is never kept, so its round
    may repeat.
    """
    rng = random.Random(1)
    pool = [garbage(rng, peer, plan, rng.choice(fragments), 10**6 + i) for i in range(POOL)]
    per_burst = max(1, round(rate / BURSTS_PER_S))
    start = time.monotonic()
    messages = itertools.cycle(pool)
    for burst in itertools.count():
        for _ in range(per_burst):
            peer.send(next(messages))
        peer.drain()
        wait = start + (burst + 1) / BURSTS_PER_S - time.monotonic()
        if stop.wait(max(0.0, wait)):
            return


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2 for bad arguments)."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.children.flood_peer", description=__doc__
    )
    parser.add_argument("--role", choices=("flooder", "hostile"), required=True)
    parser.add_argument("--connect", required=True, help="the shard's ROUTER, tcp://HOST:PORT")
    parser.add_argument("--params", type=int, required=True, help="elements of the model")
    parser.add_argument("--stats", required=True, help="JSON file written at the end")
    parser.add_argument("--rate", type=float, default=10_000.0, help="hostile: messages/s")
    parser.add_argument(
        "--window", type=int, default=256, help="flooder: pushes outstanding at most (0: no bound)"
    )
    args = parser.parse_args(argv)
    if args.params < 1 or not args.rate > 0 or args.window < 0:
        print("--params must be >= 1, --rate > 0 and --window >= 0", file=sys.stderr)
        return 2
    stop = stop_on_signals()
    peer = Peer(args.connect, args.role)
    try:
        plan, fragments = owned_fragments(peer.hello(), args.params)
        say_ready()
        if args.role == "flooder":
            flood(peer, plan, fragments, args.window, stop)
        else:
            hostile(peer, plan, fragments, args.rate, stop)
        peer.drain(wait_ms=200)
        Path(args.stats).write_text(json.dumps(peer.counts()))
    finally:
        peer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
