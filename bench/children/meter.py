"""A TCP relay that counts the bytes crossing each link, per direction, in short time buckets.

Put in front of a shard's ROUTER, one listen port per island, it measures what
each island's socket sends and receives over time (ZMTP is a plain TCP
stream, so the relay is transparent to ZeroMQ). Bytes are counted when the
relay reads them from a side, into buckets of `--bucket-s` seconds of wall
time (`time.time()`), so a bench can cut them into windows of any multiple.

    python -m bench.children.meter --pair LHOST:LPORT=THOST:TPORT [--pair ...]
                                   --out FILE [--bucket-s 0.01]

Prints ``ready`` on stdout once every listener is bound; on SIGTERM writes
FILE as JSON and exits 0::

    {"bucket_s": 0.01, "links": {"LPORT": {"up": {"<bucket>": bytes, ...},
                                            "down": {...}}}}

where ``<bucket>`` is ``floor(time / bucket_s)``, "up" is what the connecting
side (the island) sent and "down" what the target (the shard) sent back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

from bench.children.relay import RelayError, parse_pair, serve_pairs

CHUNK = 64 * 1024


class Counter:
    """Bytes per (link, direction, time bucket)."""

    def __init__(self, bucket_s: float) -> None:
        """Args:
        bucket_s: bucket width in seconds (> 0).
        """
        self.bucket_s = bucket_s
        self.links: dict[str, dict[str, defaultdict[int, int]]] = {}

    def add(self, link: str, direction: str, nbytes: int, now: float) -> None:
        """Count `nbytes` read on `link` in `direction` ("up" or "down") at wall time `now`."""
        per_link = self.links.setdefault(link, {"up": defaultdict(int), "down": defaultdict(int)})
        per_link[direction][math.floor(now / self.bucket_s)] += nbytes

    def to_json(self) -> dict:
        """The counts as the JSON document the module docstring describes."""
        return {
            "bucket_s": self.bucket_s,
            "links": {
                link: {d: {str(k): v for k, v in sorted(b.items())} for d, b in dirs.items()}
                for link, dirs in self.links.items()
            },
        }


async def _pipe(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    count: Counter,
    link: str,
    direction: str,
) -> None:
    try:
        while data := await reader.read(CHUNK):
            count.add(link, direction, len(data), time.time())
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            writer.close()


async def _serve(pairs: list[tuple[str, int, str, int]], count: Counter) -> None:
    for _lhost, lport, _thost, _tport in pairs:
        count.links.setdefault(str(lport), {"up": defaultdict(int), "down": defaultdict(int)})
    await serve_pairs(
        pairs,
        lambda r, w, tr, tw, lport: asyncio.gather(
            _pipe(r, tw, count, str(lport), "up"), _pipe(tr, w, count, str(lport), "down")
        ),
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2 for bad arguments)."""
    parser = argparse.ArgumentParser(prog="python -m bench.children.meter", description=__doc__)
    parser.add_argument("--pair", action="append", required=True, help="LHOST:LPORT=THOST:TPORT")
    parser.add_argument("--out", required=True, help="JSON file written on SIGTERM")
    parser.add_argument("--bucket-s", type=float, default=0.01, help="bucket width (0.01 s)")
    args = parser.parse_args(argv)
    try:
        pairs = [parse_pair(p) for p in args.pair]
    except RelayError as exc:
        print(exc, file=sys.stderr)
        return 2
    if not args.bucket_s > 0:
        print("--bucket-s must be > 0", file=sys.stderr)
        return 2
    count = Counter(args.bucket_s)
    asyncio.run(_serve(pairs, count))
    Path(args.out).write_text(json.dumps(count.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
