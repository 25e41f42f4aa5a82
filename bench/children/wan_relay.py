"""A TCP relay into one region over the WAN: per source region one-way delay, jitter and loss.

The kernel here has `tbf` and `htb` but no `netem`, so the round-trip time,
its jitter and the cost of a lost packet are added in userspace, by this
relay; the links' rates are the kernel's (an `htb` class per link in the WAN
namespace, `bench.netns`). One relay process runs per region, inside the WAN
namespace, on that region's service address: it takes connections from the
other regions, tells the link by the client's source address, and connects
on into its region with the client region's service address as source, so
that the kernel can tell the links apart by source address and shape each.

Every chunk read on one side is written to the other side `one_way_ms`
+- `jitter_ms` (uniform) later; order is kept (a chunk is never due before
the one read ahead of it), as it is on a TCP stream.

Loss: the relay ends TCP on both sides, so a dropped packet cannot be
reproduced in band. What a loss costs a TCP stream is a stall until the
segment is sent again, and everything behind it waits (head-of-line
blocking). So a chunk of n bytes is "lost" with the probability that one of
its ceil(n / 1448) packets would be, and then it, and all that follows, is
held `loss_penalty_ms` longer (default 200 ms: Linux's minimum
retransmission timeout, the pessimistic case; fast retransmit would cost
about one RTT). Not emulated: the sender's congestion window shrinking after
the loss.

    python -m bench.children.wan_relay --config FILE.json [--stats FILE.json]

The config: {"listen": IP, "target": IP, "ports": [..], "peers": {SOURCE_IP:
{"bind": IP, "one_way_ms", "jitter_ms", "loss", "loss_penalty_ms", "seed"}}}:
it relays listen:PORT -> target:PORT for each port, for clients from each
SOURCE_IP with that link's impairments, binding `bind` as the source of the
outgoing connection; other clients are refused. Prints ``ready`` once every
listener is bound; runs until SIGTERM, then writes its byte counters to
`--stats`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

from bench.child import say_ready, stop_on_signals

CHUNK = 64 * 1024
QUEUE_BYTES = 4 * 1024 * 1024  # per connection and direction: what the relay holds at most
MSS = 1448


class WanRelayError(ValueError):
    """A route of the config is invalid; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Route:
    """One link into the relay's region: the client region's source address, its impairments."""

    source: str
    bind: str
    one_way_ms: float
    jitter_ms: float = 0.0
    loss: float = 0.0
    loss_penalty_ms: float = 200.0
    seed: int = 0

    @classmethod
    def from_dict(cls, source: str, raw: dict[str, Any]) -> Route:
        """Validate one peer of the config.

        Args:
            source: the client region's address.
            raw: the JSON object.

        Returns:
            The route.

        Raises:
            WanRelayError: a field is missing or out of range.
        """
        try:
            route = cls(
                source=source,
                bind=str(raw["bind"]),
                one_way_ms=float(raw["one_way_ms"]),
                jitter_ms=float(raw.get("jitter_ms", 0.0)),
                loss=float(raw.get("loss", 0.0)),
                loss_penalty_ms=float(raw.get("loss_penalty_ms", 200.0)),
                seed=int(raw.get("seed", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise WanRelayError(f"bad route {raw!r}: {exc}") from None
        if route.one_way_ms < 0 or route.jitter_ms < 0 or route.loss_penalty_ms < 0:
            raise WanRelayError(f"peer {source}: delays must be >= 0")
        if route.jitter_ms > route.one_way_ms:
            raise WanRelayError(f"peer {source}: jitter_ms must not exceed one_way_ms")
        if not 0.0 <= route.loss < 1.0:
            raise WanRelayError(f"peer {source}: loss must be in [0, 1)")
        return route


def chunk_loss_probability(nbytes: int, packet_loss: float) -> float:
    """The probability that a chunk of `nbytes` loses at least one of its packets.

    Args:
        nbytes: chunk size.
        packet_loss: loss probability of one packet (MSS bytes).

    Returns:
        1 - (1 - p) ** ceil(nbytes / MSS).
    """
    return 1.0 - (1.0 - packet_loss) ** math.ceil(nbytes / MSS)


class Impairment:
    """When each chunk of one direction of one connection is due (order kept)."""

    def __init__(self, route: Route, rng: random.Random) -> None:
        """Args:
        route: the link's delay, jitter and loss.
        rng: the seeded generator of this direction.
        """
        self.route = route
        self.rng = rng
        self.last_due = 0.0
        self.losses = 0

    def due(self, now: float, nbytes: int) -> float:
        """The time a chunk read at `now` may be written on.

        Args:
            now: loop time when the chunk was read.
            nbytes: its size.

        Returns:
            now + one way +- jitter (+ the loss penalty), never before the previous chunk.
        """
        r = self.route
        delay = r.one_way_ms + (self.rng.uniform(-r.jitter_ms, r.jitter_ms) if r.jitter_ms else 0)
        if r.loss and self.rng.random() < chunk_loss_probability(nbytes, r.loss):
            delay += r.loss_penalty_ms
            self.losses += 1
        self.last_due = max(self.last_due, now + delay / 1000.0)
        return self.last_due


class Counters:
    """Bytes relayed per route (listen address) and direction, and emulated losses."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}  # "listen->target" -> bytes
        self.losses: dict[str, int] = {}
        self.connections = 0

    def add(self, key: str, nbytes: int) -> None:
        """Count `nbytes` relayed under `key`."""
        self.sent[key] = self.sent.get(key, 0) + nbytes


async def _pipe(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    impairment: Impairment,
    counters: Counters,
    key: str,
) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    room = asyncio.Semaphore(QUEUE_BYTES // CHUNK)

    async def read() -> None:
        try:
            while data := await reader.read(CHUNK):
                await room.acquire()
                await queue.put((impairment.due(loop.time(), len(data)), data))
        except OSError:
            pass
        await queue.put(None)

    reading = asyncio.ensure_future(read())
    try:
        while (item := await queue.get()) is not None:
            due, data = item
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
            room.release()
            counters.add(key, len(data))
        if writer.can_write_eof():  # a half close travels on: the other direction may still talk
            writer.write_eof()
    except OSError:
        with contextlib.suppress(OSError, RuntimeError):
            writer.close()
    finally:
        reading.cancel()
        counters.losses[key] = counters.losses.get(key, 0) + impairment.losses


async def _serve(
    listen: str, target: str, ports: list[int], routes: dict[str, Route], stats: Path | None
) -> None:
    counters = Counters()
    seeds = random.Random(sum(r.seed for r in routes.values()))

    async def handler(reader, writer, port: int) -> None:
        route = routes.get(writer.get_extra_info("peername")[0])
        try:
            if route is None:  # not a region of this WAN
                raise ConnectionRefusedError
            treader, twriter = await asyncio.open_connection(
                target, port, local_addr=(route.bind, 0)
            )
        except OSError:
            writer.close()
            return
        counters.connections += 1
        up = Impairment(route, random.Random(seeds.random()))
        down = Impairment(route, random.Random(seeds.random()))
        try:
            await asyncio.gather(
                _pipe(reader, twriter, up, counters, f"{route.source}->{target}"),
                _pipe(treader, writer, down, counters, f"{target}->{route.source}"),
            )
        finally:
            for w in (writer, twriter):
                with contextlib.suppress(OSError, RuntimeError):
                    w.close()

    stop = stop_on_signals()
    servers = [
        await asyncio.start_server(lambda r, w, p=port: handler(r, w, p), listen, port)
        for port in ports
    ]
    say_ready()
    await asyncio.to_thread(stop.wait)
    for server in servers:
        server.close()
    if stats is not None:
        stats.write_text(
            json.dumps(
                {
                    "bytes": counters.sent,
                    "losses": counters.losses,
                    "connections": counters.connections,
                }
            )
        )


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2 for a bad config)."""
    parser = argparse.ArgumentParser(prog="python -m bench.children.wan_relay", description=__doc__)
    parser.add_argument("--config", type=Path, required=True, help="JSON: listen, target, peers")
    parser.add_argument("--stats", type=Path, default=None, help="write byte counters here on exit")
    args = parser.parse_args(argv)
    try:
        raw = json.loads(args.config.read_text())
        listen, target = str(raw["listen"]), str(raw["target"])
        ports = [int(p) for p in raw["ports"]]
        routes = {src: Route.from_dict(src, peer) for src, peer in raw["peers"].items()}
        if not ports or not routes:
            raise WanRelayError("the config needs ports and peers")
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        print(f"wan_relay: bad config: {exc}", file=sys.stderr)
        return 2
    asyncio.run(_serve(listen, target, ports, routes, args.stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
