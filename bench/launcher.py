"""Start and stop a local cluster of real daemons: `diloco-server` shards and `diloco-worker` islands.

Used by the demo and the benchmark harness. Every daemon is a separate process
started through its own CLI with `--detach`, so what runs here is exactly what a
user runs; this module only picks ports, lays out data directories and makes
sure everything it started is stopped again. The harnesses' own helper
processes (relays, the meter, DDP ranks) start and stop through `bench.child`;
the islands' progress files are read through `worker.island_files`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import child
from bench.child import LaunchError, PortTaken
from paramserver.ops import supervisor
from paramserver.ops.cli import EXIT_PORT_IN_USE
from paramserver.plumbing import daemon, ports, probe
from paramserver.plumbing.clusterfile import ShardAddress, render_cluster_file
from paramserver.plumbing.exposure import is_loopback
from worker import island_files


def free_base_port(count: int, host: str = "127.0.0.1") -> int:
    """A base port P such that P .. P+count-1 are all free on `host` right now.

    Picked below the kernel's ephemeral range (`paramserver.plumbing.ports`), so no
    outgoing connection takes one before the process started next binds it.

    Args:
        count: number of consecutive ports needed.
        host: address to probe.

    Returns:
        The base port.

    Raises:
        LaunchError: no such ports were found.
    """
    try:
        return ports.free_base_port(count, host)
    except ports.NoFreePorts as exc:
        raise LaunchError(str(exc)) from None


@dataclasses.dataclass(frozen=True)
class IslandSpec:
    """One island of a local cluster."""

    name: str
    speed: float = 1.0
    extra: tuple[str, ...] = ()  # further diloco-worker flags, e.g. ("--codec", "int4")
    prefix: tuple[str, ...] = ()  # argv prefix, e.g. ("ip", "netns", "exec", NS) (bench.wan)


def _kill_leftovers(pids: Sequence[int], grace_s: float) -> None:
    """Kill (-9) those of `pids` still running `grace_s` after they were told to stop, and
    wait (up to `grace_s` each) until they are gone."""
    deadline = time.monotonic() + grace_s
    alive = [p for p in pids if not daemon.wait_exit(p, max(0.0, deadline - time.monotonic()))]
    if alive:
        print(f"bench: daemons {alive} outlived their stop; killing them (-9)", file=sys.stderr)
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in alive:  # a SIGKILL lands asynchronously: return once they are gone
        daemon.wait_exit(pid, grace_s)


def _run(argv: Sequence[str], what: str, timeout_s: float) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        error = PortTaken if proc.returncode == EXIT_PORT_IN_USE else LaunchError
        raise error(f"{what} failed (exit {proc.returncode}): {tail[-1] if tail else ''}")
    return proc.stdout


class LocalCluster:
    """A parameter server (N shards) and islands on this machine, as real daemons.

    Use as a context manager: leaving it stops every island and the server.
    """

    def __init__(
        self,
        out_dir: str | Path,
        shards: int = 2,
        server_args: Sequence[str] = (),
        host: str = "127.0.0.1",
    ) -> None:
        """Lay out the cluster; nothing starts before `start_server`.

        Args:
            out_dir: parent of every daemon's data dir (server/, islands/NAME/).
            shards: number of shard processes.
            server_args: further diloco-server start flags (e.g. ("--mode", "async")).
            host: loopback address the shards bind.
        """
        self.out_dir = Path(out_dir)
        self.shards = shards
        self.server_args = tuple(server_args)
        self.host = host
        self.port = free_base_port(2 * shards, host)
        self.server_dir = self.out_dir / "server"
        self.islands: dict[str, Path] = {}
        self.island_cpus: dict[str, int] = {}  # the core each island is pinned to, for good
        self.cluster_file: Path | None = None

    @property
    def connect(self) -> str:
        """Endpoint of shard 0's ROUTER."""
        return f"tcp://{self.host}:{self.port}"

    def island_dir(self, name: str) -> Path:
        """The data dir of island `name`."""
        return self.out_dir / "islands" / name

    def start_server(self, timeout_s: float = 120.0) -> None:
        """Start every shard (detached) and return once they serve.

        The ports were picked free in `__init__`; one taken since (the server refuses
        it before starting anything) is picked again, twice at most, before any island
        has been told the old ones.
        """
        for attempt in range(3):
            try:
                _run(
                    [
                        sys.executable, "-m", "paramserver.server.cli", "start",
                        "--shards", str(self.shards), "--host", self.host,
                        "--port", str(self.port), "--data-dir", str(self.server_dir),
                        "--detach", *self.server_args,
                    ],
                    "diloco-server start",
                    timeout_s,
                )  # fmt: skip
                return
            except PortTaken:
                if attempt == 2 or self.islands:
                    raise
                self.port = free_base_port(2 * self.shards, self.host)

    def shard_dir(self, index: int) -> Path:
        """The data dir of shard `index`."""
        return daemon.shard_dir(self.server_dir, index)

    def write_relayed_cluster_file(
        self, path: Path, server: Mapping[str, Any], hub: str, relay_port: int, relay_pub: bool
    ) -> Path:
        """A cluster file whose shards bind on loopback and are reached through a relay.

        Shard i binds ROUTER `port + 2i` and PUB `port + 2i + 1` on 127.0.0.1. Islands
        reach its ROUTER at `hub:relay_port + 2i` (with `relay_pub`, its PUB at
        `hub:relay_port + 2i + 1`) or `hub:relay_port + i` (without: the PUB directly).

        Args:
            path: the file to write.
            server: the `[server]` settings (mode, quorum, ...); data_dir is added.
            hub: the address islands connect to.
            relay_port: the relay's first listen port.
            relay_pub: whether the PUB sockets are relayed too.

        Returns:
            `path`.
        """
        step = 2 if relay_pub else 1
        shards = [
            ShardAddress(
                router=f"tcp://{hub}:{relay_port + step * i}",
                pub=f"tcp://{hub}:{relay_port + 2 * i + 1}"
                if relay_pub
                else f"tcp://127.0.0.1:{self.port + 2 * i + 1}",
                router_bind=f"tcp://127.0.0.1:{self.port + 2 * i}",
                pub_bind=f"tcp://127.0.0.1:{self.port + 2 * i + 1}",
            )
            for i in range(self.shards)
        ]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render_cluster_file({**server, "data_dir": str(self.server_dir)}, shards))
        self.cluster_file = path
        return path

    def start_shard(self, index: int, timeout_s: float = 180.0) -> None:
        """Start (or restart) one shard of the cluster file, detached.

        Args:
            index: shard index.
            timeout_s: bound on the start.
        """
        if self.cluster_file is None:
            raise LaunchError("start_shard needs write_relayed_cluster_file first")
        _run([sys.executable, "-m", "paramserver.server.cli", "start", "--cluster",
              str(self.cluster_file), "--shard", str(index), "--detach"],
             f"diloco-server start --shard {index}", timeout_s)  # fmt: skip

    def start_shards(self, timeout_s: float = 180.0) -> None:
        """Start every shard of the cluster file at once (each pays its own JAX import).

        Args:
            timeout_s: bound on each shard's start.
        """
        errors: list[Exception] = []

        def start(index: int) -> None:
            try:
                self.start_shard(index, timeout_s)
            except (LaunchError, subprocess.TimeoutExpired) as exc:
                errors.append(exc)

        threads = [threading.Thread(target=start, args=(i,)) for i in range(self.shards)]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():  # a join that wakes: a Ctrl-C that lands on another thread
                t.join(0.2)  # is handled in the main thread only when it runs again
        if errors:  # the first, its type kept (a PortTaken may be retried on other ports)
            first = errors[0]
            raise first if isinstance(first, LaunchError) else LaunchError(str(first))

    def start_islands(self, specs: Sequence[IslandSpec], timeout_s: float = 300.0) -> None:
        """Start islands (detached) in parallel and return once each has joined.

        All start at once: the shards take the first `init` and the others join the
        cluster it made (an init race is part of the protocol), so no island waits
        for another's JAX import and compile.

        Args:
            specs: the islands.
            timeout_s: bound on the whole start.
        """
        started = [
            child.start(self.island_argv(spec), f"island {spec.name}", ready_timeout_s=None)
            for spec in specs
        ]
        for item in started:
            self._wait_started(item, timeout_s)

    def island_argv(self, spec: IslandSpec) -> list[str]:
        """The `diloco-worker start --detach` command of an island (and its data dir's record).

        An island keeps the core it was first given across restarts: a restarted
        island pinned to another island's core would halve both.

        Args:
            spec: the island.

        Returns:
            argv; `--cpu` is the island's own core (the n-th island started: core n).
        """
        data_dir = self.island_dir(spec.name)
        self.islands[spec.name] = data_dir
        cpu = self.island_cpus.setdefault(spec.name, len(self.island_cpus))
        return [
            *spec.prefix, sys.executable, "-m", "worker.cli", "start", "--detach",
            "--connect", self.connect, "--island", spec.name,
            "--speed", str(spec.speed), "--data-dir", str(data_dir),
            "--cpu", str(cpu), *spec.extra,
            # the WAN emulation's hub (a bridge on this machine) is not loopback: its plain
            # TCP is the emulated trusted network, so the islands say --insecure there
            *(() if is_loopback(self.host) else ("--insecure",)),
        ]  # fmt: skip

    @staticmethod
    def _wait_started(started: child.Child, timeout_s: float) -> None:
        """Wait for a `diloco-worker start --detach` to return (its island has joined)."""
        try:
            started.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            started.stop(5.0)
            raise LaunchError(f"{started.what} did not start within {timeout_s:g}s") from exc
        if started.proc.returncode != 0:
            raise LaunchError(f"{started.what} failed to start: {started.error_tail()}")

    def stop_island(self, name: str, timeout_s: float = 60.0) -> None:
        """SIGTERM one island and wait for it to flush and exit."""
        with contextlib.suppress(daemon.DaemonError):
            daemon.stop(self.islands[name], timeout_s=timeout_s)

    def island_status(self, name: str) -> dict[str, Any]:
        """The island's latest status.json (empty before it wrote one)."""
        return island_files.read_status(self.islands[name]) or {}

    def island_metrics(self, name: str) -> list[dict[str, Any]]:
        """Every per-round metrics row the island wrote."""
        return island_files.read_rows(self.islands[name])

    def server_status(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """Status of every shard, as `diloco-server status --json` shows it ({} if none answers)."""
        try:
            return probe.cluster_status(self.connect, timeout_s=timeout_s)
        except probe.ProbeError:
            return {}

    def final_eval(
        self,
        model_flags: Sequence[str] = (),
        connect: str | None = None,
        wait_s: float = 120.0,
    ) -> dict[str, Any]:
        """The run's final eval: the global model once every acked delta is merged.

        Call it after the islands stopped (flushed and said bye, so nothing
        holds a step back). Runs `diloco-worker eval` (JAX stays out of this
        process), which waits until no shard has a pending delta, reads every
        fragment's snapshot and evaluates it once on the common held-out set.

        Args:
            model_flags: island flags that fix the model and the held-out set
                (--model, --batch-size, --seq-len, --eval-batches, --data ...).
            connect: a shard's ROUTER reachable from here (default: shard 0).
            wait_s: bound on waiting for the merges.

        Returns:
            {"eval_loss", "versions", "version_sum", "pending": 0, "server": the
            cluster status after the merges}, or {"error": message}.
        """
        connect = connect or self.connect
        argv = [sys.executable, "-m", "worker.cli", "eval", "--connect", connect, "--json",
                "--wait-s", str(wait_s), *model_flags]  # fmt: skip
        try:
            result = json.loads(_run(argv, "diloco-worker eval", wait_s + 180.0))
        except (LaunchError, ValueError, subprocess.TimeoutExpired) as exc:
            return {"error": str(exc)}
        try:
            result["server"] = probe.cluster_status(connect, timeout_s=10.0)
        except probe.ProbeError as exc:
            result["server"] = {"error": str(exc)}
        return result

    def _server_pids(self) -> list[int]:
        """The supervisor's and its shards' pids, from its ready file ([] before it served)."""
        try:
            info = json.loads((self.server_dir / supervisor.READY_FILE).read_text())
            return [int(info["pid"]), *map(int, info.get("shard_pids", []))]
        except (OSError, ValueError, KeyError, TypeError):
            return []

    def stop(self) -> None:
        """Stop every island, then the server; never raises for what already stopped.

        Whatever of the server it started outlives `diloco-server stop` (a stop that
        failed, one line on stderr says why) is killed: the bench leaves no daemon.
        """
        for name in list(self.islands):
            self.stop_island(name)
        for index in range(self.shards if self.cluster_file else 0):  # started one by one
            with contextlib.suppress(daemon.DaemonError):
                daemon.stop(self.shard_dir(index), timeout_s=60.0)
        started = self._server_pids()
        try:
            _run(
                [
                    sys.executable,
                    "-m",
                    "paramserver.server.cli",
                    "stop",
                    "--data-dir",
                    str(self.server_dir),
                ],
                "diloco-server stop",
                120.0,
            )
        except (LaunchError, subprocess.TimeoutExpired) as exc:
            if started:
                print(f"bench: {exc}", file=sys.stderr)
        _kill_leftovers(started, grace_s=10.0)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
