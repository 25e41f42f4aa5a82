"""Chaos run: training under a seeded fault schedule next to a fault-free run with the same seed.

    diloco-bench chaos --faults N --seed S [--quick] [--duration 90] --out DIR

Each run is real daemons: shards started one by one from a cluster file
(`diloco-server start --cluster F --shard I --detach`, so one can be killed
and restarted alone), a chaos relay (`bench.children.chaos_relay`) in front of every
shard ROUTER, and `diloco-worker` islands. The schedule (`bench.faults`) is
executed by this harness (kill -9 / restart an island or a shard, SIGSTOP /
SIGCONT an island) and by the relay (cut or slow an island's link; drop,
duplicate, delay or corrupt its pushes and acks). Both runs train for the
same wall time; the fault-free run uses the same seed and an empty schedule.

Reported per run (JSON on stdout and in DIR/chaos.json): `goodput` (the share
of the islands' time spent on inner steps whose work entered the model: the
tokens the shards credit after the final merges, staleness not counted / what
the islands would have trained in the window at their own median round rate;
kills, pauses, back-pressure and rejected work are lost; machine-speed independent),
`uptime` (share of windows in which some fragment version advanced),
`uptime_outside_shard_outages` (the same, leaving out the windows of a shard's
outage, from its kill to its first step after the restart: the uptime the
island and link faults leave),
`deltas_acked` (unique keys the shards acked, seen by the relay),
`deltas_applied` (the shards' durable accepted count: merged or pending),
`final_eval_loss` (held-out loss of the final global parameters), recovery
time per fault, and the faults that fired. Exit 1 if acked != applied.

(About 420 lines: the harness's fault injection, its version sampler and its
two runs share the `ChaosRun` state; the scoring is apart, in `bench.chaos_score`.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from bench import chaos_score, child, outdir
from bench import faults as fl
from bench.common import emit_json
from bench.launcher import IslandSpec, LaunchError, LocalCluster, free_base_port
from paramserver.plumbing import daemon, probe

SAMPLE_S = 0.25


@dataclass(frozen=True)
class Setup:
    """Shape of both runs."""

    islands: int = 2
    shards: int = 2
    duration_s: float = 90.0
    inner_steps: int = 10
    model: str = "tiny"
    batch_size: int = 8
    seq_len: int = 64
    heartbeat_s: float = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `diloco-bench chaos`."""
    parser.add_argument("--faults", type=int, default=8, help="faults to inject (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="schedule and relay seed (default 0)")
    parser.add_argument("--quick", action="store_true", help="CI size: 20 s measured per run")
    parser.add_argument("--duration", type=float, default=None, help="seconds per run")
    parser.add_argument(
        "--islands", type=int, default=2, help="island daemons of each run (default 2)"
    )
    parser.add_argument(
        "--shards", type=int, default=2, help="shard processes of the server (default 2)"
    )
    parser.add_argument("--kinds", default=",".join(fl.KINDS), help="comma-separated fault kinds")
    parser.add_argument("--out", default="runs/chaos", help="output dir (new, empty or from chaos)")


def _log(msg: str) -> None:
    print(f"chaos: {msg}", file=sys.stderr, flush=True)


def server_settings(setup: Setup) -> dict[str, Any]:
    """The `[server]` settings of a chaos run's cluster file.

    Args:
        setup: the run's shape (islands, heartbeat, duration for the checkpoint period).

    Returns:
        Settings for `LocalCluster.write_relayed_cluster_file`.
    """
    return {
        "mode": "quorum",
        # as the report: all islands but one, so one faulty island never holds up the steps
        "quorum": max(1, setup.islands - 1),
        "inner_steps": setup.inner_steps,  # the islands' H: picks the default outer lr
        "heartbeat_interval_s": setup.heartbeat_s,
        "liveness": 5,
        "checkpoint_every_steps": 25,
        "checkpoint_every_s": max(5.0, setup.duration_s / 4),
    }


class VersionSampler(threading.Thread):
    """Polls every shard's versions; keeps (time, shard, version sum) samples."""

    def __init__(self, routers: list[str]) -> None:
        """Args:
        routers: every shard's loopback ROUTER, in shard order.
        """
        super().__init__(name="version-sampler", daemon=True)
        self.routers = routers
        self.samples: list[tuple[float, int, int]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        """Sample until `stop_event` is set (a shard that does not answer keeps its last value)."""
        ctx = zmq.Context()
        try:
            while not self.stop_event.is_set():
                for i, router in enumerate(self.routers):
                    with contextlib.suppress(probe.ProbeError):
                        st = probe.shard_status(ctx, router, timeout_s=0.3)
                        total = sum(int(v) for v in st.get("versions", {}).values())
                        self.samples.append((time.time(), i, total))
                self.stop_event.wait(SAMPLE_S)
        finally:
            ctx.destroy(linger=0)

    def timeline(self) -> list[tuple[float, int]]:
        """(time, sum over shards of the latest known version sum), one point per sample."""
        last: dict[int, int] = {}
        out = []
        for t, shard, total in self.samples:
            last[shard] = max(total, last.get(shard, 0))
            out.append((t, sum(last.values())))
        return out

    def advances(self, shard: int) -> list[float]:
        """Times at which `shard`'s version sum grew."""
        prev, out = None, []
        for t, s, total in self.samples:
            if s != shard:
                continue
            if prev is not None and total > prev:
                out.append(t)
            prev = total if prev is None else max(prev, total)
        return out


class ChaosRun:
    """One run: cluster up, faults executed on time, everything down, figures out."""

    def __init__(self, name: str, setup: Setup, faults: list[fl.Fault], seed: int, out: Path):
        """Lay the run out under `out/name` (nothing starts before `run`).

        Args:
            name: run name ("fault_free" or "faulted").
            setup: the run's shape.
            faults: the schedule (empty: fault-free).
            seed: model, relay and schedule seed.
            out: parent directory.
        """
        self.name, self.setup, self.faults, self.seed = name, setup, faults, seed
        self.out = out / name
        self.out.mkdir(parents=True, exist_ok=True)
        self.islands = [f"island-{i}" for i in range(setup.islands)]
        self.cluster = LocalCluster(self.out, shards=setup.shards)
        self.bind_base = self.cluster.port
        self.relay_base = free_base_port(setup.shards)
        self.start_file = self.out / "start"  # islands wait for it (a start barrier)
        self.t0_file = self.out / "t0"  # the measured window's start, for the relay
        self.events: list[dict[str, Any]] = []
        self._restarts: list[threading.Thread] = []
        self._relay: child.Child | None = None

    # -- processes -----------------------------------------------------------------

    def _spec(self, name: str) -> IslandSpec:
        s = self.setup
        return IslandSpec(
            name,
            1.0,
            (
                "--model", s.model, "--batch-size", str(s.batch_size),
                "--seq-len", str(s.seq_len), "--inner-steps", str(s.inner_steps),
                "--eval-every", "0", "--seed", str(self.seed), "--flush-timeout-s", "5",
                "--heartbeat-interval-s", str(s.heartbeat_s), "--start-file", str(self.start_file),
            ),
        )  # fmt: skip

    def _pid(self, directory: Path) -> int | None:
        return daemon.running_pid(daemon.pid_path(directory))

    def _start_relay(self, stats: Path) -> None:
        schedule = self.out / "schedule.json"
        schedule.write_text(json.dumps([f.to_json() for f in self.faults]))
        argv = [sys.executable, "-m", "bench.children.chaos_relay", "--schedule", str(schedule),
                "--start-file", str(self.t0_file), "--seed", str(self.seed),
                "--stats", str(stats)]  # fmt: skip
        for i in range(self.setup.shards):
            argv += [
                "--pair",
                f"tcp://127.0.0.1:{self.relay_base + i}=tcp://127.0.0.1:{self.bind_base + 2 * i}",
            ]
        self._relay = child.start(argv, "chaos relay")

    def _stop_relay(self) -> None:
        if self._relay is not None:
            self._relay.stop(30.0)

    # -- faults ----------------------------------------------------------------------

    def _later(self, delay_s: float, fn, *args) -> None:
        def body() -> None:
            time.sleep(max(0.0, delay_s))
            try:
                fn(*args)
            except Exception as exc:  # reported, never fatal to the run
                self.events.append({"error": f"{fn.__name__}{args}: {exc}", "t": time.time()})

        thread = threading.Thread(target=body, daemon=True)
        thread.start()
        self._restarts.append(thread)

    def _restart_island(self, name: str) -> None:
        self.cluster.start_islands([self._spec(name)])
        self.events.append({"restarted": name, "t": time.time()})

    def _restart_shard(self, i: int) -> None:
        self.cluster.start_shard(i)
        self.events.append({"restarted": f"shard-{i}", "t": time.time()})

    def _inject(self, fault: fl.Fault) -> bool:
        """Execute a harness fault now; returns whether it fired."""
        if fault.kind == "kill_shard":
            i = int(fault.target.split("-")[1])
            pid = self._pid(self.cluster.shard_dir(i))
            if pid is None:
                return False
            os.kill(pid, signal.SIGKILL)
            self._later(fault.duration_s, self._restart_shard, i)
            return True
        pid = self._pid(self.cluster.island_dir(fault.target))
        if pid is None:
            return False
        if fault.kind == "kill_island":
            os.kill(pid, signal.SIGKILL)
            self._later(fault.duration_s, self._restart_island, fault.target)
        else:
            os.kill(pid, signal.SIGSTOP)
            self._later(fault.duration_s, os.kill, pid, signal.SIGCONT)
        return True

    # -- the run ---------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Run it; returns the raw material for `summarize`."""
        s = self.setup
        self.cluster.write_relayed_cluster_file(
            self.out / "cluster.toml", server_settings(s), "127.0.0.1", self.relay_base, False
        )
        relay_stats = self.out / "relay.json"
        sampler = VersionSampler(
            [f"tcp://127.0.0.1:{self.bind_base + 2 * i}" for i in range(s.shards)]
        )
        fired: dict[str, bool] = {}
        final_status: list[dict[str, Any]] = []
        loss = None
        try:
            self.cluster.start_shards()
            self._start_relay(relay_stats)
            self.cluster.port = self.relay_base  # islands connect to shard 0 through the relay
            _log(f"{self.name}: starting {s.islands} islands")
            self.cluster.start_islands([self._spec(n) for n in self.islands])
            sampler.start()
            self.start_file.touch()
            self._wait_warm()  # the first round compiles the train step: not measured
            t0 = time.time()
            tmp = self.t0_file.with_suffix(".tmp")
            tmp.write_text(f"{t0:.6f}")
            os.replace(tmp, self.t0_file)
            _log(f"{self.name}: training {s.duration_s:g}s with {len(self.faults)} faults")
            pending = sorted(
                (f for f in self.faults if f.kind in fl.HARNESS_KINDS), key=lambda f: f.at_s
            )
            while (now := time.time() - t0) < s.duration_s:
                while pending and pending[0].at_s <= now:
                    fault = pending.pop(0)
                    fired[f"{fault.kind}@{fault.at_s}"] = self._inject(fault)
                    _log(f"{self.name}: t={now:.1f}s {fault.kind} {fault.target}")
                time.sleep(0.05)
            for thread in self._restarts:
                thread.join(180)
            stopped = time.time()
            self._stop_islands()
            sampler.stop_event.set()
            sampler.join(5)
            # the final eval waits until every acked delta is merged: status after it
            loss = self._final_loss()  # through the relay: the welcome lists its addresses
            final_status = self._final_status()
            self._stop_relay()
        finally:
            sampler.stop_event.set()
            self._stop_islands()
            self._stop_relay()
            self.cluster.stop()
        relay = json.loads(relay_stats.read_text()) if relay_stats.exists() else {}
        return {
            "t0": t0,
            "stopped": stopped,
            "fired_harness": fired,
            "events": self.events,
            "relay": relay,
            "status": final_status,
            "timeline": sampler.timeline(),
            "advances": {i: sampler.advances(i) for i in range(s.shards)},
            "rows": {n: self.cluster.island_metrics(n) for n in self.islands},
            "final_eval_loss": loss,
        }

    def _wait_warm(self, timeout_s: float = 240.0) -> None:
        """Wait until every island finished its first round (JIT compile included)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(
                any(r.get("round", 0) >= 1 for r in self.cluster.island_metrics(n))
                for n in self.islands
            ):
                return
            time.sleep(0.2)
        raise LaunchError(f"islands did not finish a first round within {timeout_s:g}s")

    def _stop_islands(self) -> None:
        threads = [
            threading.Thread(target=self.cluster.stop_island, args=(n, 60.0), daemon=True)
            for n in self.islands
            if n in self.cluster.islands
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)

    def _final_status(self) -> list[dict[str, Any]]:
        ctx = zmq.Context()
        try:
            out = []
            for i in range(self.setup.shards):
                router = f"tcp://127.0.0.1:{self.bind_base + 2 * i}"
                try:
                    out.append(probe.shard_status(ctx, router, timeout_s=10.0))
                except probe.ProbeError as exc:
                    out.append({"shard": i, "error": str(exc)})
            return out
        finally:
            ctx.destroy(linger=0)

    def _final_loss(self) -> float | None:
        """Held-out loss of the global model once every acked delta is merged (read from shards)."""
        s = self.setup
        flags = ("--model", s.model, "--batch-size", str(s.batch_size),
                 "--seq-len", str(s.seq_len), "--eval-batches", "16")  # fmt: skip
        final = self.cluster.final_eval(flags, connect=f"tcp://127.0.0.1:{self.bind_base}")
        if "error" in final:
            self.events.append({"error": f"final eval: {final['error']}"})
            return None
        return float(final["eval_loss"])


def run(args: argparse.Namespace) -> int:
    """Run `diloco-bench chaos`; prints the JSON report; 0 when nothing acked was lost."""
    duration = args.duration or (20.0 if args.quick else 90.0)
    setup = Setup(islands=args.islands, shards=args.shards, duration_s=duration)
    kinds = [k for k in args.kinds.split(",") if k]
    islands = [f"island-{i}" for i in range(setup.islands)]
    try:
        schedule = fl.make_schedule(
            args.seed, args.faults, duration, islands, setup.shards, kinds, settle_s=3.0
        )
    except ValueError as exc:
        print(f"diloco-bench chaos: {exc}", file=sys.stderr)
        return 2
    out = outdir.claim(Path(args.out), "chaos")
    try:
        raw_free = ChaosRun("fault_free", setup, [], args.seed, out).run()
        raw_chaos = ChaosRun("faulted", setup, schedule, args.seed, out).run()
    except (LaunchError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"diloco-bench chaos: {exc}", file=sys.stderr)
        return 1
    for name, raw in (("fault_free", raw_free), ("faulted", raw_chaos)):
        (out / name / "raw.json").write_text(json.dumps(raw, default=str))
    window = chaos_score.round_window(raw_free["rows"])
    free = chaos_score.summarize(raw_free, [], setup, window)
    chaos = chaos_score.summarize(raw_chaos, schedule, setup, window)
    loss_ratio = (
        chaos["final_eval_loss"] / free["final_eval_loss"]
        if chaos["final_eval_loss"] and free["final_eval_loss"]
        else None
    )
    report = {
        "seed": args.seed,
        "quick": bool(args.quick),
        "setup": setup.__dict__,
        "uptime_window_s": window,
        "schedule": [f.to_json() for f in schedule],
        "runs": {"fault_free": free, "faulted": chaos},
        "final_loss_ratio": loss_ratio,
        "targets": {
            "uptime_1_with_island_faults": chaos["uptime_outside_shard_outages"],
            "acked_equals_applied": free["acked_equals_applied"] and chaos["acked_equals_applied"],
            "goodput_at_least_0.9": (chaos["goodput"] or 0) >= 0.9,
            "final_loss_within_1pct": loss_ratio is not None and loss_ratio <= 1.01,
        },
    }
    (out / "chaos.json").write_text(json.dumps(report, indent=2))
    emit_json(report)
    return 0 if report["targets"]["acked_equals_applied"] else 1
