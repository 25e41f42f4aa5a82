"""The shard side of `diloco-bench scale`: one real shard, client-only islands, its RSS and log.

Two runs per size, each against a fresh one-shard server started through
`diloco-server start` (`bench.launcher.LocalCluster`), in sync mode with
`islands` `paramserver.client.Client`s without a replica
(`ClientConfig(keep="versions")`: they push and follow versions, decoding no
update, so this process holds no copy of the model per island) pushing the same random int8 deltas
(`bench.load_cluster.random_frames`) and a raw SUB socket (`UpdateWatcher`) timing
each fragment's published update without decoding it:

- `measure_steady`: checkpoints off. The shard's RSS (/proc, `psutil`) idle
  before init and after init and two steps (and this process's own, the
  islands' side), and the time of each step (every
  island pushes every fragment; a step is timed from the last island's last
  push to the last fragment's update).
- `measure_checkpoints`: a checkpoint after every round of steps
  (`--checkpoint-every-steps F`), large arrays mapped one by one
  (`PENDING_ALLOCATOR`). Right after init, the RSS after each whole-model
  delta that islands 1.. push while island 0 stays silent (in sync mode they
  wait pending; island 0's push releases them). After each round, islands
  1.. push probe deltas one at a time (they stay pending until the next
  round), once as soon as their clients applied the round's updates (a probe
  pushed while its client still decodes them times that decoding, here, and
  not the shard's ack), again once the round's checkpoint is written (the
  quiet baseline); each probe's ack wait is quiet or overlapped a
  checkpoint, whose times come from the shard's log line ``shard I
  checkpoint N: B bytes in S s`` (`checkpoint_windows`).

Progress goes to `log` (stderr).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import psutil

from bench.launcher import LaunchError, LocalCluster
from bench.load_cluster import environ, random_frames, shard_pids
from bench.update_watcher import WAIT_S, UpdateWatcher
from paramserver.client import Client, ClientConfig, ClientError
from paramserver.server.config import MIB

JOIN_BYTES_PER_S = 50e6  # a join (init, snapshots) slower than this has failed
PROBES_PER_ROUND = 8  # at least this many probe acks follow each checkpointed round
# The run that holds deltas pending: large arrays mapped and unmapped one by one, so that
# RSS follows what the shard holds (with the default, dynamic threshold, a pending delta
# reuses memory freed by earlier temporaries and RSS hides it until that runs out).
PENDING_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
SHARD_ARGS = ("--mode", "sync", "--heartbeat-interval-s", "2.0", "--liveness", "30")


def probe_rounds(islands: int, fragments: int) -> int:
    """Rounds of probes each waiting island pushes after a checkpointed round.

    Args:
        islands: islands of the run (all but island 0 push probes).
        fragments: one probe per fragment and round.

    Returns:
        Enough rounds for PROBES_PER_ROUND probes, at most 8 (the shard's default
        max_pending_per_island).
    """
    return min(8, math.ceil(PROBES_PER_ROUND / ((islands - 1) * fragments)))


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (VmRSS, as /proc/<pid>/status has it)."""
    return int(psutil.Process(pid).memory_info().rss)


def anon_rss_bytes(pid: int) -> int | None:
    """Anonymous resident memory of a process (RssAnon: RSS less file-backed pages such as
    shared libraries' code), or None where /proc has no such line."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    found = [int(x.split()[1]) * 1024 for x in lines if x.startswith("RssAnon:")]
    return found[0] if found else None


def peak_rss_bytes(pid: int) -> int:
    """Peak resident set size of a process so far (VmHWM of /proc/<pid>/status; 0 if absent)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def settled_rss(pid: int, settle_s: float = 0.3) -> int:
    """RSS once it stopped moving: read until two reads `settle_s` apart agree within 1 MiB."""
    last = rss_bytes(pid)
    for _ in range(20):
        time.sleep(settle_s)
        now = rss_bytes(pid)
        if abs(now - last) < MIB:
            return now
        last = now
    return last


@contextlib.contextmanager
def one_shard(
    out: Path,
    params: int,
    fragments: int,
    extra: list[str],
    log: TextIO,
    env: dict[str, str] | None = None,
) -> Iterator[tuple[LocalCluster, int, UpdateWatcher]]:
    """A one-shard server (its own launch path) and a watcher on its PUB; stopped on exit.

    Args:
        out: the server's data dir goes below it.
        params: parameters (for the message limit of its init).
        fragments: fragments of the plan.
        extra: further `diloco-server start` flags.
        log: progress lines.
        env: environment variables of the server's processes.

    Yields:
        (cluster, the shard's pid, the watcher, already hearing the PUB).
    """
    args = [*SHARD_ARGS, "--fragments", str(fragments), *extra]
    with LocalCluster(out, shards=1, server_args=args) as cluster:
        print(f"scale: starting a shard in {out}", file=log, flush=True)
        with environ(env or {}):
            cluster.start_server()
        pid = shard_pids(cluster)[0]
        watcher = UpdateWatcher(f"tcp://{cluster.host}:{cluster.port + 1}")
        watcher.start()
        try:
            if not watcher.heard.wait(60):
                raise LaunchError("the shard's PUB sent nothing (not even a heartbeat) in 60 s")
            yield cluster, pid, watcher
        finally:
            watcher.stop_event.set()
            watcher.join(5)


class Islands:
    """`count` client-only islands joined to one shard, pushing one set of int8 frames.

    The islands keep no replica (`ClientConfig(keep="versions")`); the init's zeros
    are one `np.zeros` array, whose pages are never written (the init reads it
    piece by piece: `paramserver.client.init_upload`), so they take no memory,
    and it is dropped once every island joined.
    """

    def __init__(
        self, connect: str, count: int, params: int, log: TextIO, fragments: int = 16
    ) -> None:
        """Join every island (the first initialises the shard with zeros).

        Each client allows as many unacked pushes as there are fragments, so
        that a round's pushes all go out at once: `step_round`'s timer starts
        at the last push, not once most of the round's steps already ran.
        """
        flat = {"w": np.zeros(params, np.float32)}  # untouched zero pages: no RSS
        self.clients: list[Client] = []
        self.rounds = [0] * count
        try:
            for i in range(count):
                cfg = ClientConfig(
                    connect=connect,
                    island=f"scale-{i}",
                    heartbeat_interval_s=2.0,
                    liveness=30,
                    ack_timeout_s=600.0,  # no re-send during a long step: it would skew acks
                    ack_timeout_cap_s=1200.0,
                    ack_timeout_floor_s=600.0,
                    push_timeout_s=WAIT_S,
                    join_timeout_s=120.0 + 4 * params / JOIN_BYTES_PER_S,
                    keep="versions",  # they push and follow versions; values are not needed
                    max_unacked=max(16, fragments),  # a round's pushes never wait for acks
                )
                self.clients.append(Client(cfg))
                plan = self.clients[-1].join(flat).plan
                print(f"scale: island {i} joined", file=log, flush=True)
        except BaseException:
            self.close()
            raise
        del flat
        self.sizes = {f.index: f.size for f in plan.fragments}
        print(f"scale: encoding int8 deltas of {len(self.sizes)} fragments", file=log, flush=True)
        self.frames = {f: v[0] for f, v in random_frames(self.sizes, 1, 0).items()}

    def push_all(self, i: int, watcher: UpdateWatcher) -> None:
        """Island `i` pushes its next round: every fragment, against the newest versions."""
        self.rounds[i] += 1
        for f in sorted(self.sizes):
            self.clients[i].push(f, self.rounds[i], watcher.version(f), 4096, 16, self.frames[f])

    def push_one(self, i: int, fragment: int, watcher: UpdateWatcher) -> float:
        """Island `i` pushes one fragment of its next round and waits for the ack.

        Returns:
            The ack latency the client measured (push call to ack).
        """
        client = self.clients[i]
        client.ack_latencies()  # drop earlier ones
        self.rounds[i] += 1
        client.push(
            fragment, self.rounds[i], watcher.version(fragment), 4096, 16, self.frames[fragment]
        )
        self.wait_acked(i)
        return client.ack_latencies()[-1]

    def wait_acked(self, i: int, timeout_s: float = WAIT_S) -> None:
        """Wait until island `i` has no unacked delta; a rejection ends the run.

        Raises:
            LaunchError: a delta was rejected, or not acked in time.
        """
        deadline = time.monotonic() + timeout_s
        while (stats := self.clients[i].stats())["pending"]:
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"island {i}: {stats['pending']} deltas unacked after {timeout_s:g}s"
                )
            time.sleep(0.002)
        if stats["rejected"]:
            raise LaunchError(f"island {i}: the shard rejected deltas: {stats['rejected']}")

    def wait_applied(self, applied: list[int], timeout_s: float = WAIT_S) -> None:
        """Wait until every island applied one more update per fragment than `applied` says.

        A probe pushed while its client still decodes the round's updates would
        time that decoding (in this process), not the shard's ack.

        Args:
            applied: each island's `updates_applied` before the round.

        Raises:
            LaunchError: an island did not take in the round's updates in time.
        """
        deadline = time.monotonic() + timeout_s
        for i, client in enumerate(self.clients):
            while client.stats()["updates_applied"] < applied[i] + len(self.sizes):
                if time.monotonic() > deadline:
                    raise LaunchError(f"island {i}: the round's updates not applied in time")
                time.sleep(0.005)

    def next_versions(self, watcher: UpdateWatcher) -> dict[int, int]:
        """Each fragment's version after one more step."""
        return {f: watcher.version(f) + 1 for f in self.sizes}

    def close(self) -> None:
        """Close every client."""
        for client in self.clients:
            with contextlib.suppress(ClientError):
                client.close(flush_timeout_s=2.0)


def step_round(islands: Islands, watcher: UpdateWatcher) -> float:
    """Every island pushes every fragment, the last one last; seconds from its last push to the last update."""
    target = islands.next_versions(watcher)
    last = len(islands.clients) - 1
    for i in range(last):
        islands.push_all(i, watcher)
        islands.wait_acked(i)
    islands.push_all(last, watcher)
    sent = time.monotonic()
    return watcher.wait_all(target) - sent


def measure_steady(
    out: Path, params: int, fragments: int, islands: int, steps: int, log: TextIO
) -> dict[str, Any]:
    """Idle and steady RSS and the step times of one shard, checkpoints off (see the module doc).

    Args:
        out: the server's data dir goes below it.
        params: parameters.
        fragments: fragments of the plan.
        islands: client islands (each step merges one delta of each).
        steps: steps taken (>= 2); the RSS is read after the second.
        log: progress lines.

    Returns:
        {"rss_idle", "rss_steady" (bytes), "anon_idle", "anon_steady" (their
        anonymous part, `anon_rss_bytes`), "step_s": [one per step], "bench_rss_idle",
        "bench_rss_steady": this process's RSS (the islands' side) at the same moments,
        "rss_peak": the shard's peak RSS (VmHWM) after the last step}.
    """
    off = ["--checkpoint-every-steps", "0", "--checkpoint-every-s", "0"]
    with one_shard(out, params, fragments, off, log) as (cluster, pid, watcher):
        idle = settled_rss(pid)
        anon_idle = anon_rss_bytes(pid)
        bench_idle = rss_bytes(os.getpid())
        isl = Islands(cluster.connect, islands, params, log, fragments)
        try:
            times = []
            for k in range(max(2, steps)):
                times.append(step_round(isl, watcher))
                print(f"scale: step {k + 1}: {times[-1]:.3f} s", file=log, flush=True)
                if k == 1:
                    steady = settled_rss(pid)
                    anon_steady = anon_rss_bytes(pid)
                    bench_steady = rss_bytes(os.getpid())
            peak = peak_rss_bytes(pid)
        finally:
            isl.close()
    return {
        "rss_peak": peak,
        "rss_idle": idle,
        "rss_steady": steady,
        "anon_idle": anon_idle,
        "anon_steady": anon_steady,
        "step_s": times,
        "bench_rss_idle": bench_idle,
        "bench_rss_steady": bench_steady,
    }


def _hold_pending(isl: Islands, pid: int, pending: int, watcher: UpdateWatcher, log: TextIO):
    """Islands 1.. push `pending` whole-model deltas (island 0 silent: they wait); RSS after each."""
    points = [[0, settled_rss(pid)]]
    for p in range(pending):
        i = 1 + p % (len(isl.clients) - 1)
        isl.push_all(i, watcher)
        isl.wait_acked(i)
        points.append([p + 1, settled_rss(pid)])
        print(f"scale: {p + 1} pending: RSS {points[-1][1] / MIB:.0f} MiB", file=log, flush=True)
    return points


CHECKPOINT_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*shard \d+ checkpoint (\d+): (\d+) bytes in ([0-9.]+) s"
)


def checkpoint_windows(log_file: Path) -> list[dict[str, float]]:
    """The checkpoints a shard's log reports: when each ended, how long it took, its bytes.

    Args:
        log_file: the shard's daemon.log (record times are local wall-clock, to the ms).

    Returns:
        [{"start", "end" (epoch seconds), "seconds", "bytes"}, ...] in log order.
    """
    found = []
    text = log_file.read_text(errors="replace") if log_file.exists() else ""
    for line in text.splitlines():
        m = CHECKPOINT_LINE.match(line)
        if m is None:
            continue
        end = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        seconds = float(m.group(4))
        found.append(
            {"start": end - seconds, "end": end, "seconds": seconds, "bytes": int(m.group(3))}
        )
    return found


def settled_checkpoints(log_file: Path, cycles: int) -> list[dict[str, float]]:
    """The checkpoints of the run once their count stops growing.

    A checkpoint is written in the background and only one at a time, so rounds
    that step while one is written share the next one: a run may end with fewer
    than `cycles`. Wait for `cycles` of them, or until none was added for
    three times the longest one took (at least 10 s).

    Args:
        log_file: the shard's daemon.log.
        cycles: checkpointed rounds the run made.

    Returns:
        `checkpoint_windows(log_file)` at that moment.
    """
    deadline = time.monotonic() + WAIT_S
    found, changed = checkpoint_windows(log_file), time.monotonic()
    while len(found) < cycles and time.monotonic() < deadline:
        quiet = max([10.0] + [3 * c["seconds"] for c in found])
        if found and time.monotonic() - changed > quiet:
            break
        time.sleep(0.1)
        now_found = checkpoint_windows(log_file)
        if len(now_found) != len(found):
            found, changed = now_found, time.monotonic()
    return found


def _probe(
    isl: Islands, islands: int, rounds: int, watcher: UpdateWatcher, probes: list[list[float]]
) -> None:
    """Islands 1.. push `rounds` probes to every fragment, one at a time; append [start, wait]."""
    for i in range(1, islands):
        for _ in range(rounds):
            for f in sorted(isl.sizes):
                start = time.time()
                probes.append([start, isl.push_one(i, f, watcher)])


def _wait_checkpoints(log_file: Path, count: int) -> None:
    """Wait until the shard's log reports `count` checkpoints written (at most WAIT_S)."""
    deadline = time.monotonic() + WAIT_S
    while len(checkpoint_windows(log_file)) < count and time.monotonic() < deadline:
        time.sleep(0.1)


def measure_checkpoints(
    out: Path, params: int, fragments: int, islands: int, pending: int, cycles: int, log: TextIO
) -> dict[str, Any]:
    """RSS per pending delta, then ack waits of probes after checkpointed rounds (module doc).

    Returns:
        {"pending_rss": [[pending, rss], ...], "release_s", "probes": [[start epoch s,
        seconds], ...], "checkpoints": checkpoint_windows(...), "probe_rounds", "rss_peak":
        the shard's peak RSS (VmHWM) at the end}.
    """
    probes: list[list[float]] = []
    # a checkpoint after every round of steps (one step per fragment)
    every = ["--checkpoint-every-steps", str(fragments), "--checkpoint-every-s", "0"]
    with contextlib.ExitStack() as stack:
        cluster, pid, watcher = stack.enter_context(
            one_shard(out, params, fragments, every, log, PENDING_ALLOCATOR)
        )
        isl = Islands(cluster.connect, islands, params, log, fragments)
        stack.callback(isl.close)
        points = _hold_pending(isl, pid, pending, watcher, log)
        rounds = probe_rounds(islands, fragments)
        release = 0.0
        log_file = cluster.shard_dir(0) / "daemon.log"
        for cycle in range(cycles):
            target = isl.next_versions(watcher)
            applied = [c.stats()["updates_applied"] for c in isl.clients]
            written = len(checkpoint_windows(log_file))
            # the islands that wait (1.., once they pushed) are released by the others' push
            pushers = [i for i in range(islands) if i == 0 or isl.rounds[i] == 0]
            for i in pushers:
                isl.push_all(i, watcher)
            sent = time.monotonic()
            waited = watcher.wait_all(target) - sent
            if cycle == 0:
                release = waited
            isl.wait_applied(applied)
            _probe(isl, islands, rounds, watcher, probes)  # while the round's checkpoint is written
            _wait_checkpoints(log_file, written + 1)
            _probe(isl, islands, rounds, watcher, probes)  # and after it: the quiet baseline
            print(f"scale: checkpoint cycle {cycle + 1}/{cycles} done", file=log, flush=True)
        found = settled_checkpoints(log_file, cycles)
        peak = peak_rss_bytes(pid)
    return {
        "rss_peak": peak,
        "pending_rss": points,
        "release_s": release,
        "probes": probes,
        "checkpoints": found,
        "probe_rounds": rounds,
    }
