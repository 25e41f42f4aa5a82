"""Execute one scenario of the report with real processes on real (shaped) links.

DiLoCo runs: shards started one by one from a cluster file (they bind on
loopback and advertise the relay's address on the hub, so every island <->
shard byte crosses the island's shaped link), islands as `diloco-worker`
daemons inside their namespaces. The run ends when the islands together have
trained the budget's tokens (or at the wall-clock cap); meanwhile the shards'
versions are polled for the uptime timeline.

DDP runs: `bench.children.ddp_reducer` on loopback (through the relay on the WAN) and
one `bench.children.ddp_rank` rank per island, each doing the same steps as one island.

`run_scenario` returns the run's JSON record (computed with `bench.analysis`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import child, run_record
from bench.launcher import IslandSpec, LaunchError, LocalCluster, free_base_port
from bench.scenarios import Budget, Scenario
from bench.wan import Wan
from paramserver.plumbing import daemon, probe
from paramserver.plumbing.exposure import is_loopback
from worker import island_files

POLL_S = 0.5
Progress = Callable[[int, str], None]


def island_names(count: int) -> list[str]:
    """Names of the islands (and DDP ranks): the same data shards for every method.

    Args:
        count: number of islands.

    Returns:
        ["island-0", ...].
    """
    return [f"island-{i}" for i in range(count)]


def common_flags(budget: Budget, index: int) -> list[str]:
    """Flags every island and DDP rank gets: model, data shard, batch, eval, seed.

    Args:
        budget: shared settings.
        index: the island's index (its data shard).

    Returns:
        argv fragment.
    """
    return [
        "--model", budget.model, "--inner-steps", str(budget.inner_steps),
        "--batch-size", str(budget.batch_size), "--seq-len", str(budget.seq_len),
        "--eval-batches", str(budget.eval_batches), "--eval-every", "1",
        "--data-shard", str(index), "--seed", str(budget.seed),
        # one core per island when there are enough; otherwise let the OS share them evenly
        "--cpu", str(index if budget.islands <= (os.cpu_count() or 1) else -1),
    ]  # fmt: skip


def server_settings(scenario: Scenario, budget: Budget) -> dict[str, Any]:
    """The `[server]` settings of a scenario's cluster file.

    Args:
        scenario: the run (mode, quorum, grace rule, merge, weighting, codec).
        budget: shared settings (islands).

    Returns:
        Settings for `LocalCluster.write_relayed_cluster_file`.
    """
    return {
        "mode": scenario.method,
        "quorum": scenario.quorum_of(budget.islands),
        "inner_steps": budget.inner_steps,  # the islands' H: picks the default outer lr
        "grace_rule": scenario.grace_rule,
        "merge": scenario.merge,
        "weighting": scenario.weighting,
        "downlink": scenario.downlink,
        "fsync": False,
        "checkpoint_every_steps": 0,
        "checkpoint_every_s": 0.0,
    }


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _version_sum(status: dict[str, Any]) -> int | None:
    shards = status.get("shards", [])
    if not shards or any("error" in s for s in shards):
        return None
    return sum(int(v) for s in shards for v in s.get("versions", {}).values())


def run_diloco(
    scenario: Scenario, budget: Budget, wan: Wan | None, out: Path, progress: Progress
) -> dict[str, Any]:
    """One DiLoCo run (sync or quorum) until the token budget is trained.

    Args:
        scenario: the run.
        budget: shared settings.
        wan: the shaped links (None: plain loopback).
        out: this run's directory.
        progress: called with (cluster tokens so far, note).

    Returns:
        Raw material for `bench.run_record.summarize`: rows per island, timeline, stop time, server status.
    """
    hub = wan.hub if wan is not None else "127.0.0.1"
    cluster = LocalCluster(out, shards=budget.shards)
    bind_port = cluster.port
    relay_port = free_base_port(2 * budget.shards, "127.0.0.1") if wan is not None else bind_port
    cluster.write_relayed_cluster_file(
        out / "cluster.toml", server_settings(scenario, budget), hub, relay_port, relay_pub=True
    )
    targets = {relay_port + k: bind_port + k for k in range(2 * budget.shards)}
    relay = wan.relay(targets) if wan is not None else contextlib.nullcontext()
    names = island_names(budget.islands)
    # islands connect to shard 0's advertised router (the relay on the WAN)
    cluster.host, cluster.port = hub, relay_port
    timeline: list[tuple[float, int]] = []
    server: dict[str, Any] = {}
    final: dict[str, Any] = {}
    with relay:
        try:
            cluster.start_shards()
            progress(0, "starting islands")
            start_file = out / "start"
            # homogeneous islands train exactly their share; otherwise stop at the cluster budget
            homogeneous = all(sj == (1.0, 0.0) for sj in scenario.speeds(budget.islands))
            max_rounds = budget.steps_per_island // budget.inner_steps if homogeneous else 0
            specs = [
                IslandSpec(
                    name,
                    speed,
                    (
                        *common_flags(budget, i),
                        *("--codec", scenario.codec, "--jitter", str(jitter)),
                        *(
                            ("--topk-density", str(scenario.topk_density))
                            if scenario.topk_density
                            else ()
                        ),
                        *("--merge-rule", scenario.merge_rule),
                        *(
                            ("--overlap-rounds", str(scenario.overlap_rounds))
                            if scenario.overlap_rounds is not None
                            else ()
                        ),
                        *("--flush-timeout-s", "5", "--start-file", str(start_file)),
                        *("--max-rounds", str(max_rounds)),
                    ),
                    wan.prefix(i) if wan is not None else (),
                )
                for i, (name, (speed, jitter)) in enumerate(
                    zip(names, scenario.speeds(budget.islands), strict=True)
                )
            ]
            cluster.start_islands(specs)
            start_file.touch()  # every island has joined: start together
            started = time.monotonic()
            cap = scenario.wall_cap_s or budget.wall_cap_s
            last_probe = 0.0
            loopback = f"tcp://127.0.0.1:{bind_port}"
            while True:
                states = [cluster.island_status(n) for n in names]
                tokens = sum(st.get("tokens", 0) for st in states)
                progress(tokens, "training")
                if tokens >= budget.tokens or time.monotonic() - started > cap:
                    break
                if all(st.get("state") == "stopped" for st in states):
                    break
                if time.monotonic() - last_probe >= 1.0:
                    last_probe = time.monotonic()
                    with contextlib.suppress(probe.ProbeError):
                        total = _version_sum(probe.cluster_status(loopback, timeout_s=2.0))
                        if total is not None:
                            timeline.append((time.time(), total))
                time.sleep(POLL_S)
            stopped_at = time.time()
            pids = [
                p for n in names if (p := daemon.running_pid(daemon.pid_path(cluster.islands[n])))
            ]
            _signal_all(pids, signal.SIGTERM)
            progress(tokens, "stopping islands")
            for pid in pids:
                daemon.wait_exit(pid, 60.0)
            # every island flushed and left: the shards merge what is pending, then the
            # final eval reads the global model from them (DDP: rank 0's final parameters)
            progress(tokens, "final eval")
            final = cluster.final_eval(common_flags(budget, 0), connect=loopback)
            server = final.pop("server", {})
            if (total := _version_sum(server)) is not None:
                timeline.append((time.time(), total))
        finally:
            cluster.stop()
    return {
        "rows": {n: cluster.island_metrics(n) for n in names},
        "timeline": timeline,
        "stopped_at": stopped_at,
        "server": server,
        "final_eval": final,
    }


def run_ddp(
    scenario: Scenario, budget: Budget, wan: Wan | None, out: Path, progress: Progress
) -> dict[str, Any]:
    """One DDP run: reducer plus one rank per island, the same steps per rank as per island.

    Args:
        scenario: the run (wall_cap_s bounds the WAN run).
        budget: shared settings.
        wan: the shaped links (None: plain loopback).
        out: this run's directory.
        progress: called with (cluster tokens so far, note).

    Returns:
        Raw material for `bench.run_record.summarize`.
    """
    out.mkdir(parents=True, exist_ok=True)
    names = island_names(budget.islands)
    bind_port = free_base_port(2, "127.0.0.1")
    hub = wan.hub if wan is not None else "127.0.0.1"
    connect_port = bind_port + 1 if wan is not None else bind_port
    reducer_argv = child.module_argv("bench.children.ddp_reducer", "--bind",
                                     f"tcp://127.0.0.1:{bind_port}", "--world", str(budget.islands))  # fmt: skip
    ranks: list[child.Child] = []
    relay = wan.relay({bind_port + 1: bind_port}) if wan is not None else contextlib.nullcontext()
    try:
        with child.running(reducer_argv, "ddp reducer", grace_s=10.0), relay:
            progress(0, "starting ranks")
            per_step = ("--inner-steps", "1", "--max-rounds", str(budget.steps_per_island),
                        "--eval-every", str(budget.inner_steps))  # fmt: skip
            for i, name in enumerate(names):
                data_dir = out / "islands" / name
                data_dir.mkdir(parents=True, exist_ok=True)
                argv = [
                    *(wan.prefix(i) if wan is not None else ()), sys.executable, "-m",
                    "bench.children.ddp_rank", "--rank", str(i), "--world", str(budget.islands),
                    "--island", name, "--connect", f"tcp://{hub}:{connect_port}",
                    # the WAN hub is a bridge address, not loopback: the emulated trusted network
                    *(() if is_loopback(hub) else ("--insecure",)),
                    "--data-dir", str(data_dir), "--cpu", str(i),
                    "--max-rounds", str(budget.steps_per_island // budget.inner_steps),
                    *common_flags(budget, i),
                    # on the WAN a step takes seconds: one row per step, eval every H steps
                    *(per_step if wan is not None else ()),
                ]  # fmt: skip
                ranks.append(child.start(argv, f"ddp rank {i}", ready_timeout_s=None))
            cap = scenario.wall_cap_s or budget.wall_cap_s
            started = None
            while any(r.proc.poll() is None for r in ranks):
                rows = [island_files.read_rows(out / "islands" / n) for n in names]
                tokens = sum(rs[-1].get("tokens", 0) for rs in rows if rs)
                progress(tokens, "training")
                if started is None and any(r.get("round", 0) >= 1 for r in rows[0]):
                    started = time.monotonic()  # the cap counts from the first step (compiled)
                if started is not None and time.monotonic() - started > cap:
                    break
                time.sleep(POLL_S)
            stopped_at = time.time()
            stop_ranks(ranks, 30.0)
    finally:
        for r in ranks:
            r.stop(0.0)  # what an error left running is killed
    return {
        "rows": {n: island_files.read_rows(out / "islands" / n) for n in names},
        "timeline": [],
        "stopped_at": stopped_at,
        "server": {},
    }


def run_scenario(
    scenario: Scenario, budget: Budget, wan: Wan | None, out: Path, progress: Progress
) -> dict[str, Any]:
    """Run one scenario and write ``<out>/<name>.json``.

    Args:
        scenario: the run.
        budget: shared settings.
        wan: the shaped links (used when `scenario.wan`).
        out: the report's runs directory.
        progress: called with (cluster tokens so far, note).

    Returns:
        The run's JSON record.
    """
    link = wan if scenario.wan else None
    budget = scenario.budget_of(budget)
    run = run_ddp if scenario.method == "ddp" else run_diloco
    raw = run(scenario, budget, link, out / scenario.name, progress)
    record = run_record.summarize(scenario, budget, raw)
    record["link"] = link.describe() if link is not None else {"shaping": "none (loopback)"}
    record["inner_steps"], record["steps_per_island"] = budget.inner_steps, budget.steps_per_island
    (out / f"{scenario.name}.json").write_text(json.dumps(record, indent=2))
    return record


def stop_ranks(ranks: list, wait_s: float) -> None:
    """SIGTERM every DDP rank, wait for each, and fail on one that did not end cleanly.

    Args:
        ranks: the ranks' child processes (`bench.child` handles).
        wait_s: how long each may take before it is killed.

    Raises:
        LaunchError: a rank exited with another code than 0 or -SIGTERM.
    """
    for r in ranks:
        r.terminate()
    codes = [r.wait_or_kill(wait_s) for r in ranks]
    failed = [r for r, code in zip(ranks, codes, strict=True) if code not in (0, -signal.SIGTERM)]
    if failed:
        raise LaunchError(f"ddp rank failed: {failed[0].error_tail() or failed[0].proc.returncode}")
