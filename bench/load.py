"""Load test: many lightweight simulated islands (client only, random int8 deltas) against N shards.

    diloco-bench load [--islands 32] [--shards 4] [--rounds 10] [--params 262144]
                      [--max-rss-mb 2048] [--timeout 300] [--out runs/load]
                      [--profile-shard I]
    diloco-bench load --flood [--islands 8] [--shards 1] [--flood-seconds 20]
                      [--pace-s 0.25] [--garbage-rate 10000]   (bench.load_flood)

Starts the shards as real daemons (`diloco-server start --detach`, async mode),
joins `--islands` `paramserver.client.Client`s from this process (no JAX, no
model: a single flat float32 leaf of `--params` elements), and has each push
every fragment for `--rounds` rounds from its own thread. Checks, and reports
as JSON on stdout: every push acked (nothing lost), the shards' accepted
counts equal the pushes, the whole run finished within `--timeout` (no
deadlock), and the shards' peak RSS stayed under `--max-rss-mb`; plus pushes
per second and p50/p99 ack latency (push call to ack), the islands' re-sends
and how many were spurious (the shard already had the delta:
`resent_while_acked`, and its share of the pushes), the latency's stages
(`latency_stages`, `bench.load_stages`: one push's service time unloaded, the
queueing behind the deltas in flight, the CPU of this process and of each
shard), the requests
the shards' request limits refused `throttled` or dropped, and what bounds
the rate: the fsync rate of the shards' data dir's disk in the same run
(`fsync_per_s`: write + fsync of one push-sized record in a loop, before and
after the pushes) and the CPU the shards, this process and the machine used
while pushing. `--profile-shard I` runs shard I under cProfile
(`bench.shard_profile`) and adds the seconds per part of its loop. Exit 1
when a check fails. `--flood` runs the fairness bench instead: honest
islands' ack latency without and with a flat-out pusher and a hostile peer
(`bench.load_flood`, which says what it reports).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import load_stages, outdir, shard_profile
from bench.common import emit_json
from bench.launcher import LaunchError, LocalCluster
from bench.load_cluster import (
    FLOOD_ISLANDS,
    FLOOD_SHARDS,
    ISLANDS,
    SHARDS,
    environ,
    profile_report,
    random_frames,
    shard_pids,
)
from bench.load_meters import (
    CpuMeter,
    RssSampler,
    fsync_rate,
    milliseconds,
    percentile,
    rates,
    spread,
)
from paramserver.client import Client, ClientConfig, ClientError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `diloco-bench load`."""
    parser.add_argument(
        "--islands",
        type=int,
        default=None,
        help=f"simulated islands that push at once (default {ISLANDS}; "
        f"{FLOOD_ISLANDS} honest ones with --flood)",
    )
    parser.add_argument(
        "--shards",
        type=int,
        default=None,
        help=f"shard processes of the server (default {SHARDS}; {FLOOD_SHARDS} with --flood)",
    )
    parser.add_argument("--rounds", type=int, default=10, help="rounds per island (default 10)")
    parser.add_argument(
        "--params",
        type=int,
        default=262_144,
        help="float32 parameters of the model pushed (default 262144)",
    )
    parser.add_argument(
        "--max-rss-mb", type=float, default=2048.0, help="bound on any shard's RSS (default 2048)"
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="bound on the whole run, seconds"
    )
    parser.add_argument("--out", default="runs/load", help="data dirs and load.json go here")
    parser.add_argument(
        "--profile-shard",
        type=int,
        default=None,
        metavar="I",
        help="run shard I under cProfile; report seconds per part of its loop",
    )
    flood = parser.add_argument_group("fairness under a flood (--flood)")
    flood.add_argument(
        "--flood",
        action="store_true",
        help="measure the honest islands' ack latency without, then with, a flat-out pusher "
        "and a hostile peer against shard 0 (JSON: p50/p99 both ways and their ratio)",
    )
    flood.add_argument(
        "--flood-seconds", type=float, default=20.0, help="length of each phase (default 20)"
    )
    flood.add_argument(
        "--pace-s",
        type=float,
        default=0.25,
        help="an honest island pushes every fragment once per this many seconds (default 0.25)",
    )
    flood.add_argument(
        "--flood-peers",
        choices=("both", "flooder", "hostile"),
        default="both",
        help="who floods in the flood phase: the flat-out pusher and the hostile peer (default "
        "both), or one of them alone",
    )
    flood.add_argument(
        "--flooder-window",
        type=int,
        default=256,
        help="pushes the flooder keeps outstanding (answered or 2 s old) at most; 0: no bound, "
        "as fast as its socket takes them (default 256, a client with a big max_unacked)",
    )
    flood.add_argument(
        "--garbage-rate",
        type=float,
        default=10_000.0,
        help="messages per second the hostile peer sends (default 10000)",
    )


def _island(
    client: Client,
    fragments: int,
    rounds: int,
    frames_by_fragment: dict[int, list[list[Any]]],
    errors: list[str],
) -> None:
    try:
        for r in range(rounds):
            for f in range(fragments):
                choices = frames_by_fragment[f]
                client.push(f, r, 0, 1000, 10, choices[r % len(choices)])
    except ClientError as exc:
        errors.append(f"{client.cfg.island}: {exc}")


def run_load(args: argparse.Namespace, log=sys.stderr) -> dict[str, Any]:
    """Run the load test; returns the JSON report (with `ok` and the failed checks).

    Args:
        args: the parsed flags.
        log: where progress lines go.

    Returns:
        The report dict.
    """
    out = outdir.claim(Path(args.out), "load")
    flat = {"w": np.zeros(args.params, np.float32)}
    server_args = ("--mode", "async", "--heartbeat-interval-s", "2.0", "--liveness", "30")
    errors: list[str] = []
    profiled = args.profile_shard is not None and 0 <= args.profile_shard < args.shards
    env = shard_profile.profile_env(out / "profile", args.profile_shard) if profiled else {}
    with LocalCluster(out / "cluster", shards=args.shards, server_args=server_args) as cluster:
        print(f"load: starting {args.shards} shards on {cluster.connect}", file=log)
        with environ(env):
            cluster.start_server()
        pids = shard_pids(cluster)
        sampler = RssSampler(pids)
        sampler.start()
        cpu = CpuMeter({**{f"shard_{i}": pid for i, pid in enumerate(pids)}, "load": os.getpid()})
        clients: list[Client] = []
        try:
            for i in range(args.islands):
                client = Client(
                    ClientConfig(
                        connect=cluster.connect,
                        island=f"load-{i}",
                        heartbeat_interval_s=2.0,
                        liveness=30,
                        push_timeout_s=args.timeout,
                    )
                )
                clients.append(client)
                plan = client.join(flat).plan
            print(f"load: {args.islands} islands joined; pushing", file=log)
            sizes = {f.index: f.size for f in plan.fragments}
            frames = random_frames(sizes, variants=4, seed=0)
            # the service time of one push with nothing else in flight (rounds after the load's)
            unloaded = load_stages.probe_unloaded(clients[0], 0, args.rounds, frames[0][0])
            probed = load_stages.PROBE_PUSHES
            expected = args.islands * args.rounds * len(sizes)
            # one push's payload: about what a shard's log appends (and fsyncs, grouped) per push
            record = int(np.mean([sum(len(x) for x in v) for fs in frames.values() for v in fs]))
            fsync_before = fsync_rate(cluster.server_dir, record)
            outstanding = load_stages.OutstandingSampler(clients)
            cpu.start()
            outstanding.start()
            t0 = time.monotonic()
            threads = [
                threading.Thread(
                    target=_island, args=(c, len(sizes), args.rounds, frames, errors), daemon=True
                )
                for c in clients
            ]
            for t in threads:
                t.start()
            deadline = t0 + args.timeout
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            acked = 0
            while time.monotonic() < deadline:
                acked = sum(c.stats()["acked"] for c in clients) - probed
                if acked >= expected or errors:
                    break
                time.sleep(0.05)
            elapsed = time.monotonic() - t0
            outstanding.stop_event.set()
            cores = cpu.stop()
            fsync_after = fsync_rate(cluster.server_dir, record)
            latencies = [x for c in clients for x in c.ack_latencies()]
            stats = [c.stats() for c in clients]
        finally:
            dropped = sum(c.close(flush_timeout_s=2.0) for c in clients)
            sampler.stop_event.set()
            sampler.join(5.0)
        server = cluster.server_status()
    accepted = sum(s.get("accepted", 0) for s in server.get("shards", [])) - probed
    measured = rates(expected, elapsed, fsync_before, fsync_after)
    peak_mb = max(sampler.peak.values(), default=0) / 2**20
    timed_out = acked < expected and not errors
    checks = {
        "every_push_acked": acked == expected and not errors,
        "shard_accepted_equals_pushes": accepted == expected,
        "no_rejections": all(not s["rejected"] for s in stats),
        "finished_within_timeout": not timed_out,
        "rss_within_bound": peak_mb <= args.max_rss_mb,
    }
    report = {
        "islands": args.islands,
        "shards": args.shards,
        "rounds": args.rounds,
        "params": args.params,
        "fragments": len(sizes),
        "pushes": expected,
        "acked": acked,
        "shard_accepted": accepted,
        "shard_duplicates": sum(s.get("duplicates", 0) for s in server.get("shards", [])),
        # requests the shards' request limits refused (answered) or dropped (unanswered)
        "shard_throttled": sum(
            s.get("rejected", {}).get("throttled", 0) for s in server.get("shards", [])
        ),
        "shard_dropped": sum(sum(s.get("dropped", {}).values()) for s in server.get("shards", [])),
        "resent": sum(s["resent"] for s in stats),
        "spurious_resends": sum(s["spurious_resends"] for s in stats),
        # re-sends of a delta whose first copy the shard had accepted (its ack was coming)
        "resent_while_acked": sum(s["spurious_resends"] for s in stats),
        "resent_while_acked_share": round(
            sum(s["spurious_resends"] for s in stats) / max(1, expected), 4
        ),
        "latency_stages": load_stages.stages(
            unloaded, latencies, outstanding.samples, acked, elapsed, cores
        ),
        "ack_timeout_s": spread([s["ack_timeout_s"] for s in stats]),
        "dropped_at_close": dropped,
        "elapsed_s": round(elapsed, 3),
        "pushes_per_s": measured["pushes_per_s"],
        "fsync_write_bytes": record,
        "fsync_per_s": measured["fsync_per_s"],
        "fsync_per_s_before_after": [round(fsync_before, 1), round(fsync_after, 1)],
        "pushes_per_fsync": measured["pushes_per_fsync"],
        "cpu_cores_busy": cores,
        "ack_latency_p50_ms": milliseconds(percentile(latencies, 50)),
        "ack_latency_p99_ms": milliseconds(percentile(latencies, 99)),
        "ack_latency_max_ms": milliseconds(max(latencies, default=None)),
        "bytes_sent": sum(s["bytes_sent"] for s in stats),
        "shard_rss_peak_mb": round(peak_mb, 1),
        "max_rss_mb": args.max_rss_mb,
        "checks": checks,
        "errors": errors,
        "ok": all(checks.values()),
    }
    if profiled:
        report["shard_profile"] = profile_report(out / "profile", args.profile_shard, server)
    (out / "load.json").write_text(json.dumps(report, indent=2))
    return report


def run(args: argparse.Namespace) -> int:
    """Run `diloco-bench load`; prints the JSON report; returns 0 when every check passed."""
    from bench.load_flood import run_flood

    for name in ("islands", "shards", "rounds", "params"):
        value = getattr(args, name)
        if value is not None and value < 1:
            print(f"diloco-bench load: --{name} must be >= 1, got {value}", file=sys.stderr)
            return 2
    if args.flooder_window < 0:
        print(f"diloco-bench load: --flooder-window must be >= 0, got {args.flooder_window}",
              file=sys.stderr)  # fmt: skip
        return 2
    for name in ("flood_seconds", "pace_s", "garbage_rate"):
        value = getattr(args, name)
        if not value > 0:
            flag = "--" + name.replace("_", "-")
            print(f"diloco-bench load: {flag} must be > 0, got {value}", file=sys.stderr)
            return 2
    if not args.flood:
        args.islands = ISLANDS if args.islands is None else args.islands
        args.shards = SHARDS if args.shards is None else args.shards
    try:
        report = run_flood(args) if args.flood else run_load(args)
    except (LaunchError, ClientError) as exc:
        print(f"diloco-bench load: {exc}", file=sys.stderr)
        return 1
    emit_json(report)
    if not report["ok"]:
        failed = [k for k, v in report["checks"].items() if not v]
        print(f"diloco-bench load: checks failed: {', '.join(failed)}", file=sys.stderr)
    return 0 if report["ok"] else 1
