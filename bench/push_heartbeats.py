"""Heartbeat latency on a shard's loop while it admits whole-model pushes, against quiet.

    python -m bench.push_heartbeats [--params N] [--pushes K] [--quiet-s S] [--out DIR]

One real shard (`bench.scale_shard.one_shard`, sync mode, one fragment: each
push is the whole model, int8 with the client's default zstd) and one
client-only island. A probe, on its own connection, says hello as an island
of its own (which never pushes, so no step runs) and sends a heartbeat every
PROBE_EVERY_S, timing each from send to reply. After one warm-up push (the
shard loads its compiled loops), quiet: the probes of `--quiet-s` seconds
without a push. Pushing: the island pushes K more rounds
one after another (each waits for its ack); a probe counts as "during a
push" when it was sent between a push and its ack (the bytes arriving, the
payload checked, its record appended and fsynced). JSON on stdout: p50, p99
and max of both, each push's ack latency, and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import zmq

from bench.scale import parse_count
from bench.scale_shard import Islands, one_shard
from paramserver.wire import protocol

PROBE_EVERY_S = 0.01
MAX_MESSAGE = 1 << 30


class Probe(threading.Thread):
    """Heartbeats from an island of its own, each timed to its reply: (sent_at, seconds)."""

    def __init__(self, connect: str) -> None:
        super().__init__(name="heartbeat-probe", daemon=True)
        self.connect = connect
        self.stop_event = threading.Event()
        self.samples: list[tuple[float, float]] = []
        self.ready = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.connect)
            self._ask(sock, {"kind": "hello", "island": "probe", "id": 0}, 30.0)
            self.ready.set()
            ids = 1
            while not self.stop_event.is_set():
                sent = time.monotonic()
                self._ask(sock, {"kind": "heartbeat", "island": "probe", "id": ids}, 60.0)
                self.samples.append((sent, time.monotonic() - sent))
                ids += 1
                self.stop_event.wait(PROBE_EVERY_S)
        except BaseException as exc:  # reported by the caller
            self.error = exc
            self.ready.set()
        finally:
            sock.close(0)

    def _ask(self, sock: zmq.Socket, header: dict, timeout_s: float) -> dict:
        sock.send_multipart(protocol.pack(header))
        deadline = time.monotonic() + timeout_s
        while not self.stop_event.is_set():
            if sock.poll(100):
                reply, _ = protocol.unpack(sock.recv_multipart(), protocol.REPLY)
                if reply.get("id") == header["id"]:
                    if reply["kind"] == "rejected":
                        raise RuntimeError(f"probe refused: {reply}")
                    return reply
            if time.monotonic() > deadline:
                raise TimeoutError(f"no reply to {header['kind']} in {timeout_s:g} s")
        return {}


def _summary(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    ms = np.asarray(values) * 1e3
    return {
        "count": len(values),
        "p50_ms": round(float(np.percentile(ms, 50)), 1),
        "p99_ms": round(float(np.percentile(ms, 99)), 1),
        "max_ms": round(float(ms.max()), 1),
    }


def measure(params: int, pushes: int, quiet_s: float, out: Path) -> dict:
    """Quiet heartbeats, then heartbeats while `pushes` whole-model pushes are admitted.

    Args:
        params: the model's size (one fragment).
        pushes: rounds the island pushes.
        quiet_s: seconds of quiet probes first.
        out: the shard's data dir goes below it.

    Returns:
        The figures of the module docstring.
    """
    log = sys.stderr
    extra = ["--max-message-bytes", str(MAX_MESSAGE), "--max-requests-per-s", "1000"]
    extra += ["--request-burst", "1000", "--checkpoint-every-steps", "0"]
    extra += ["--checkpoint-every-s", "0"]
    with one_shard(out, params, 1, extra, log) as (cluster, _pid, watcher):
        connect = f"tcp://{cluster.host}:{cluster.port}"
        islands = Islands(connect, 1, params, log, 1)
        probe = Probe(connect)
        probe.start()
        try:
            probe.ready.wait(60)
            if probe.error is not None:
                raise probe.error
            islands.push_one(0, 0, watcher)  # warm-up: the shard loads its compiled loops
            time.sleep(quiet_s)
            quiet_end = time.monotonic()
            windows, acks = [], []
            for _ in range(pushes):
                started = time.monotonic()
                acks.append(islands.push_one(0, 0, watcher))
                windows.append((started, time.monotonic()))
            probe.stop_event.set()
            probe.join(70)
            if probe.error is not None:
                raise probe.error
        finally:
            probe.stop_event.set()
            islands.close()
    quiet = [s for t, s in probe.samples if quiet_end - quiet_s <= t < quiet_end]
    during = [s for t, s in probe.samples if any(a <= t <= b for a, b in windows)]
    return {
        "params": params,
        "push_bytes": sum(len(f) for f in islands.frames[0]),
        "quiet": _summary(quiet),
        "during_pushes": _summary(during),
        "push_ack_s": [round(a, 3) for a in acks],
        "load_avg_1m": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    """Measure and print JSON.

    Args:
        argv: command line (None: sys.argv).

    Returns:
        0.
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=parse_count, default=64_000_000)
    ap.add_argument("--pushes", type=int, default=6)  # +1 warm-up: at most 8 pending
    ap.add_argument("--quiet-s", type=float, default=3.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="push-heartbeats-") as tmp:
        out = args.out or Path(tmp)
        print(json.dumps(measure(args.params, args.pushes, args.quiet_s, out), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
