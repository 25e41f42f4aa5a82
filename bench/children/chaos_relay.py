"""A ZeroMQ chaos relay between islands and shards: forwards every request and reply, injects faults.

For each shard it binds a ROUTER where islands connect (the address the
cluster file advertises) and opens one DEALER to the shard's real ROUTER per
island connection, so the shard sees each island as its own peer; when an
island shows up on a new connection (a reconnect, a restart) the DEALERs of
its older ones are closed with what they still queue, as their TCP
connections were. During a
fault's window (`bench.faults`: cut_link, slow_link, drop, duplicate, delay,
corrupt) it drops, holds, duplicates or corrupts (one payload byte flipped:
the shard's codec checksum must catch it) the target island's messages, both
ways for link faults, pushes and acks for message faults. Published updates
do not pass through it (islands subscribe to the shards' PUB directly).

It also records every ack the shards send (`acked_by_shard`), every ack
that reached an island (`acked_delivered`), with times, the tokens of every
push key, when each push key first went on to its shard (`pushed`), and how
often each fault fired; on SIGTERM it writes them as JSON to `--stats`.

    python -m bench.children.chaos_relay --pair LISTEN=TARGET [--pair ...] --schedule FILE
        --start-file FILE --seed S --stats FILE

The schedule's times count from the epoch seconds written in `--start-file`
(the run's start); until that file exists no fault is active. Prints
``ready`` once every listener is bound.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

from bench.child import say_ready, stop_on_signals
from bench.faults import RELAY_KINDS, Fault, active

POLL_MS = 20


def _header(frames: list[bytes]) -> dict[str, Any]:
    try:
        h = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    except Exception:
        return {}
    return h if isinstance(h, dict) else {}


def corrupt(frames: list[bytes], rng: random.Random) -> list[bytes]:
    """Flip one bit of one payload byte (frame 1 or later); the header stays intact.

    Args:
        frames: the message frames.
        rng: the seeded generator.

    Returns:
        New frames (unchanged when there is no payload).
    """
    payload = [i for i in range(1, len(frames)) if len(frames[i]) > 0]
    if not payload:
        return frames
    i = payload[-1]  # the data frame (the codec header is frame 1)
    buf = bytearray(frames[i])
    buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    return [*frames[:i], bytes(buf), *frames[i + 1 :]]


class Relay:
    """The relay's state: sockets, identity -> island map, held messages, counters."""

    def __init__(
        self, pairs: list[tuple[str, str]], faults: list[Fault], start_file: Path, seed: int
    ) -> None:
        """Bind the front ROUTERs (backends are opened per island connection).

        Args:
            pairs: (listen, target) endpoints, one per shard.
            faults: the schedule (only relay kinds are acted on).
            start_file: holds the run's start (epoch seconds) once it begins.
            seed: seeds the per-message coin flips.
        """
        self.ctx = zmq.Context()
        self.faults = [f for f in faults if f.kind in RELAY_KINDS]
        self.start_file = start_file
        self.t0: float | None = None
        self.rng = random.Random(seed)
        self.fronts: list[zmq.Socket] = []
        self.targets = [t for _, t in pairs]
        self.backends: dict[tuple[int, bytes], zmq.Socket] = {}
        self.closed: set[tuple[int, bytes]] = set()  # connections an island replaced
        self.owner: dict[zmq.Socket, tuple[int, bytes]] = {}
        self.island_of: dict[tuple[int, bytes], str] = {}
        self.poller = zmq.Poller()
        self.held: list[tuple[float, int, str, Any, list[bytes]]] = []
        self._tie = itertools.count()
        self.fired: dict[str, int] = {}
        self.acked_by_shard: list[list[Any]] = []
        self.acked_delivered: list[list[Any]] = []
        self.forwarded = 0
        self.tokens: dict[tuple[str, Any, Any], Any] = {}
        self.pushed: dict[tuple[str, Any, Any], float] = {}
        for listen, _ in pairs:
            sock = self.ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(listen)
            self.fronts.append(sock)
            self.poller.register(sock, zmq.POLLIN)

    # -- time and faults -------------------------------------------------------

    def now_s(self) -> float | None:
        """Seconds since the run started, or None before it did."""
        if self.t0 is None and self.start_file.exists():
            text = self.start_file.read_text().strip()
            if text:
                self.t0 = float(text)
        return None if self.t0 is None else time.time() - self.t0

    def _fire(self, fault: Fault) -> None:
        self.fired[f"{fault.kind}@{fault.at_s}"] = (
            self.fired.get(f"{fault.kind}@{fault.at_s}", 0) + 1
        )

    def _decide(self, island: str | None, kind: str | None, t: float | None) -> tuple[str, float]:
        """What to do with one message: ("pass"|"drop"|"dup"|"corrupt", hold seconds)."""
        if t is None or island is None:
            return "pass", 0.0
        hold = 0.0
        for f in active(self.faults, t):
            if f.target != island:
                continue
            if f.kind == "cut_link":
                self._fire(f)
                return "drop", 0.0
            if f.kind == "slow_link":
                self._fire(f)
                hold = max(hold, f.delay_ms / 1000)
                continue
            if kind not in ("push", "ack") or (f.kind == "corrupt" and kind != "push"):
                continue
            if self.rng.random() >= f.prob:
                continue
            self._fire(f)
            if f.kind == "drop":
                return "drop", 0.0
            if f.kind == "duplicate":
                return "dup", hold
            if f.kind == "corrupt":
                return "corrupt", hold
            if f.kind == "delay":
                hold = max(hold, self.rng.uniform(0.0, f.delay_ms / 1000))
        return "pass", hold

    # -- forwarding ------------------------------------------------------------

    def _backend(self, shard: int, ident: bytes) -> zmq.Socket:
        key = (shard, ident)
        sock = self.backends.get(key)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.targets[shard])
            self.backends[key] = sock
            self.owner[sock] = key
            self.poller.register(sock, zmq.POLLIN)
        return sock

    def _emit(self, direction: str, shard: int, ident: bytes, frames: list[bytes]) -> None:
        if (shard, ident) in self.closed:
            return  # held while its connection was replaced
        if direction == "up":
            self._backend(shard, ident).send_multipart(frames)
            h = _header(frames)
            if h.get("kind") == "push":  # when each delta first went on to its shard
                key = (str(h.get("island")), h.get("fragment"), h.get("round"))
                self.pushed.setdefault(key, time.time())
        else:
            self.fronts[shard].send_multipart([ident, *frames])
            h = _header(frames)
            if h.get("kind") == "ack" and h.get("outcome") in ("accepted", "duplicate"):
                island = self.island_of.get((shard, ident), "?")
                self.acked_delivered.append([island, h["fragment"], h["round"], time.time()])
        self.forwarded += 1

    def _new_connection(self, shard: int, ident: bytes, island: str) -> None:
        """An island says hello on a new connection to a shard: its older ones are gone.

        A client reconnects with a fresh DEALER, and a restarted island is a new
        peer; their old TCP connections closed, and what they still queued died
        with them. Here the old backends would live on and, once a killed shard
        is back, deliver their stale hellos after the new one (the shard would
        bind the island to a dead connection and refuse its pushes
        `island_in_use`): close them, dropping what they queue.
        """
        for key in [
            k
            for k, name in self.island_of.items()
            if name == island and k[0] == shard and k != (shard, ident) and k in self.backends
        ]:
            sock = self.backends.pop(key)
            del self.owner[sock]
            self.poller.unregister(sock)
            sock.close(linger=0)
            self.closed.add(key)

    def _route(self, direction: str, shard: int, ident: bytes, frames: list[bytes]) -> None:
        if direction == "up" and (shard, ident) in self.closed:
            return  # a late message of a connection the island has replaced
        h = _header(frames)
        if direction == "up" and isinstance(h.get("island"), str):
            if (
                self.island_of.get((shard, ident)) != h["island"]
                and h.get("kind") == "hello"
                and not h.get("attach")
            ):  # a new control connection; a bulk link's attach joins the island's others
                self._new_connection(shard, ident, h["island"])
            self.island_of[(shard, ident)] = h["island"]
            if h.get("kind") == "push":
                key = (h["island"], h.get("fragment"), h.get("round"))
                self.tokens[key] = h.get("tokens", 0)
        island = self.island_of.get((shard, ident))
        if (
            direction == "down"
            and h.get("kind") == "ack"
            and h.get("outcome") in ("accepted", "duplicate")
        ):
            self.acked_by_shard.append(
                [island, h["fragment"], h["round"], h.get("outcome"), time.time()]
            )
        action, hold = self._decide(island, h.get("kind"), self.now_s())
        if action == "drop":
            return
        if action == "corrupt":
            frames = corrupt(frames, self.rng)
        copies = 2 if action == "dup" else 1
        for _ in range(copies):
            if hold > 0:
                due = time.monotonic() + hold
                heapq.heappush(self.held, (due, next(self._tie), direction, (shard, ident), frames))
            else:
                self._emit(direction, shard, ident, frames)

    def _release_held(self) -> None:
        now = time.monotonic()
        while self.held and self.held[0][0] <= now:
            _, _, direction, (shard, ident), frames = heapq.heappop(self.held)
            self._emit(direction, shard, ident, frames)

    def serve(self, stop: threading.Event) -> None:
        """Forward until `stop` is set."""
        while not stop.is_set():
            timeout = POLL_MS
            if self.held:
                timeout = max(0, min(timeout, int((self.held[0][0] - time.monotonic()) * 1000)))
            for sock, _ in self.poller.poll(timeout):
                for _ in range(64):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if sock in self.owner:
                        shard, ident = self.owner[sock]
                        self._route("down", shard, ident, frames)
                    else:
                        shard = self.fronts.index(sock)
                        self._route("up", shard, frames[0], frames[1:])
            self._release_held()

    def stats(self) -> dict[str, Any]:
        """What the relay saw and did (JSON-ready)."""
        return {
            "fired": self.fired,
            "forwarded": self.forwarded,
            "acked_by_shard": self.acked_by_shard,
            "acked_delivered": self.acked_delivered,
            "tokens": [[*key, n] for key, n in self.tokens.items()],
            "pushed": [[*key, t] for key, t in self.pushed.items()],
        }

    def close(self) -> None:
        """Close every socket and the context."""
        for sock in [*self.fronts, *self.backends.values()]:
            sock.close(linger=0)
        self.ctx.term()


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2 for bad arguments)."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.children.chaos_relay", description=__doc__
    )
    parser.add_argument("--pair", action="append", required=True, help="LISTEN=TARGET endpoints")
    parser.add_argument("--schedule", required=True, help="JSON list of faults")
    parser.add_argument("--start-file", required=True, help="holds the start time once it begins")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stats", required=True, help="JSON written on exit")
    args = parser.parse_args(argv)
    try:
        pairs = [tuple(p.split("=", 1)) for p in args.pair]
        if any(len(p) != 2 for p in pairs):
            raise ValueError(f"bad --pair in {args.pair}: expected LISTEN=TARGET")
        faults = [Fault.from_json(f) for f in json.loads(Path(args.schedule).read_text())]
    except (OSError, ValueError) as exc:
        print(f"chaos_relay: {exc}", file=sys.stderr)
        return 2
    relay = Relay(pairs, faults, Path(args.start_file), args.seed)
    stop = stop_on_signals()
    say_ready()
    try:
        relay.serve(stop)
    finally:
        Path(args.stats).write_text(json.dumps(relay.stats()))
        relay.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
