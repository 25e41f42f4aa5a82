"""Load test: many lightweight simulated islands (client only, random int8 deltas) against N shards.

    diloco-bench load [--islands 32] [--shards 4] [--rounds 10] [--params 262144]
                      [--max-rss-mb 2048] [--timeout 300] [--out runs/load]
                      [--profile-shard I]

Starts the shards as real daemons (`diloco-server start --detach`, async mode),
joins `--islands` `paramserver.client.Client`s from this process (no JAX, no
model: a single flat float32 leaf of `--params` elements), and has each push
every fragment for `--rounds` rounds from its own thread. Checks, and reports
as JSON on stdout: every push acked (nothing lost), the shards' accepted
counts equal the pushes, the whole run finished within `--timeout` (no
deadlock), and the shards' peak RSS stayed under `--max-rss-mb`; plus pushes
per second and p50/p99 ack latency (push call to ack), the islands' re-sends
and how many were spurious (the shard already had the delta), and what bounds
the rate: the fsync rate of the shards' data dir's disk in the same run
(`fsync_per_s`: write + fsync of one push-sized record in a loop, before and
after the pushes) and the CPU the shards, this process and the machine used
while pushing. `--profile-shard I` runs shard I under cProfile
(`bench.shard_profile`) and adds the seconds per part of its loop. Exit 1
when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil

import codec
from bench import outdir, shard_profile
from bench.common import emit_json
from bench.launcher import LaunchError, LocalCluster
from paramserver.client import Client, ClientConfig, ClientError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `diloco-bench load`."""
    parser.add_argument("--islands", type=int, default=32, help="simulated islands (default 32)")
    parser.add_argument("--shards", type=int, default=4, help="shard processes (default 4)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds per island (default 10)")
    parser.add_argument(
        "--params", type=int, default=262_144, help="float32 parameters (default 262144)"
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


FSYNC_PROBE_S = 2.0  # each fsync measurement (before and after the pushes) lasts this long


def fsync_rate(directory: Path, nbytes: int, duration_s: float = FSYNC_PROBE_S) -> float:
    """Writes + fsyncs of `nbytes` per second in `directory` (what a shard's log does per push).

    Args:
        directory: a directory on the disk to measure (the shards' data dir).
        nbytes: bytes per write (appended: the file grows like a log).
        duration_s: how long to measure.

    Returns:
        Write+fsync pairs per second.
    """
    path = directory / ".fsync-probe"
    block = os.urandom(nbytes)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        count, start = 0, time.monotonic()
        while (elapsed := time.monotonic() - start) < duration_s:
            os.write(fd, block)
            os.fsync(fd)
            count += 1
    finally:
        os.close(fd)
        path.unlink()
    return count / elapsed


class CpuMeter:
    """CPU time used by some processes and by the whole machine between `start` and `stop`."""

    def __init__(self, pids: dict[str, int]) -> None:
        """Args:
        pids: name -> process (a vanished one reads as None).
        """
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self._t0 = 0.0
        self._cpu0: dict[str, float | None] = {}
        self._machine0 = psutil.cpu_times()

    def _cpu(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for name, proc in self.procs.items():
            try:
                times = proc.cpu_times()
                out[name] = times.user + times.system
            except psutil.Error:
                out[name] = None
        return out

    def start(self) -> None:
        """Start measuring."""
        self._t0, self._cpu0, self._machine0 = time.monotonic(), self._cpu(), psutil.cpu_times()

    def stop(self) -> dict[str, Any]:
        """Cores busy since `start`: per process (1.0 = one core), and the machine's share.

        Returns:
            {"cores": n, "machine_busy": share of all cores, "<name>": cores used, ...}.
        """
        elapsed = max(1e-9, time.monotonic() - self._t0)
        machine = psutil.cpu_times()
        idle = (machine.idle + getattr(machine, "iowait", 0.0)) - (
            self._machine0.idle + getattr(self._machine0, "iowait", 0.0)
        )
        total = sum(machine) - sum(self._machine0)
        out: dict[str, Any] = {
            "cores": psutil.cpu_count(),
            "machine_busy": round(1 - idle / total, 3) if total > 0 else None,
        }
        for name, used in self._cpu().items():
            before = self._cpu0.get(name)
            out[name] = (
                None if used is None or before is None else round((used - before) / elapsed, 3)
            )
        return out


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) of `values`, or None when empty.

    Args:
        values: samples.
        q: percentile in [0, 100].

    Returns:
        The percentile (linear interpolation), or None.
    """
    return float(np.percentile(values, q)) if values else None


def rates(pushes: int, elapsed_s: float, fsync_before: float, fsync_after: float) -> dict:
    """The load test's rates: pushes per second, fsyncs per second, and their ratio.

    Args:
        pushes: pushes acked in the measured window.
        elapsed_s: its length.
        fsync_before: fsyncs per second measured before the window.
        fsync_after: and after it.

    Returns:
        {"pushes_per_s", "fsync_per_s" (the mean of before and after),
        "pushes_per_fsync"}; the push figures are None for an empty window.
    """
    fsync_per_s = (fsync_before + fsync_after) / 2
    pushes_per_s = pushes / elapsed_s if elapsed_s > 0 else None
    return {
        "pushes_per_s": None if pushes_per_s is None else round(pushes_per_s, 1),
        "fsync_per_s": round(fsync_per_s, 1),
        "pushes_per_fsync": None
        if pushes_per_s is None or fsync_per_s <= 0
        else round(pushes_per_s / fsync_per_s, 3),
    }


class RssSampler(threading.Thread):
    """Samples the RSS of a set of processes until stopped; keeps the peak per process."""

    def __init__(self, pids: list[int], interval_s: float = 0.2) -> None:
        """Args:
        pids: processes to watch (a vanished one is skipped).
        interval_s: sampling period.
        """
        super().__init__(name="rss-sampler", daemon=True)
        self.procs = {pid: psutil.Process(pid) for pid in pids}
        self.peak: dict[int, int] = dict.fromkeys(pids, 0)
        self.interval_s = interval_s
        self.stop_event = threading.Event()

    def run(self) -> None:
        """Sample until `stop_event` is set."""
        while not self.stop_event.is_set():
            for pid, proc in self.procs.items():
                try:
                    self.peak[pid] = max(self.peak[pid], proc.memory_info().rss)
                except psutil.Error:
                    continue
            self.stop_event.wait(self.interval_s)


def shard_pids(cluster: LocalCluster) -> list[int]:
    """Pids of the cluster's shard processes (from the supervisor's ready file)."""
    info = json.loads((cluster.server_dir / "ready.json").read_text())
    return [int(p) for p in info["shard_pids"]]


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


def _random_frames(
    plan_sizes: dict[int, int], variants: int, seed: int
) -> dict[int, list[list[Any]]]:
    """A few int8-encoded random deltas per fragment (reused: encoding is not what is measured)."""
    rng = np.random.default_rng(seed)
    c = codec.int8()
    out: dict[int, list[list[Any]]] = {}
    for f, size in plan_sizes.items():
        out[f] = []
        for _ in range(variants):
            delta = (rng.standard_normal(size) * 1e-3).astype(np.float32)
            frames, _ = c.encode({"delta": delta})
            out[f].append([bytes(x) for x in frames])
    return out


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
        with _environ(env):
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
            frames = _random_frames(sizes, variants=4, seed=0)
            expected = args.islands * args.rounds * len(sizes)
            # one push's payload: about what a shard's log appends (and fsyncs, grouped) per push
            record = int(np.mean([sum(len(x) for x in v) for fs in frames.values() for v in fs]))
            fsync_before = fsync_rate(cluster.server_dir, record)
            cpu.start()
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
                acked = sum(c.stats()["acked"] for c in clients)
                if acked >= expected or errors:
                    break
                time.sleep(0.05)
            elapsed = time.monotonic() - t0
            cores = cpu.stop()
            fsync_after = fsync_rate(cluster.server_dir, record)
            latencies = [x for c in clients for x in c.ack_latencies()]
            stats = [c.stats() for c in clients]
        finally:
            dropped = sum(c.close(flush_timeout_s=2.0) for c in clients)
            sampler.stop_event.set()
            sampler.join(5.0)
        server = cluster.server_status()
    accepted = sum(s.get("accepted", 0) for s in server.get("shards", []))
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
        "resent": sum(s["resent"] for s in stats),
        "spurious_resends": sum(s["spurious_resends"] for s in stats),
        "ack_timeout_s": _spread([s["ack_timeout_s"] for s in stats]),
        "dropped_at_close": dropped,
        "elapsed_s": round(elapsed, 3),
        "pushes_per_s": measured["pushes_per_s"],
        "fsync_write_bytes": record,
        "fsync_per_s": measured["fsync_per_s"],
        "fsync_per_s_before_after": [round(fsync_before, 1), round(fsync_after, 1)],
        "pushes_per_fsync": measured["pushes_per_fsync"],
        "cpu_cores_busy": cores,
        "ack_latency_p50_ms": _ms(percentile(latencies, 50)),
        "ack_latency_p99_ms": _ms(percentile(latencies, 99)),
        "ack_latency_max_ms": _ms(max(latencies, default=None)),
        "bytes_sent": sum(s["bytes_sent"] for s in stats),
        "shard_rss_peak_mb": round(peak_mb, 1),
        "max_rss_mb": args.max_rss_mb,
        "checks": checks,
        "errors": errors,
        "ok": all(checks.values()),
    }
    if profiled:
        report["shard_profile"] = _profile_report(out / "profile", args.profile_shard, server)
    (out / "load.json").write_text(json.dumps(report, indent=2))
    return report


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def _spread(values: list[float]) -> dict[str, float] | None:
    """min / median / max of the islands' values (None when there are none)."""
    if not values:
        return None
    return {
        k: round(float(f(values)), 3) for k, f in (("min", min), ("p50", np.median), ("max", max))
    }


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    """Set environment variables for what starts inside (the shards), then restore them."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _profile_report(directory: Path, index: int, server: dict[str, Any]) -> dict[str, Any]:
    """The profiled shard's seconds per part of its loop (its pstats file, once it exited)."""
    path = directory / f"shard-{index}.pstats"
    if not path.exists():
        return {"shard": index, "error": f"{path} was not written (did the shard exit cleanly?)"}
    status = next((s for s in server.get("shards", []) if s.get("shard") == index), {})
    return {"shard": index, "accepted": status.get("accepted"), **shard_profile.sections(path)}


def run(args: argparse.Namespace) -> int:
    """Run `diloco-bench load`; prints the JSON report; returns 0 when every check passed."""
    for name in ("islands", "shards", "rounds", "params"):
        if getattr(args, name) < 1:
            print(f"diloco-bench load: --{name} must be >= 1", file=sys.stderr)
            return 2
    try:
        report = run_load(args)
    except (LaunchError, ClientError) as exc:
        print(f"diloco-bench load: {exc}", file=sys.stderr)
        return 1
    emit_json(report)
    if not report["ok"]:
        failed = [k for k, v in report["checks"].items() if not v]
        print(f"diloco-bench load: checks failed: {', '.join(failed)}", file=sys.stderr)
    return 0 if report["ok"] else 1
