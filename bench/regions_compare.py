"""The regions comparison: DDP, synchronous DiLoCo and this system trained over the same emulated WAN.

    diloco-bench regions --methods ddp,sync,quorum [--quick] [--target-loss L]
                         [--big-step-s 1.0] [--run-step-s 0.06] [--steps 30] [--inner-steps 10]

Every method runs in the built, probed topology (`bench.netns.Topology`), one
after the other, with the same model, data shards, seeds, batch and eval set
(`bench.runs.common_flags`), one island (or DDP rank) per region at that
region's speed (1.0 / 0.55):

- ddp: `bench.children.ddp_reducer` binds in the first shard region, one
  `bench.children.ddp_rank` per region connects to it over its WAN link.
- sync, quorum: `diloco-server` shards started from a cluster file in their
  regions (bind 0.0.0.0, advertise the region's service address), one
  `diloco-worker` daemon per region (`bench.launcher.LocalCluster`); quorum
  is K = 1 with the eq3 grace window. The final eval (`diloco-worker eval`)
  runs in the first shard's region once every island has flushed and left.

DDP trains `steps` steps per rank; the DiLoCo methods train up to
`diloco_token_factor` times DDP's tokens (so a slower-to-converge method can
still reach the target; the equal-tokens loss is read at DDP's tokens).
Each run returns the record of `bench.run_record.summarize`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import child, netns, regions_claims, run_record, runs
from bench.launcher import IslandSpec, LaunchError, LocalCluster
from bench.regions_plan import REGIONS
from bench.regions_run import ROUTER_PORT
from bench.scenarios import Budget, Scenario
from paramserver.plumbing import daemon
from paramserver.plumbing.clusterfile import ShardAddress, render_cluster_file
from worker import island_files as progress_files

DDP_PORT = ROUTER_PORT + 100
POLL_S = 0.5
METHODS = ("ddp", "sync", "quorum")


def parse_methods(text: str) -> list[str]:
    """Parse `--methods` ("ddp,sync,quorum", "all", or "").

    Args:
        text: the flag.

    Returns:
        The methods in run order (DDP first: the default target is its final loss).

    Raises:
        ValueError: an unknown method.
    """
    if text.strip() == "all":
        return list(METHODS)
    wanted = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in wanted if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown {unknown}; known: {', '.join(METHODS)}")
    return [m for m in METHODS if m in wanted]


def scenario_of(method: str, speeds: tuple[tuple[float, float], ...]) -> Scenario:
    """The scenario of one method: same speeds for all; quorum is K = 1 with eq3 grace.

    Args:
        method: ddp | sync | quorum.
        speeds: (speed, jitter) per region.

    Returns:
        The scenario.
    """
    if method == "quorum":
        return Scenario("quorum", "quorum", "regions", quorum=1, grace_rule="eq3",
                        island_speeds=speeds)  # fmt: skip
    return Scenario(method, method, "regions", island_speeds=speeds)


def _log(note: str) -> None:
    print(f"regions compare {time.strftime('%H:%M:%S')}: {note}", file=sys.stderr, flush=True)


def run_ddp(
    topo: netns.Topology, budget: Budget, scenario: Scenario, out: Path, cap_s: float
) -> dict[str, Any]:
    """DDP over the WAN: the reducer in region 0's namespace, one rank per region.

    Args:
        topo: the topology (its relays forward DDP_PORT).
        budget: shared settings (steps_per_island = DDP steps per rank).
        scenario: the DDP scenario (its speeds).
        out: this run's directory.
        cap_s: bound on training wall time (from the first step).

    Returns:
        Raw material for `run_record.summarize`.
    """
    out.mkdir(parents=True, exist_ok=True)
    cache_dir = out.parent / "jax-cache"  # shared by every method's processes: one compile
    home = 0
    names = runs.island_names(budget.islands)
    reducer_argv = [*topo.prefix_argv(home), *child.module_argv(
        "bench.children.ddp_reducer", "--bind", f"tcp://0.0.0.0:{DDP_PORT}",
        "--world", str(budget.islands))]  # fmt: skip
    ranks: list[child.Child] = []
    try:
        with child.running(reducer_argv, "ddp reducer", grace_s=10.0):
            for i, name in enumerate(names):
                data_dir = out / "islands" / name
                data_dir.mkdir(parents=True, exist_ok=True)
                speed, jitter = scenario.speeds(budget.islands)[i]
                argv = [
                    *topo.prefix_argv(i), sys.executable, "-m", "bench.children.ddp_rank",
                    "--rank", str(i), "--world", str(budget.islands), "--island", name,
                    "--connect", f"tcp://{topo.address(home)}:{DDP_PORT}", "--insecure",
                    "--data-dir", str(data_dir), *runs.common_flags(budget, i),
                    "--compile-cache-dir", str(cache_dir),
                    # one row per step; eval every half round of the DiLoCo runs
                    "--inner-steps", "1", "--max-rounds", str(budget.steps_per_island),
                    "--eval-every", str(max(1, budget.inner_steps // 2)),
                    "--speed", str(speed), "--jitter", str(jitter),
                ]  # fmt: skip
                ranks.append(child.start(argv, f"ddp rank {i}", ready_timeout_s=None))
            started = None
            while any(r.proc.poll() is None for r in ranks):
                rows = progress_files.read_rows(out / "islands" / names[0])
                if started is None and any(r.get("round", 0) >= 1 for r in rows):
                    started = time.monotonic()
                if started is not None and time.monotonic() - started > cap_s:
                    _log(f"ddp: wall cap {cap_s:g} s reached")
                    break
                time.sleep(POLL_S)
            stopped_at = time.time()
            runs.stop_ranks(ranks, 60.0)
    finally:
        for r in ranks:
            r.stop(0.0)
    return {
        "rows": {n: progress_files.read_rows(out / "islands" / n) for n in names},
        "timeline": [],
        "stopped_at": stopped_at,
        "server": {},
    }


def _run_in(topo: netns.Topology, region: int, argv: list[str], timeout_s: float) -> str:
    proc = subprocess.run([*topo.prefix_argv(region), *argv], capture_output=True, text=True,
                          timeout=timeout_s)  # fmt: skip
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        raise LaunchError(
            f"{argv[2:4]} failed (exit {proc.returncode}): {tail[-1] if tail else ''}"
        )
    return proc.stdout


def run_diloco(
    topo: netns.Topology,
    budget: Budget,
    scenario: Scenario,
    shard_regions: list[int],
    out: Path,
    cap_s: float,
) -> dict[str, Any]:
    """Synchronous DiLoCo or this system over the WAN: shards in their regions, one island per region.

    Args:
        topo: the topology (its relays forward the shards' ports).
        budget: shared settings (steps_per_island: each island's share of the tokens).
        scenario: the method.
        shard_regions: region of each shard.
        out: this run's directory.
        cap_s: bound on training wall time.

    Returns:
        Raw material for `run_record.summarize` (with the final eval).
    """
    budget = dataclasses.replace(budget, shards=len(shard_regions))
    cache_dir = out.parent / "jax-cache"
    cluster = LocalCluster(out, shards=len(shard_regions))
    shards = [
        ShardAddress(
            router=f"tcp://{topo.address(region)}:{ROUTER_PORT + 2 * i}",
            pub=f"tcp://{topo.address(region)}:{ROUTER_PORT + 2 * i + 1}",
            router_bind=f"tcp://0.0.0.0:{ROUTER_PORT + 2 * i}",
            pub_bind=f"tcp://0.0.0.0:{ROUTER_PORT + 2 * i + 1}",
        )
        for i, region in enumerate(shard_regions)
    ]
    settings = {**runs.server_settings(scenario, budget), "insecure": True,
                "data_dir": str(cluster.server_dir)}  # fmt: skip
    cluster.cluster_file = out / "cluster.toml"
    out.mkdir(parents=True, exist_ok=True)
    cluster.cluster_file.write_text(render_cluster_file(settings, shards))
    cluster.host, cluster.port = topo.address(shard_regions[0]), ROUTER_PORT
    names = runs.island_names(budget.islands)
    final: dict[str, Any] = {}
    stopped_at = time.time()
    with cluster:
        for i, region in enumerate(shard_regions):
            _run_in(topo, region, [sys.executable, "-m", "paramserver.server.cli", "start",
                                   "--cluster", str(cluster.cluster_file), "--shard", str(i),
                                   "--detach"], 300.0)  # fmt: skip
        start_file = out / "start"
        specs = [
            IslandSpec(
                name,
                speed,
                (
                    *runs.common_flags(budget, i),
                    *("--compile-cache-dir", str(cache_dir)),
                    *("--codec", scenario.codec, "--jitter", str(jitter)),
                    *("--merge-rule", scenario.merge_rule),
                    *("--flush-timeout-s", "30", "--start-file", str(start_file)),
                    *("--max-rounds", "0"),
                ),
                topo.prefix_argv(i),
            )
            for i, (name, (speed, jitter)) in enumerate(
                zip(names, scenario.speeds(budget.islands), strict=True)
            )
        ]
        _log(f"{scenario.name}: shards up, starting islands")
        cluster.start_islands(specs)
        _log(f"{scenario.name}: islands joined, training")
        start_file.touch()
        started = time.monotonic()
        while True:
            states = [cluster.island_status(n) for n in names]
            tokens = sum(st.get("tokens", 0) for st in states)
            if tokens >= budget.tokens:
                break
            if time.monotonic() - started > cap_s:
                _log(f"{scenario.name}: wall cap {cap_s:g} s reached at {tokens} tokens")
                break
            if all(st.get("state") == "stopped" for st in states):
                break
            time.sleep(POLL_S)
        stopped_at = time.time()
        pids = [p for n in names if (p := daemon.running_pid(daemon.pid_path(cluster.islands[n])))]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for pid in pids:
            daemon.wait_exit(pid, 90.0)
        _log(f"{scenario.name}: islands stopped at {tokens} tokens, final eval")
        local = f"tcp://127.0.0.1:{ROUTER_PORT}"
        try:
            final = json.loads(_run_in(topo, shard_regions[0], [
                sys.executable, "-m", "worker.cli", "eval", "--connect", local, "--json",
                "--wait-s", "120", *runs.common_flags(budget, 0)], 400.0))  # fmt: skip
        except (LaunchError, ValueError, subprocess.TimeoutExpired) as exc:
            final = {"error": str(exc)}
        server: dict[str, Any] = {}
        with contextlib.suppress(LaunchError, ValueError, subprocess.TimeoutExpired):
            server = json.loads(_run_in(topo, shard_regions[0], [
                sys.executable, "-m", "paramserver.server.cli", "status", "--connect", local,
                "--json", "--timeout", "10"], 60.0))  # fmt: skip
        rows = {n: cluster.island_metrics(n) for n in names}
    return {
        "rows": rows,
        "timeline": [],
        "stopped_at": stopped_at,
        "server": server,
        "final_eval": final,
    }


def run_methods(
    topo: netns.Topology,
    methods: list[str],
    budget: Budget,
    shard_regions: list[int],
    diloco_token_factor: float,
    cap_s: float,
    work: Path,
) -> dict[str, dict[str, Any]]:
    """Run each method once over the topology; their run records by method.

    Args:
        topo: the built, probed topology.
        methods: among METHODS, in order.
        budget: shared settings; steps_per_island is DDP's steps per rank.
        shard_regions: where the shards (and DDP's reducer: the first) run.
        diloco_token_factor: DiLoCo methods train up to this times DDP's tokens.
        cap_s: bound on each run's training wall time.
        work: parent of the runs' directories.

    Returns:
        method -> `run_record.summarize` record (or {"error": ...} for a run that failed).
    """
    speeds = tuple((REGIONS[r].island_speed, 0.0) for r in range(budget.islands))
    records: dict[str, dict[str, Any]] = {}
    for method in methods:
        scenario = scenario_of(method, speeds)
        _log(f"{method}: starting")
        try:
            if method == "ddp":
                raw = run_ddp(topo, budget, scenario, work / method, cap_s)
                this = budget
            else:
                steps = int(round(budget.steps_per_island * diloco_token_factor))
                this = dataclasses.replace(budget, steps_per_island=steps)
                raw = run_diloco(topo, this, scenario, shard_regions, work / method, cap_s)
            record = run_record.summarize(scenario, this, raw)
        except (LaunchError, netns.NetnsError, subprocess.TimeoutExpired) as exc:
            record = {"name": method, "error": str(exc)}
        records[method] = record
        _log(f"{method}: done, final loss {record.get('eval_final')}, "
             f"{record.get('duration_s') or 0:.0f} s")  # fmt: skip
    return records


def ddp_ratio(record: dict[str, Any]) -> dict[str, Any] | None:
    """DDP's measured communication / compute per step: waiting over busy time of its ranks.

    Args:
        record: DDP's run record (islands: goodput = busy / wall).

    Returns:
        {"goodput_min", "comm_over_compute"} of the rank that waited least (the slowest
        computes most), or None without goodput figures.
    """
    goodputs = [i["goodput"] for i in record.get("islands", {}).values() if i.get("goodput")]
    if not goodputs:
        return None
    busiest = max(goodputs)
    return {
        "goodput_max": round(busiest, 5),
        "comm_over_compute": round((1.0 - busiest) / busiest, 2),
        "step_s_median": [i.get("step_s") for i in record["islands"].values()],
    }


def compare(
    topo: netns.Topology,
    methods: list[str],
    plan: dict[str, Any],
    scale: float,
    shard_regions: list[int],
    target_loss: float | None,
) -> dict[str, Any]:
    """Run the methods and compute the claims table; the report's "compare" part.

    Args:
        topo: the built, probed topology.
        methods: the methods, DDP first.
        plan: `bench.regions.compare_plan`'s budget, caps and scaling inputs.
        scale: the scale the links ended at after probing.
        shard_regions: where the shards (and DDP's reducer) run.
        target_loss: the held-out loss to reach (None: DDP's final loss + 1%).

    Returns:
        JSON-ready dict: the plan, the runs' records, the target and the claims.
    """
    work = topo.workdir / "compare"
    budget = plan["budget"]
    records = run_methods(topo, methods, budget, shard_regions, plan["token_factor"],
                          plan["cap_s"], work)  # fmt: skip
    ok = {m: r for m, r in records.items() if "error" not in r}
    ddp = ok.get("ddp")
    target_rule = "stated (--target-loss)"
    if target_loss is None:
        final = ddp.get("eval_final") if ddp else None
        if final is None:
            target_rule = "none: DDP gave no final loss (no claims)"
        else:
            target_loss = regions_claims.target_from_ddp(final)
            target_rule = "DDP's final held-out loss + 1%"
    table = (
        regions_claims.claims(ok, target_loss)
        if target_loss is not None
        else {"target_loss": None, "methods": {}, "rows": [], "all_met": False}
    )
    return {
        "quick": plan["quick"],
        "budget": {
            **dataclasses.asdict(budget),
            "tokens_ddp": budget.tokens,
            "diloco_token_factor": plan["token_factor"],
            "cap_s": plan["cap_s"],
        },  # fmt: skip
        "scaling": {
            **plan["inputs"],
            "formula": plan["formula"],
            "scale_planned": plan["scale"],
            "scale_after_probe": scale,
            "slowest_ddp_link_mbit": round(regions_claims.REFERENCE_GBIT * 1000.0 * scale, 4),
        },  # fmt: skip
        "ddp_measured": ddp_ratio(ddp) if ddp else None,
        "target_loss": target_loss,
        "target_rule": target_rule,
        "claims": table,
        "errors": {m: r["error"] for m, r in records.items() if "error" in r},
        "runs": {
            m: {k: v for k, v in r.items() if k not in ("timeline",)} for m, r in records.items()
        },
    }
