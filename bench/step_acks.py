"""Ack latency while a shard steps, against the same pushes acked while it is idle.

    python -m bench.step_acks [--params N] [--probes P] [--out DIR]

One real shard (`bench.scale_shard.one_shard`, async mode: every accepted
push steps its fragment) and two client-only islands. Quiet: island 1 pushes
one fragment and waits for its ack, then for that fragment's update (so the
shard is idle before the next probe). Stepping: island 0 pushes every
fragment at once (a queue of steps, one after another, seconds in all), then
island 1 pushes probes one at a time while those steps run, each timed from
its push to its ack (`Client.ack_latencies`); a probe is counted as
"during a step" only if island 0's last update had not arrived when its ack
did. JSON on stdout: the p50/p99/max of both, and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import child
from bench.scale import parse_count
from bench.scale_shard import Islands, one_shard

MAX_MESSAGE = 1 << 30


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


def _settle(watcher, fragments: int, still_s: float = 1.0) -> None:
    """Wait until no fragment's version moved for `still_s` (the probes' own steps are over)."""
    last, since = None, time.monotonic()
    while time.monotonic() - since < still_s:
        now = [watcher.version(f) for f in range(fragments)]
        if now != last:
            last, since = now, time.monotonic()
        time.sleep(0.05)


def measure(params: int, probes: int, out: Path, fragments: int = 0) -> dict:
    """Quiet and during-step acks of one shard of `params` parameters.

    Args:
        params: the model's size.
        probes: probe pushes per phase.
        out: the shard's data dir goes below it.
        fragments: fragments (0: one per 2**23 parameters, at least 2).

    Returns:
        The figures.
    """
    fragments = fragments or max(2, -(-params // (1 << 23)))
    log = sys.stderr
    extra = ["--mode", "async", "--max-message-bytes", str(MAX_MESSAGE)]
    extra += ["--checkpoint-every-steps", "0", "--checkpoint-every-s", "0"]
    with one_shard(out, params, fragments, extra, log) as (cluster, _pid, watcher):
        connect = f"tcp://{cluster.host}:{cluster.port}"
        islands = Islands(connect, 2, params, log, fragments)
        try:
            quiet = []
            for k in range(probes):
                f = k % fragments
                target = watcher.version(f) + 1
                quiet.append(islands.push_one(1, f, watcher))
                watcher.wait_all({f: target})
                _settle(watcher, fragments, 0.2)
            stepping, late = [], 0
            while len(stepping) < probes:
                targets = islands.next_versions(watcher)
                islands.push_all(0, watcher)
                f = 0
                while len(stepping) < probes:
                    latency = islands.push_one(1, f % fragments, watcher)
                    if all(watcher.version(g) >= v for g, v in targets.items()):
                        late += 1  # the queue of steps was over: not counted
                        break
                    stepping.append(latency)
                    f += 1
                watcher.wait_all(targets)
                islands.wait_acked(0)
                _settle(watcher, fragments)
        finally:
            islands.close()
    return {
        "params": params,
        "fragments": fragments,
        "quiet": _summary(quiet),
        "during_steps": _summary(stepping),
        "probes_after_the_steps": late,
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
    ap.add_argument("--probes", type=int, default=40)
    ap.add_argument("--fragments", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    child.sigterm_unwinds()  # the shard stops as on Ctrl-C
    with tempfile.TemporaryDirectory(prefix="step-acks-") as tmp:
        out = args.out or Path(tmp)
        print(json.dumps(measure(args.params, args.probes, out, args.fragments), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
