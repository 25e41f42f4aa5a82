"""`diloco-bench load --flood`: honest islands' ack latency without and with a flood, in one run.

    diloco-bench load --flood [--islands 8] [--shards 1] [--params 262144]
                      [--flood-seconds 20] [--pace-s 0.25] [--garbage-rate 10000]
                      [--flooder-window 256] [--flood-peers both|flooder|hostile]
                      [--profile-shard I]

Starts the shards as real daemons (`diloco-server start --detach`, async mode,
every request limit at its default), joins `--islands` honest
`paramserver.client.Client`s from this process (no replica: they measure
acks, not the downlink) and runs two phases of `--flood-seconds` each, the
honest islands pushing every fragment once per `--pace-s` throughout:

1. quiet: nothing else;
2. flood: two more processes (`bench.children.flood_peer`) against shard 0,
   an island pushing valid deltas flat out (no pause: the next whenever one
   of its `--flooder-window` outstanding pushes is answered) and a
   hostile peer sending `--garbage-rate` messages a second of garbage
   (random bytes, headers that do not decode or validate, pushes with valid
   headers and corrupt payloads); `--flood-peers flooder` or `hostile` runs
   one of them alone (to tell their costs apart).

Prints JSON: per phase the honest pushes, acks and p50/p99/max ack latency
(push call to ack), the p99/max of its first 2 s (`onset`: a flood begins
with each flooding key's `request_burst`), the CPU used and the outer steps
taken (async mode: one per turn with pending deltas, each an update every
island receives); the p99 and p50 ratios flood / quiet
(target: p99 within 2x); what the flooder and the hostile peer sent and
what answered them, by reason (`throttled` with its `retry_after_s`); the
shards' refusal and drop counters; the machine's load average. Exit 1 when
a check fails: every honest push acked and none refused, the flooder
throttled, the hostile peer answered less than it sent, p99 within 2x.
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

from bench import child, outdir, shard_profile
from bench.launcher import LocalCluster
from bench.load_cluster import (
    FLOOD_ISLANDS,
    FLOOD_SHARDS,
    environ,
    profile_report,
    random_frames,
    shard_pids,
)
from bench.load_meters import CpuMeter, milliseconds, percentile
from paramserver.client import Client, ClientConfig, ClientError

TARGET_P99_RATIO = 2.0
PROGRESS_EVERY_S = 5.0
DRAIN_S = 30.0  # bound on waiting for a phase's last acks
WARM_UP_S = 5.0  # honest pushes before the quiet phase, not measured (the first steps compile)
ONSET_S = 2.0  # a phase's first seconds, reported apart (the flood starts with the bursts)


def flood_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The flood run's sizes: `--islands` / `--shards`, FLOOD_ISLANDS / FLOOD_SHARDS unless given."""
    return {
        "islands": FLOOD_ISLANDS if args.islands is None else args.islands,
        "shards": FLOOD_SHARDS if args.shards is None else args.shards,
    }


class Honest:
    """The honest islands: each pushes every fragment once per `pace_s`, from its own thread."""

    def __init__(self, clients: list[Client], frames: dict[int, list[list[Any]]], pace_s: float):
        self.clients = clients
        self.frames = frames
        self.pace_s = pace_s
        self.rounds = [0] * len(clients)  # next round of each island (continues across phases)
        self.errors: list[str] = []

    def pushed(self) -> int:
        """Pushes made so far by every island."""
        return sum(c.stats()["pushes"] for c in self.clients)

    def acked(self) -> int:
        """Pushes acked so far (duplicates included)."""
        return sum(c.stats()["acked"] for c in self.clients)

    def run(self, seconds: float, what: str, log) -> dict[str, Any]:
        """One phase: push at the pace for `seconds`, wait for its acks; its latencies and CPU."""
        for c in self.clients:
            c.ack_latencies()  # drop what an earlier phase left
        before = self.pushed()
        stop = threading.Event()
        threads = [
            threading.Thread(target=self._island, args=(i, stop), daemon=True)
            for i in range(len(self.clients))
        ]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        while (left := t0 + seconds - time.monotonic()) > 0:
            time.sleep(min(PROGRESS_EVERY_S, left))
            print(f"load --flood: {what}: {time.monotonic() - t0:.0f}/{seconds:g} s, "
                  f"{self.acked()} honest acks", file=log)  # fmt: skip
        stop.set()
        for t in threads:
            t.join(10.0)
        pushes = self.pushed() - before
        deadline = time.monotonic() + DRAIN_S
        while self.acked() < self.pushed() and time.monotonic() < deadline:
            time.sleep(0.05)
        per_island = [c.ack_latencies() for c in self.clients]  # each in ack order
        latencies = [x for acks in per_island for x in acks]
        # an island pushes at an even pace: its first acks are the phase's first ONSET_S
        onset = [x for acks in per_island for x in acks[: round(len(acks) * ONSET_S / seconds)]]
        return {
            "pushes": pushes,
            "acked": len(latencies),
            "ack_latency_p50_ms": milliseconds(percentile(latencies, 50)),
            "ack_latency_p99_ms": milliseconds(percentile(latencies, 99)),
            "ack_latency_max_ms": milliseconds(max(latencies, default=None)),
            "onset_p99_ms": milliseconds(percentile(onset, 99)),
            "onset_max_ms": milliseconds(max(onset, default=None)),
        }

    def _island(self, i: int, stop: threading.Event) -> None:
        client, start = self.clients[i], time.monotonic() + i * self.pace_s / len(self.clients)
        try:
            while not stop.wait(max(0.0, start - time.monotonic())):
                r = self.rounds[i]
                for f, choices in sorted(self.frames.items()):
                    client.push(f, r, 0, 1000, 10, choices[r % len(choices)])
                self.rounds[i] += 1
                start += self.pace_s
        except ClientError as exc:
            self.errors.append(f"{client.cfg.island}: {exc}")


def _peer(role: str, connect: str, args: argparse.Namespace, stats: Path) -> child.Child:
    argv = child.module_argv(
        "bench.children.flood_peer", "--role", role, "--connect", connect,
        "--params", str(args.params), "--stats", str(stats), "--rate", str(args.garbage_rate),
        "--window", str(args.flooder_window),
    )  # fmt: skip
    return child.start(argv, role)


def _steps(cluster: LocalCluster) -> int:
    """Outer steps the shards took so far (each publishes an update to every island)."""
    return sum(s.get("steps", 0) for s in cluster.server_status().get("shards", []))


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def run_flood(args: argparse.Namespace, log=sys.stderr) -> dict[str, Any]:
    """Run the flood bench; returns the JSON report (with `ok` and the failed checks).

    Args:
        args: the parsed flags of `diloco-bench load`.
        log: where progress lines go.

    Returns:
        The report dict.
    """
    sizes_cfg = flood_settings(args)
    out = outdir.claim(Path(args.out), "load")
    flat = {"w": np.zeros(args.params, np.float32)}
    shards = sizes_cfg["shards"]
    profiled = args.profile_shard is not None and 0 <= args.profile_shard < shards
    env = shard_profile.profile_env(out / "profile", args.profile_shard) if profiled else {}
    with LocalCluster(out / "cluster", shards=shards, server_args=("--mode", "async")) as cluster:
        print(f"load --flood: starting {shards} shard(s) on {cluster.connect}", file=log)
        with environ(env):
            cluster.start_server()
        pids = shard_pids(cluster)
        cpu_pids = {**{f"shard_{i}": pid for i, pid in enumerate(pids)}, "load": os.getpid()}
        cpu = CpuMeter(cpu_pids)
        clients: list[Client] = []
        flood_peers: dict[str, Any] = {}
        try:
            for i in range(sizes_cfg["islands"]):
                cfg = ClientConfig(connect=cluster.connect, island=f"honest-{i}", keep="versions",
                                   push_timeout_s=args.timeout)  # fmt: skip
                clients.append(Client(cfg))
                plan = clients[-1].join(flat).plan
            sizes = {f.index: f.size for f in plan.fragments}
            honest = Honest(clients, random_frames(sizes, variants=4, seed=0), args.pace_s)
            print(f"load --flood: {len(clients)} honest islands joined; warming up", file=log)
            honest.run(WARM_UP_S, "warm-up", log)  # the shard's first steps compile: not measured
            load_before = os.getloadavg()
            print("load --flood: quiet phase", file=log)
            cpu.start()
            steps = _steps(cluster)
            quiet = honest.run(args.flood_seconds, "quiet", log)
            quiet["cpu"] = cpu.stop()
            quiet["outer_steps"], steps = _steps(cluster) - steps, _steps(cluster)
            roles = ("flooder", "hostile") if args.flood_peers == "both" else (args.flood_peers,)
            stats = {role: out / f"{role}.json" for role in roles}
            peers = [_peer(role, cluster.connect, args, path) for role, path in stats.items()]
            try:
                print(f"load --flood: {args.flood_peers} started; flood phase", file=log)
                cpu = CpuMeter({**cpu_pids, **{p.what: p.proc.pid for p in peers}})
                cpu.start()
                flood = honest.run(args.flood_seconds, "flood", log)
                flood["cpu"] = cpu.stop()
                flood["outer_steps"] = _steps(cluster) - steps
            finally:
                for p in peers:
                    p.terminate()
                for p in peers:
                    p.wait_or_kill(30.0)
            for role, path in stats.items():
                flood_peers[role] = json.loads(path.read_text()) if path.exists() else None
            load_after = os.getloadavg()
            honest_stats = [c.stats() for c in clients]
        finally:
            for c in clients:
                c.close(flush_timeout_s=2.0)
        server = cluster.server_status()
    report = {
        "flood": True,
        "honest_islands": sizes_cfg["islands"],
        "shards": shards,
        "params": args.params,
        "fragments": len(sizes),
        "phase_s": args.flood_seconds,
        "pace_s": args.pace_s,
        "garbage_rate": args.garbage_rate,
        "flood_peers": args.flood_peers,
        "flooder_window": args.flooder_window,
        "quiet": quiet,
        "flood_phase": flood,
        **outcome(quiet, flood, flood_peers, honest.errors, honest_stats, server),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in load_after],
    }
    report["ok"] = all(report["checks"].values())
    if profiled:  # seconds over both phases together
        report["shard_profile"] = profile_report(out / "profile", args.profile_shard, server)
    (out / "load.json").write_text(json.dumps(report, indent=2))
    return report


def outcome(
    quiet: dict, flood: dict, peers: dict, errors: list[str], honest_stats: list, server: dict
) -> dict[str, Any]:
    """The ratios, what answered the flood, the shards' counters and the checks.

    Args:
        quiet: the quiet phase's figures (`Honest.run`).
        flood: the flood phase's.
        peers: role -> the flood peer's counts (its --stats JSON; None if it wrote none).
        errors: the honest islands' push errors.
        honest_stats: each honest client's `stats()` at the end.
        server: the cluster's status.

    Returns:
        p99_ratio and p50_ratio (flood / quiet, 3 decimals; None without samples),
        target_p99_ratio, honest (pushes, acked, refused, errors), flooder,
        hostile, shard_rejected / shard_dropped / shard_accepted (per shard) and
        checks: every_honest_push_acked, honest_p99_within_2x, and for the peers
        that ran flooder_throttled and hostile_answered_less_than_sent.
    """
    flooder, hostile = peers.get("flooder") or {}, peers.get("hostile") or {}
    shard_rows = server.get("shards", [])
    pushed = sum(s["pushes"] for s in honest_stats)
    acked = sum(s["acked"] for s in honest_stats)
    refused = {k: v for s in honest_stats for k, v in s["rejected"].items()}
    p99_ratio = _ratio(flood["ack_latency_p99_ms"], quiet["ack_latency_p99_ms"])
    checks = {
        "every_honest_push_acked": acked == pushed and not refused and not errors,
        "honest_p99_within_2x": p99_ratio is not None and p99_ratio <= TARGET_P99_RATIO,
    }
    if "flooder" in peers:
        checks["flooder_throttled"] = flooder.get("by_reason", {}).get("throttled", 0) > 0
    if "hostile" in peers:
        sent = hostile.get("sent", 0)
        checks["hostile_answered_less_than_sent"] = 0 < hostile.get("answered", 0) < sent
    return {
        "p99_ratio": p99_ratio,
        "p50_ratio": _ratio(flood["ack_latency_p50_ms"], quiet["ack_latency_p50_ms"]),
        "target_p99_ratio": TARGET_P99_RATIO,
        "honest": {"pushes": pushed, "acked": acked, "refused": refused, "errors": errors},
        "flooder": flooder,
        "hostile": hostile,
        "shard_rejected": [s.get("rejected") for s in shard_rows],
        "shard_dropped": [s.get("dropped") for s in shard_rows],
        "shard_accepted": [s.get("accepted") for s in shard_rows],
        "checks": checks,
    }
