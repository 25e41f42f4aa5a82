"""The regions bench's small run: shards in their regions, one island per region, over the WAN.

Shard i runs (`diloco-server start --cluster FILE --shard i --detach`) inside
the i-th region of `--shard-regions`, binds 0.0.0.0 in its namespace and
advertises its region's service address, so every island reaches it at the
same address (the islands of its own region locally, the others through the
WAN relay of the link between the two regions). Each region runs one
`bench.children.region_island` of its speed (1.0 / 0.55): synthetic int8
deltas through the real client, round by round.

Per island and round the report gives the round's seconds from the first
push to the last ack against bytes / bandwidth (the bytes the client sent
over the emulated links to the shards' regions, plus one RTT:
`bytes_over_bandwidth_s`), and the
control plane's latency (a status request on its own connection to the
shard, over the same link) while transfers were in flight and while idle,
against one liveness interval (heartbeat_interval_s x liveness of the shard).
"""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench import child, netns
from bench.regions_plan import REGIONS, Link
from paramserver.plumbing import daemon
from paramserver.plumbing.clusterfile import ShardAddress, render_cluster_file

ROUTER_PORT = 7000  # shard i: ROUTER 7000 + 2i, PUB 7001 + 2i (namespaces are private)
HEARTBEAT_S = 1.0
LIVENESS = 5


def shard_ports(shards: int) -> list[int]:
    """The ports the relays must forward for `shards` shards."""
    return [ROUTER_PORT + k for k in range(2 * shards)]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _link_between(links: list[Link], a: int, b: int) -> Link | None:
    return next((ln for ln in links if {ln.a, ln.b} == {a, b}), None)


def bytes_over_bandwidth_s(
    nbytes: int, region: int, shard_regions: list[int], links: list[Link], scale: float
) -> float | None:
    """The ideal time of a round: its bytes over the links to the shards, plus one RTT.

    The plan is byte-balanced, so each of the S shards gets 1/S of the bytes;
    the transfers to the shards run at once, so the slowest one sets the time:
    max over remote shards of (bytes / S x 8 / rate of the link to it), plus the
    largest RTT of those links. Shards in the island's own region cost nothing.

    Args:
        nbytes: the bytes the island sent in the round.
        region: the island's region.
        shard_regions: region of each shard.
        links: the links at real rates.
        scale: emulated Mbit/s = Gbit/s x 1000 x scale.

    Returns:
        Seconds, or None when every shard is in the island's region.
    """
    remote = [_link_between(links, region, r) for r in shard_regions if r != region]
    remote = [ln for ln in remote if ln is not None]
    if not remote:
        return None
    share = nbytes / len(shard_regions)
    transfer = max(share * 8 / (ln.gbit * 1000.0 * scale * 1e6) for ln in remote)
    return transfer + max(ln.rtt_ms for ln in remote) / 1000.0


def island_report(
    result: dict[str, Any],
    region: int,
    shard_regions: list[int],
    links: list[Link],
    scale: float,
) -> dict[str, Any]:
    """One island's rounds against bytes / bandwidth, and its control-plane latency.

    Args:
        result: the island child's JSON.
        region: its region.
        shard_regions: region of each shard.
        links: the links at real rates.
        scale: the run's scale.

    Returns:
        A JSON-ready dict.
    """
    rounds = []
    for r in result["rounds"]:
        ideal = bytes_over_bandwidth_s(r["bytes_sent"], region, shard_regions, links, scale)
        rounds.append(
            {
                "round": r["round"],
                "seconds": round(r["seconds"], 4),
                "bytes_sent": r["bytes_sent"],
                "bytes_over_bandwidth_s": round(ideal, 4) if ideal else None,
                "ratio": round(r["seconds"] / ideal, 4) if ideal else None,
                "ack_latency_s_max": round(max(r["ack_latency_s"], default=0.0), 4),
            }
        )
    to_shards = [_link_between(links, region, r) for r in shard_regions if r != region]
    busy = [s["seconds"] for s in result["status_rtt"] if s["in_transfer"]]
    idle = [s["seconds"] for s in result["status_rtt"] if not s["in_transfer"]]
    liveness_s = HEARTBEAT_S * LIVENESS
    return {
        "island": result["island"],
        "region": REGIONS[region].name,
        "speed": result["speed"],
        "links_to_shards": [
            {
                "link": f"{REGIONS[ln.a].name}-{REGIONS[ln.b].name}",
                "mbit": round(ln.gbit * 1000.0 * scale, 3),
                "rtt_ms": ln.rtt_ms,
            }
            for ln in to_shards
            if ln is not None
        ],
        "shard_regions": [REGIONS[r].name for r in shard_regions],
        "rounds": rounds,
        "control_latency_s": {
            "in_transfer": {
                "n": len(busy),
                "p50": round(_percentile(busy, 0.5), 4),
                "p99": round(_percentile(busy, 0.99), 4),
                "max": round(max(busy, default=0.0), 4),
            },
            "idle": {"n": len(idle), "p50": round(statistics.median(idle), 4) if idle else 0.0},
            "liveness_interval_s": liveness_s,
            "max_under_liveness": max(busy + idle, default=0.0) < liveness_s,
        },
        "client": result["client"],
        "failed": result["failed"],
    }


class LinkSampler:
    """Every `interval_s`, each link direction's htb byte counter (`Topology.class_bytes`), on a thread.

    `samples` holds (monotonic t, {(towards, from): bytes}); `utilisation`
    turns them into Mbit/s and the share of each link's rate per interval.
    """

    def __init__(self, topo: netns.Topology, interval_s: float = 1.0) -> None:
        """Args:
        topo: the built topology.
        interval_s: the sampling period.
        """
        self.topo = topo
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[tuple[int, int], int]]] = []
        self.rates: list[tuple[float, dict[tuple[int, int], float]]] = []  # rate changes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _rates_now(self) -> dict[tuple[int, int], float]:
        return {(ln.a, ln.b): ln.mbit for ln in self.topo.links}

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                counters = self.topo.class_bytes()
            except netns.NetnsError:
                counters = None
            if counters is not None:
                self.samples.append((time.monotonic(), counters))
            self._stop.wait(self.interval_s)

    def note_rates(self) -> None:
        """Record the links' configured rates now (call after every rate change)."""
        self.rates.append((time.monotonic(), self._rates_now()))

    def __enter__(self) -> LinkSampler:
        self.note_rates()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10.0)

    def _rate_at(self, pair: tuple[int, int], t: float) -> float:
        """The link's configured rate at `t` (an interval across a change takes the larger)."""
        return next((r[pair] for at, r in reversed(self.rates) if at <= t), self.rates[0][1][pair])

    def utilisation(self, t0: float) -> list[dict[str, Any]]:
        """Per link direction: [(seconds after t0, Mbit/s, share of its configured rate)].

        Args:
            t0: the run's start.

        Returns:
            JSON-ready rows {"link", "towards", "mbit", "points": [[t, mbit_s, share], ...]}.
        """
        out = []
        if len(self.samples) < 2:
            return out
        for towards, other in sorted(self.samples[0][1]):
            pair = (min(towards, other), max(towards, other))
            points = []
            for (ta, ca), (tb, cb) in itertools.pairwise(self.samples):
                if tb <= ta:
                    continue
                mbit_s = (cb[(towards, other)] - ca[(towards, other)]) * 8 / (tb - ta) / 1e6
                rate = max(self._rate_at(pair, ta), self._rate_at(pair, tb))
                points.append([round(tb - t0, 3), round(mbit_s, 4), round(mbit_s / rate, 4)])
            out.append(
                {
                    "link": f"{REGIONS[pair[0]].name}-{REGIONS[pair[1]].name}",
                    "towards": REGIONS[towards].name,
                    "mbit": self.rates[0][1][pair],
                    "points": points,
                }
            )
        return out


def start_shards(topo: netns.Topology, shard_regions: list[int]) -> tuple[Path, list[ShardAddress]]:
    """Write the cluster file and start every shard in its region (detached).

    Args:
        topo: the built topology.
        shard_regions: where shard 0, 1, ... run.

    Returns:
        (the run's work dir, the shards' addresses).

    Raises:
        netns.NetnsError: a shard did not start.
    """
    work = topo.workdir / "run"  # removed with the topology's work dir
    work.mkdir()
    shards = [
        ShardAddress(
            router=f"tcp://{topo.address(region)}:{ROUTER_PORT + 2 * i}",
            pub=f"tcp://{topo.address(region)}:{ROUTER_PORT + 2 * i + 1}",
            router_bind=f"tcp://0.0.0.0:{ROUTER_PORT + 2 * i}",
            pub_bind=f"tcp://0.0.0.0:{ROUTER_PORT + 2 * i + 1}",
        )
        for i, region in enumerate(shard_regions)
    ]
    server = {
        "data_dir": str(work / "server"),
        "mode": "async",
        "insecure": True,
        "heartbeat_interval_s": HEARTBEAT_S,
        "liveness": LIVENESS,
    }
    cluster = work / "cluster.toml"
    cluster.write_text(render_cluster_file(server, shards))
    for i, region in enumerate(shard_regions):
        argv = [*topo.prefix_argv(region), sys.executable, "-m", "paramserver.server.cli",
                "start", "--cluster", str(cluster), "--shard", str(i), "--detach"]  # fmt: skip
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()
            raise netns.NetnsError(f"shard {i} did not start: {tail[-1] if tail else ''}")
    return work, shards


def stop_shards(topo: netns.Topology, work: Path, shard_regions: list[int]) -> None:
    """Stop every shard (`diloco-server stop` inside its region)."""
    for i, region in enumerate(shard_regions):
        subprocess.run(
            [*topo.prefix_argv(region), sys.executable, "-m", "paramserver.server.cli", "stop",
             "--data-dir", str(daemon.shard_dir(work / "server", i)), "--timeout", "30"],
            capture_output=True, timeout=60,
        )  # fmt: skip


def island_argv(
    topo: netns.Topology,
    region: int,
    connect: str,
    params: int,
    rounds: int,
    compute_s: float,
    *extra: str,
) -> list[str]:
    """The argv of region `region`'s island (`bench.children.region_island`), inside its namespace."""
    return [*topo.prefix_argv(region), *child.module_argv(
        "bench.children.region_island", "--connect", connect,
        "--island", island_name(region), "--params", str(params),
        "--rounds", str(rounds), "--compute-s", str(compute_s),
        "--speed", str(REGIONS[region].island_speed), "--seed", str(region), *extra,
    )]  # fmt: skip


def island_name(region: int) -> str:
    """The island id of region `region`."""
    return f"island-{REGIONS[region].name}"


def run_islands(
    topo: netns.Topology,
    links: list[Link],
    scale: float,
    shard_regions: list[int],
    params: int,
    rounds: int,
    compute_s: float,
    timeout_s: float,
) -> dict[str, Any]:
    """Start the shards and one island per region, wait for the islands, report.

    Args:
        topo: the built, probed topology (its relays forward `shard_ports`).
        links: the links at real rates.
        scale: the final scale (emulated Mbit/s = Gbit/s x 1000 x scale).
        shard_regions: where shard 0, 1, ... run.
        params: float32 parameters of the synthetic model.
        rounds: rounds per island.
        compute_s: compute per round of a speed-1.0 island (a sleep).
        timeout_s: bound on the islands.

    Returns:
        The run part of the report (with "t0", the islands' start, and
        "link_utilisation": `LinkSampler.utilisation`).
    """
    work, shards = start_shards(topo, shard_regions)
    islands = []
    sampler = LinkSampler(topo)
    t0 = time.monotonic()
    with sampler:
        for region in range(topo.regions):
            argv = island_argv(topo, region, shards[0].router, params, rounds, compute_s)
            err = open(work / f"island{region}.log", "w+b")  # noqa: SIM115 (read after the run)
            islands.append(
                (region, subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True), err)
            )
        reports, errors = [], []
        for region, proc, err in islands:
            try:
                out, _ = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            lines = out.strip().splitlines()
            if not lines:
                err.seek(0)
                tail = err.read().decode(errors="replace").strip().splitlines()
                errors.append(
                    f"island in {REGIONS[region].name}: {tail[-1] if tail else proc.returncode}"
                )
                continue
            result = json.loads(lines[-1])
            report = island_report(result, region, shard_regions, links, scale)
            for row, raw in zip(report["rounds"], result["rounds"], strict=True):
                row["started_s"] = round(raw["started"] - t0, 3)
                row["compute_s"] = round(compute_s / result["speed"], 4)
            reports.append(report)
    for _, _, err in islands:
        err.close()
    stop_shards(topo, work, shard_regions)
    return {
        "params": params,
        "rounds": rounds,
        "compute_s_per_round_at_speed_1": compute_s,
        "codec": "int8 (random deltas, bench.load_cluster.random_frames)",
        "islands": reports,
        "errors": errors,
        "link_utilisation": sampler.utilisation(t0),
    }
