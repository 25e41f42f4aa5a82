"""One island of the regions bench: synthetic int8 deltas through the real client, over the WAN.

    python -m bench.children.region_island --connect tcp://IP:PORT --island NAME
        [--params 2000000] [--rounds 3] [--compute-s 1.0] [--speed 1.0] [--seed 0]
        [--first-round 0] [--stop-file PATH] [--progress]

Runs inside its region's namespace. Joins with `paramserver.client.Client`
(no replica: it only pushes), then per round: "computes" for
compute_s / speed seconds (a sleep: the chips of a slower region take
longer), pushes every fragment's random int8 delta (`bench.load_cluster`) and
waits until each is acked. Meanwhile a thread asks the shard for its status
every `--status-interval-s` on a connection of its own, over the same link,
and times each answer: the control plane's latency while bulk bytes are in
flight. Prints one JSON line at the end: per round its seconds from the
first push to the last ack, the bytes the client sent, the ack latencies,
and the status round trips (each marked whether a transfer was in flight),
plus the client's counters. Exit 1 when a push failed.

For the faulted run (`bench.regions_fault_run`): `--progress` also prints a
JSON line when a round's push starts ({"pushing": round, "at": t}) and one
when it is settled ({"progress": {...the round's entry, "acked": the
fragments acked}}), so what a killed island had acked survives it;
`--first-round` resumes a restarted island at its first round not fully
acked (re-pushing it under the same idempotency keys); `--stop-file` ends the
run before the next round once that file exists. Times are
`time.monotonic()`, one clock for every process of the machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from bench.load_cluster import random_frames
from paramserver.client import Client, ClientConfig, ClientError
from paramserver.wire import protocol

STATUS_TIMEOUT_S = 30.0


def _status_loop(
    connect: str, interval_s: float, stop: threading.Event, samples: list[tuple[float, float]]
) -> None:
    """Time a status request on its own DEALER every `interval_s` until `stop`: (sent at, seconds)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(connect)
    ids = itertools.count(1)
    try:
        while not stop.is_set():
            rid = next(ids)
            sent = time.monotonic()
            sock.send_multipart(protocol.pack({"kind": "status", "id": rid}))
            deadline = sent + STATUS_TIMEOUT_S
            while not stop.is_set() and time.monotonic() < deadline:
                if sock.poll(100):
                    reply, _ = protocol.unpack(sock.recv_multipart(), protocol.REPLY)
                    if reply.get("id") == rid:
                        samples.append((sent, time.monotonic() - sent))
                        break
            stop.wait(interval_s)
    finally:
        sock.close(linger=0)


def run_island(args: argparse.Namespace) -> dict[str, Any]:
    """Join, push `args.rounds` rounds, measure; the JSON result."""
    client = Client(
        ClientConfig(
            connect=args.connect,
            island=args.island,
            insecure=True,
            keep="versions",
            push_timeout_s=600.0,
            join_timeout_s=600.0,
        )
    )
    plan = client.join({"w": np.zeros(args.params, np.float32)}).plan
    sizes = {f.index: f.size for f in plan.fragments}
    frames = random_frames(sizes, variants=2, seed=args.seed)
    status: list[tuple[float, float]] = []
    stop = threading.Event()
    watcher = threading.Thread(
        target=_status_loop, args=(args.connect, args.status_interval_s, stop, status), daemon=True
    )
    watcher.start()
    rounds: list[dict[str, Any]] = []
    failed = ""
    stop_file = Path(args.stop_file) if args.stop_file else None
    try:
        for r in range(args.first_round, args.rounds):
            if stop_file is not None and stop_file.exists():
                break
            time.sleep(args.compute_s / args.speed)
            sent0 = client.stats()["bytes_sent"]
            started = time.monotonic()
            if args.progress:
                print(json.dumps({"pushing": r, "at": started}), flush=True)
            for f in sorted(sizes):
                client.push(f, r, 0, 1000, 10, frames[f][r % 2])
            keys = [(r, f) for f in sizes]
            while "pending" in client.delta_outcomes(keys).values():
                time.sleep(0.005)
            ended = time.monotonic()
            rounds.append(
                {
                    "round": r,
                    "started": started,
                    "seconds": ended - started,
                    "bytes_sent": client.stats()["bytes_sent"] - sent0,
                    "ack_latency_s": client.ack_latencies(),
                    "outcomes": sorted(set(client.delta_outcomes(keys).values())),
                }
            )
            if args.progress:
                outcomes = client.delta_outcomes(keys).values()
                acked = sum(1 for o in outcomes if o in ("acked", "merged"))
                progress = {**rounds[-1], "acked": acked, "fragments": len(keys)}
                print(json.dumps({"progress": progress}), flush=True)
    except ClientError as exc:
        failed = str(exc)
    finally:
        stop.set()
        watcher.join(STATUS_TIMEOUT_S)
        stats = client.stats()
        client.close()
    windows = [(x["started"], x["started"] + x["seconds"]) for x in rounds]
    return {
        "island": args.island,
        "speed": args.speed,
        "params": args.params,
        "fragments": len(sizes),
        "rounds": rounds,
        "status_rtt": [
            {"at": at, "seconds": s, "in_transfer": any(a <= at <= b for a, b in windows)}
            for at, s in status
        ],
        "client": {k: stats[k] for k in ("bytes_sent", "pushes", "acked", "resent", "reconnects")},
        "failed": failed,
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point; exit 1 when a push failed."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.children.region_island", description=__doc__
    )
    parser.add_argument("--connect", required=True, help="the shard's ROUTER endpoint")
    parser.add_argument("--island", required=True, help="this island's id")
    parser.add_argument("--params", type=int, default=2_000_000, help="float32 parameters")
    parser.add_argument("--rounds", type=int, default=3, help="rounds to push")
    parser.add_argument("--compute-s", type=float, default=1.0, help="compute per round at speed 1")
    parser.add_argument(
        "--speed", type=float, default=1.0, help="relative chip speed (0.55: slower)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random deltas")
    parser.add_argument(
        "--status-interval-s", type=float, default=0.2, help="pause between status requests"
    )
    parser.add_argument("--first-round", type=int, default=0, help="the first round to push")
    parser.add_argument("--stop-file", default="", help="stop before a round once this exists")
    parser.add_argument(
        "--progress", action="store_true", help="a JSON line per push start and settled round"
    )
    result = run_island(parser.parse_args(argv))
    print(json.dumps(result), flush=True)
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
