"""Chaos run: training under a seeded fault schedule next to a fault-free run with the same seed.

    diloco-bench chaos --faults N --seed S [--quick] [--duration 90] [--faulted-only] --out DIR

Each run is real daemons: shards started one by one from a cluster file
(`diloco-server start --cluster F --shard I --detach`, so one can be killed
and restarted alone), a chaos relay (`bench.children.chaos_relay`) in front of every
shard ROUTER, and `diloco-worker` islands. The schedule (`bench.faults`) is
executed by this harness (kill -9 / restart an island or a shard, SIGSTOP /
SIGCONT an island) and by the relay (cut or slow an island's link; drop,
duplicate, delay or corrupt its pushes and acks). Both runs train for the
same wall time; the fault-free run uses the same seed and an empty schedule.
`--faulted-only` runs the faulted run alone (a soak, in half the time): the
figures that compare the two runs are then null.

Reported per run (JSON on stdout and in DIR/chaos.json; `bench.chaos_score`
computes it): `goodput` (the share of the islands' time spent on inner steps
whose work entered the model: the tokens the shards credit after the final
merges, staleness not counted, less what was trained before the window / what
the islands would have trained from the window's start to their stop at their
own pace, tokens per second over their rounds clear of the faults; kills,
pauses, back-pressure and rejected work are lost), `lost_island_s` (where the
rest went: per fault and kind, outside the faults, trained but not credited),
`uptime` (our step uptime, `bench.analysis.step_uptime`: the share of the
window in which no fragment stood still past its due step, the arrival of
the quorum's next delta at its shard plus two typical rounds; reads 1 without
faults however uneven the rounds), `uptime_outside_shard_outages` (the same, leaving out each shard's
outage, from its kill to its first step after the restart: the uptime the
island and link faults leave), `uptime_windowed` (the earlier figure: share of
fixed windows of two fault-free median rounds in which some version advanced),
`deltas_acked` (unique keys the shards acked, seen by the relay),
`deltas_applied` (the shards' durable accepted count: merged or pending),
`final_eval_loss` (held-out loss of the final global parameters), recovery
time per fault, the faults that fired, and `soak` (`bench.soak`: each shard's
and island's RSS slope in MB per 10 minutes after the first 10 minutes, and
whether each shard's log segments and checkpoints stay bounded, from
`bench.chaos_samplers`). A progress line every 30 s; at the end a text table
of the soak figures on stderr. Exit 1 if acked != applied.

(About 450 lines: the harness's fault injection and its two runs share the
`ChaosRun` state; the pollers are in `bench.chaos_samplers`, the scoring in
`bench.chaos_score` and `bench.soak`.)
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

from bench import chaos_score, child, outdir, soak
from bench import faults as fl
from bench.chaos_samplers import ResourceSampler, VersionSampler
from bench.common import emit_json
from bench.launcher import IslandSpec, LaunchError, LocalCluster, free_base_port
from paramserver.plumbing import daemon, probe

PROGRESS_S = 30.0  # a progress line this often while a run trains
WARM_ROUNDS = 5  # rounds every island ends after the shards' first steps, before the window


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
    # The islands' buffer of unacked deltas, sized to this bench's time scale: its rounds
    # last ~0.3 s, so the default 16 (4 rounds of 4 fragments) runs out 1.2 s into a
    # shard's outage (detected after 5 beats = 2.5 s, restarted after 4 s) and the island
    # stops training; 64 is 16 rounds, ~5 s. A deployment sizes it to its own outages in
    # rounds: 16 deltas there are 4 rounds of minutes each.
    max_unacked: int = 64


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
    parser.add_argument(
        "--faulted-only", action="store_true",
        help="run only the faulted run, without the fault-free one (a soak: its memory "
        "slopes and directory sizes, in half the time; no loss ratio or fault-free goodput)",
    )  # fmt: skip
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
        self._spawned: list[subprocess.Popen] = []  # restarted daemons: reaped at the end
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
                "--max-unacked", str(s.max_unacked),
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

    def _respawn(self, argv: list[str], directory: Path, name: str) -> None:
        """Start a killed daemon again as a supervisor would: its foreground command, in
        the background (`daemon.spawn`), without the `--detach` parent, whose own imports
        (~2 s, more under load) would count as the daemon's restart time."""
        self._spawned.append(
            daemon.spawn(
                [a for a in argv if a != "--detach"],
                daemon.log_path(directory),
                directory / "ready.json",
            )
        )
        self.events.append({"restarted": name, "t": time.time()})

    def _restart_island(self, name: str) -> None:
        self._respawn(
            self.cluster.island_argv(self._spec(name)), self.cluster.island_dir(name), name
        )

    def _restart_shard(self, i: int) -> None:
        argv = [sys.executable, "-m", "paramserver.server.cli", "start",
                "--cluster", str(self.cluster.cluster_file), "--shard", str(i)]  # fmt: skip
        self._respawn(argv, self.cluster.shard_dir(i), f"shard-{i}")

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
        settings = server_settings(s)
        self.cluster.write_relayed_cluster_file(
            self.out / "cluster.toml", settings, "127.0.0.1", self.relay_base, False
        )
        relay_stats = self.out / "relay.json"
        sampler = VersionSampler(
            [f"tcp://127.0.0.1:{self.bind_base + 2 * i}" for i in range(s.shards)]
        )
        shard_dirs = {f"shard-{i}": self.cluster.shard_dir(i) for i in range(s.shards)}
        resources = ResourceSampler(
            lambda: {**shard_dirs, **{n: self.cluster.island_dir(n) for n in self.islands}},
            shard_dirs,
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
            resources.start()
            self.start_file.touch()
            self._wait_warm(sampler)  # compiles and first steps: not measured
            t0 = time.time()
            tmp = self.t0_file.with_suffix(".tmp")
            tmp.write_text(f"{t0:.6f}")
            os.replace(tmp, self.t0_file)
            _log(f"{self.name}: training {s.duration_s:g}s with {len(self.faults)} faults")
            pending = sorted(
                (f for f in self.faults if f.kind in fl.HARNESS_KINDS), key=lambda f: f.at_s
            )
            next_progress = PROGRESS_S
            while (now := time.time() - t0) < s.duration_s:
                while pending and pending[0].at_s <= now:
                    fault = pending.pop(0)
                    fired[f"{fault.kind}@{fault.at_s}"] = self._inject(fault)
                    _log(f"{self.name}: t={now:.1f}s {fault.kind} {fault.target}")
                if now >= next_progress:
                    next_progress += PROGRESS_S
                    self._progress(now, sampler, resources)
                time.sleep(0.05)
            for thread in self._restarts:
                thread.join(180)
            stopped = time.time()
            self._stop_islands()
            for poller in (sampler, resources):
                poller.stop_event.set()
                poller.join(10)
            # the final eval waits until every acked delta is merged: status after it
            loss = self._final_loss()  # through the relay: the welcome lists its addresses
            final_status = self._final_status()
            self._stop_relay()
        finally:
            sampler.stop_event.set()
            resources.stop_event.set()
            self._stop_islands()
            self._stop_relay()
            self.cluster.stop()
            for proc in self._spawned:  # stopped through their pid files above: reap them
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
        relay = json.loads(relay_stats.read_text()) if relay_stats.exists() else {}
        return {
            "t0": t0,
            "stopped": stopped,
            "settings": settings,
            "fired_harness": fired,
            "events": self.events,
            "relay": relay,
            "status": final_status,
            "timeline": sampler.timeline(),
            "fragments": sampler.fragments(),
            "advances": {i: sampler.advances(i) for i in range(s.shards)},
            "rows": {n: self.cluster.island_metrics(n) for n in self.islands},
            "resources": resources.raw(),
            "final_eval_loss": loss,
        }

    def _progress(self, now: float, sampler: VersionSampler, resources: ResourceSampler) -> None:
        """One progress line: time, faults so far, the model's version, each daemon's RSS."""
        done = sum(1 for f in self.faults if f.at_s <= now)
        timeline = sampler.timeline()
        version = timeline[-1][1] if timeline else 0
        rss = " ".join(f"{n}={mb:g}MB" for n, mb in sorted(resources.latest_mb().items()))
        _log(
            f"{self.name}: t={now:.0f}/{self.setup.duration_s:g}s faults {done}/"
            f"{len(self.faults)} version sum {version} rss {rss}"
        )

    def _wait_warm(self, sampler: VersionSampler, timeout_s: float = 240.0) -> None:
        """Wait until the cluster is warm: not measured.

        Every island's first round compiles its train step; the shards compile
        their step at their first one and the islands their fold and exchange
        at the first update: rounds of the first seconds after that took up to
        20x the usual time. So: every island finished a round, every fragment
        stepped twice, then every island ended WARM_ROUNDS more rounds.
        """
        deadline = time.monotonic() + timeout_s

        def rounds() -> dict[str, int]:
            return {
                n: max((r.get("round", 0) for r in self.cluster.island_metrics(n)), default=0)
                for n in self.islands
            }

        def stepped() -> bool:
            parts = sampler.fragments()
            return bool(parts) and all(
                max((v for _t, v in p if v is not None), default=0) >= 2 for p in parts.values()
            )

        def wait(what: str, ready) -> None:
            while not ready():
                if time.monotonic() > deadline:
                    raise LaunchError(f"{what} within {timeout_s:g}s")
                time.sleep(0.2)

        wait("islands did not finish a first round", lambda: min(rounds().values()) >= 1)
        wait("fragments did not step twice", stepped)
        then = rounds()
        wait(
            "islands stopped ending rounds",
            lambda: all(r >= then[n] + WARM_ROUNDS for n, r in rounds().items()),
        )

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
        raw_free = None
        if not args.faulted_only:
            raw_free = ChaosRun("fault_free", setup, [], args.seed, out).run()
        raw_chaos = ChaosRun("faulted", setup, schedule, args.seed, out).run()
    except (LaunchError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"diloco-bench chaos: {exc}", file=sys.stderr)
        return 1
    for name, raw in (("fault_free", raw_free), ("faulted", raw_chaos)):
        if raw is not None:
            (out / name / "raw.json").write_text(json.dumps(raw, default=str))
    report = chaos_score.report(raw_free, raw_chaos, schedule, setup)
    report.update(seed=args.seed, quick=bool(args.quick), faulted_only=bool(args.faulted_only))
    (out / "chaos.json").write_text(json.dumps(report, indent=2))
    _log("soak figures (RSS per daemon, shard directories):\n" + soak.soak_table(report["runs"]))
    emit_json(report)
    return 0 if report["targets"]["acked_equals_applied"] else 1
