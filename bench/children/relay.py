"""A TCP relay that adds one-way latency (and, as a fallback, a rate limit) to a link.

Kernel shaping here has `tbf` but no `netem`, so latency is added in this
relay: every chunk read on one side is written to the other side `delay_ms`
later, order preserved. Where network namespaces cannot be made, the relay also
limits each direction of each connection to `rate_mbit` with a token bucket
(the bench says which shaping it used). It is transparent to ZeroMQ (ZMTP is a
plain TCP stream), so islands and ranks reach shards or the reducer through it.

    python -m bench.children.relay --pair LISTEN_HOST:PORT=TARGET_HOST:PORT [--pair ...]
                          [--delay-ms 25] [--rate-mbit 0]

Prints ``ready`` on stdout once every listener is bound; runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from bench.child import say_ready, stop_on_signals

CHUNK = 16 * 1024
QUEUE_CHUNKS = 64


class RelayError(ValueError):
    """A relay argument is invalid."""


def parse_pair(text: str) -> tuple[str, int, str, int]:
    """Parse ``LHOST:LPORT=THOST:TPORT``.

    Args:
        text: the pair as given on the command line.

    Returns:
        (listen host, listen port, target host, target port).
    """
    try:
        listen, target = text.split("=")
        lhost, lport = listen.rsplit(":", 1)
        thost, tport = target.rsplit(":", 1)
        return lhost, int(lport), thost, int(tport)
    except ValueError:
        raise RelayError(f"bad --pair {text!r}: expected LHOST:LPORT=THOST:TPORT") from None


class TokenBucket:
    """Bytes per second with a burst allowance; `take` sleeps until the bytes may pass."""

    def __init__(self, rate_bytes_s: float, burst_bytes: float) -> None:
        """Args:
        rate_bytes_s: sustained rate.
        burst_bytes: bucket capacity.
        """
        self.rate = rate_bytes_s
        self.capacity = burst_bytes
        self.tokens = burst_bytes
        self.stamp = time.monotonic()

    def wait_s(self, nbytes: int, now: float) -> float:
        """Seconds until `nbytes` may pass (0 if now); charges the bucket.

        Args:
            nbytes: size of the chunk.
            now: monotonic seconds.

        Returns:
            The delay before the chunk is released.
        """
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= nbytes
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float, rate: float
) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue(QUEUE_CHUNKS)
    bucket = TokenBucket(rate, max(CHUNK, rate * 0.01)) if rate > 0 else None

    async def read() -> None:
        try:
            while data := await reader.read(CHUNK):
                await queue.put((loop.time() + delay_s, data))
        except OSError:
            pass
        await queue.put(None)

    reading = asyncio.ensure_future(read())
    try:
        while (item := await queue.get()) is not None:
            due, data = item
            if bucket is not None:
                due = max(due, loop.time() + bucket.wait_s(len(data), loop.time()))
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        reading.cancel()
        with contextlib.suppress(OSError, RuntimeError):
            writer.close()


async def serve_pairs(
    pairs: list[tuple[str, int, str, int]],
    join: Callable[
        [
            asyncio.StreamReader,
            asyncio.StreamWriter,
            asyncio.StreamReader,
            asyncio.StreamWriter,
            int,
        ],
        Awaitable[Any],
    ],
) -> None:
    """Listen on every LHOST:LPORT and join each connection to its THOST:TPORT until SIGTERM.

    Prints "ready" once listening. A connection whose target refuses is closed.

    Args:
        pairs: (lhost, lport, thost, tport) each.
        join: awaited with (reader, writer, target reader, target writer, lport) to move
            the bytes both ways.
    """

    async def handler(reader, writer, lport: int, thost: str, tport: int) -> None:
        try:
            treader, twriter = await asyncio.open_connection(thost, tport)
        except OSError:
            writer.close()
            return
        await join(reader, writer, treader, twriter, lport)

    stop = stop_on_signals()
    servers = []
    for lhost, lport, thost, tport in pairs:
        servers.append(
            await asyncio.start_server(
                lambda r, w, lp=lport, h=thost, p=tport: handler(r, w, lp, h, p), lhost, lport
            )
        )
    say_ready()
    await asyncio.to_thread(stop.wait)
    for server in servers:
        server.close()


async def _serve(pairs: list[tuple[str, int, str, int]], delay_s: float, rate: float) -> None:
    await serve_pairs(
        pairs,
        lambda r, w, tr, tw, _lport: asyncio.gather(
            _pipe(r, tw, delay_s, rate), _pipe(tr, w, delay_s, rate)
        ),
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2 for bad arguments)."""
    parser = argparse.ArgumentParser(prog="python -m bench.children.relay", description=__doc__)
    parser.add_argument("--pair", action="append", required=True, help="LHOST:LPORT=THOST:TPORT")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way latency added")
    parser.add_argument(
        "--rate-mbit", type=float, default=0.0, help="per-direction rate limit (0 = none)"
    )
    args = parser.parse_args(argv)
    try:
        pairs = [parse_pair(p) for p in args.pair]
        if args.delay_ms < 0 or args.rate_mbit < 0:
            raise RelayError("--delay-ms and --rate-mbit must be >= 0")
    except RelayError as exc:
        print(f"relay: {exc}", file=sys.stderr)
        return 2
    asyncio.run(_serve(pairs, args.delay_ms / 1000, args.rate_mbit * 1e6 / 8))
    return 0


if __name__ == "__main__":
    sys.exit(main())
