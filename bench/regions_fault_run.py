"""The regions bench's faulted run (`diloco-bench regions --faults`): three faults over the WAN.

Starts the shards and one island per region as `bench.regions_run` does, the
islands with `--progress` (a line per push start and per settled round) and
rounds until a stop file appears. Once every island settled `WARM_ROUNDS`
rounds it injects, one after the other (`bench.regions_faults`):

1. `kill_island`: the island of the last region without shards is killed
   with -9 while a round of it is being pushed (after its push started and
   a third of the round's bytes / bandwidth passed), and restarted
   `KILL_DOWN_S` x `--fault-scale` later at its first round not fully acked
   (the same idempotency keys: what its dead instance got applied comes back
   as duplicates, not as second applications);
2. `cut_link`: every link of the first region without shards cut to a tenth
   of its rate (its htb classes) for `CUT_S` x scale, then restored;
3. `partition`: the next region without shards cut off the WAN (its veth's
   WAN end down) for `PARTITION_S` x scale, then restored.

Before each fault, and after the last, it waits until every island settled
`SETTLE_ROUNDS` more rounds (at most max(60 s, 20 x `SETTLE_ROUNDS` x the
longest round so far); a wait that ran out is listed in "errors"), so each
fault has rounds before and after it. A fault is undone in a
`finally` whatever happens (an error, SIGTERM, Ctrl-C); the namespaces go
with the topology at the bench's exit in any case. Then the islands stop,
the shards report their per-island accepted and duplicate counts (a status
request from inside the shard's region), and `bench.regions_faults` scores
the run. A `LinkSampler` records each link's bytes throughout, for the plots.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import netns, regions_faults, regions_run
from bench.regions_faults import FaultWindow, Round
from bench.regions_plan import REGIONS, Link

WARM_ROUNDS = 2
SETTLE_ROUNDS = 3
KILL_AT_SHARE = 1 / 3  # of the round's bytes / bandwidth after its push started
ROUNDS_CAP = 100_000  # islands run until the stop file appears
STATUS_CODE = (
    "import json, sys, zmq; from paramserver.plumbing import probe; "
    "print(json.dumps(probe.shard_status(zmq.Context(), sys.argv[1], timeout_s=20.0)))"
)


class Island:
    """The current process of one region's island and everything its instances printed."""

    def __init__(self, region: int, argv: list[str], log: Path) -> None:
        """Args:
        region: its region.
        argv: its command line (without --first-round).
        log: where its stderr goes (appended, every instance).
        """
        self.region = region
        self.argv = argv
        self.log = log
        self.rounds: list[Round] = []
        self.bytes_sent: list[int] = []  # of each settled round, in `rounds` order
        self.pushing: list[tuple[int, float]] = []  # (round, at)
        self.results: list[dict[str, Any]] = []  # final lines of instances that finished
        self.starts: list[float] = []
        self.proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self._readers: list[threading.Thread] = []

    def start(self, first_round: int = 0) -> None:
        """Start an instance at `first_round`; a thread reads its lines."""
        self.starts.append(time.monotonic())
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                [*self.argv, "--first-round", str(first_round)],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        reader = threading.Thread(target=self._read, args=(self.proc,), daemon=True)
        reader.start()
        self._readers.append(reader)

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            with self._lock:
                if "pushing" in obj:
                    self.pushing.append((int(obj["pushing"]), float(obj["at"])))
                elif "progress" in obj:
                    p = obj["progress"]
                    self.bytes_sent.append(int(p["bytes_sent"]))
                    self.rounds.append(
                        Round(p["round"], p["started"], p["started"] + p["seconds"], p["acked"],
                              p["fragments"])
                    )  # fmt: skip
                elif "rounds" in obj:
                    self.results.append(obj)

    def settled(self) -> list[Round]:
        """Its settled rounds so far (a copy)."""
        with self._lock:
            return list(self.rounds)

    def settled_bytes(self) -> list[tuple[Round, int]]:
        """Its settled rounds with the bytes each sent."""
        with self._lock:
            return list(zip(self.rounds, self.bytes_sent, strict=True))

    def mid_push(self) -> int | None:
        """The round being pushed now (a push started, not settled), or None."""
        with self._lock:
            if not self.pushing:
                return None
            r = self.pushing[-1][0]
            return None if any(x.round == r for x in self.rounds) else r

    def next_round(self) -> int:
        """The first round not settled by any instance (where a restart resumes)."""
        with self._lock:
            return max((x.round for x in self.rounds), default=-1) + 1

    def kill(self) -> None:
        """SIGKILL the current instance and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def wait(self, timeout_s: float) -> None:
        """Wait for the current instance to end (killed past the timeout) and its reader."""
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        for reader in self._readers:
            reader.join(10)


def _wait(stop: threading.Event, until: float, ready: Any = None, poll_s: float = 0.2) -> bool:
    """Poll `ready` every `poll_s` until `until` (monotonic) or `stop`; True when ready."""
    while not stop.is_set() and time.monotonic() < until:
        if ready is not None and ready():
            return True
        stop.wait(poll_s)
    return ready is None and not stop.is_set()


def _settle(islands: list[Island], rounds: int, stop: threading.Event, bound_s: float) -> bool:
    base = {i.region: len(i.settled()) for i in islands}
    return _wait(
        stop,
        time.monotonic() + bound_s,
        lambda: all(len(i.settled()) >= base[i.region] + rounds for i in islands),
    )


def _targets(regions: int, shard_regions: list[int]) -> dict[str, int]:
    others = [r for r in range(regions) if r not in shard_regions] or list(range(1, regions))
    return {
        "kill_island": others[-1],
        "cut_link": others[0],
        "partition": others[1 % len(others)],
    }


def _shard_status(topo: netns.Topology, region: int, router: str) -> dict[str, Any]:
    argv = [*topo.prefix_argv(region), sys.executable, "-c", STATUS_CODE, router]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()
        return {"error": tail[-1] if tail else str(proc.returncode)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_faulted(
    topo: netns.Topology,
    links: list[Link],
    scale: float,
    shard_regions: list[int],
    params: int,
    compute_s: float,
    fault_scale: float,
    timeout_s: float,
) -> dict[str, Any]:
    """Run the islands through the three faults; the run part of the report.

    Args:
        topo: the built, probed topology.
        links: the links at real rates.
        scale: the final scale.
        shard_regions: where shard 0, 1, ... run.
        params: float32 parameters of the synthetic model.
        compute_s: compute per round of a speed-1.0 island.
        fault_scale: the faults' durations x this (1: 60 s cut, 30 s partition).
        timeout_s: bound on the islands' start (their first rounds), on the wait for
            the victim's push, and on their exit at the end.

    Returns:
        JSON-ready: islands (their settled rounds), faults (scored), acked_vs_applied,
        goodput_per_region, shard_status, link_utilisation, t0, errors.
    """
    stop = threading.Event()
    work, shards = regions_run.start_shards(topo, shard_regions)
    stop_file = work / "stop"
    targets = _targets(topo.regions, shard_regions)
    islands = [
        Island(
            region,
            regions_run.island_argv(
                topo,
                region,
                shards[0].router,
                params,
                ROUNDS_CAP,
                compute_s,
                "--progress",
                "--stop-file",
                str(stop_file),
            ),
            work / f"island{region}.log",
        )  # fmt: skip
        for region in range(topo.regions)
    ]
    windows: list[FaultWindow] = []
    events: list[dict[str, Any]] = []
    errors: list[str] = []
    sampler = regions_run.LinkSampler(topo)
    t0 = time.monotonic()
    try:
        with sampler:
            for island in islands:
                island.start()
            if not _settle(islands, WARM_ROUNDS, stop, timeout_s):
                errors.append(f"islands did not settle {WARM_ROUNDS} rounds in {timeout_s:g} s")
            else:
                _inject(topo, islands, targets, windows, events, errors, sampler, stop,
                        fault_scale, links, scale, shard_regions, params, timeout_s)  # fmt: skip
            run_end = time.monotonic()
            stop_file.touch()
            for island in islands:
                island.wait(timeout_s)
    finally:
        stop_file.touch()
        for island in islands:
            island.kill()
    status = [_shard_status(topo, region, s.router) for s, region in zip(shards, shard_regions, strict=True)]  # fmt: skip
    regions_run.stop_shards(topo, work, shard_regions)

    def ideal(region: int, nbytes: int) -> float | None:
        return regions_run.bytes_over_bandwidth_s(nbytes, region, shard_regions, links, scale)

    return score(islands, windows, events, errors, status, sampler, t0, run_end, compute_s,
                 params, fault_scale, targets, ideal)  # fmt: skip


def _inject(
    topo: netns.Topology,
    islands: list[Island],
    targets: dict[str, int],
    windows: list[FaultWindow],
    events: list[dict[str, Any]],
    errors: list[str],
    sampler: regions_run.LinkSampler,
    stop: threading.Event,
    fault_scale: float,
    links: list[Link],
    scale: float,
    shard_regions: list[int],
    params: int,
    timeout_s: float,
) -> None:
    """The three faults in order, each undone in a `finally`, with settling waits between."""

    def typical_round_s() -> float:
        seconds = [r.ended - r.started for i in islands for r in i.settled()]
        return max(seconds) if seconds else 5.0

    def settle() -> None:
        bound = max(60.0, 20 * SETTLE_ROUNDS * typical_round_s())
        if not _settle(islands, SETTLE_ROUNDS, stop, bound):
            errors.append(f"islands did not settle {SETTLE_ROUNDS} rounds in {bound:.0f} s")

    # 1. kill -9 mid-push, restart
    victim = islands[targets["kill_island"]]
    ideal = regions_run.bytes_over_bandwidth_s(params, victim.region, shard_regions, links, scale)
    base = victim.next_round()
    pushing = victim.mid_push
    if _wait(
        stop,
        time.monotonic() + timeout_s,
        lambda: pushing() is not None and pushing() >= base,
        0.02,
    ):
        stop.wait(KILL_AT_SHARE * (ideal or 0.0))
        killed_round = victim.mid_push()
        victim.kill()
        start = time.monotonic()
        pushed_at = victim.pushing[-1][1] if victim.pushing else start
        events.append({"kind": "kill_island", "round": killed_round,
                       "mid_push": killed_round is not None,
                       "killed_after_push_s": round(start - pushed_at, 3)})  # fmt: skip
        _wait(stop, start + regions_faults.KILL_DOWN_S * fault_scale)
        resume = victim.next_round()
        victim.start(resume)
        events[-1]["restarted_at_round"] = resume
        windows.append(FaultWindow("kill_island", victim.region, start, time.monotonic()))
    else:
        errors.append("kill_island: no push of the victim seen in time")
    settle()
    # 2. a region's links cut to a tenth
    region = targets["cut_link"]
    touched = {(ln.a, ln.b): ln.mbit for ln in topo.links if region in (ln.a, ln.b)}
    start = time.monotonic()
    try:
        topo.set_rates({k: v * regions_faults.CUT_FACTOR for k, v in touched.items()})
        sampler.note_rates()
        events.append({"kind": "cut_link", "links": [f"{REGIONS[a].name}-{REGIONS[b].name}"
                                                     for a, b in touched]})  # fmt: skip
        _wait(stop, start + regions_faults.CUT_S * fault_scale)
    finally:
        topo.set_rates(touched)
        sampler.note_rates()
    windows.append(FaultWindow("cut_link", region, start, time.monotonic()))
    settle()
    # 3. a region partitioned, then restored
    region = targets["partition"]
    start = time.monotonic()
    try:
        topo.set_region_down(region, True)
        events.append({"kind": "partition"})
        _wait(stop, start + regions_faults.PARTITION_S * fault_scale)
    finally:
        topo.set_region_down(region, False)
    windows.append(FaultWindow("partition", region, start, time.monotonic()))
    settle()


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def errors_status(status: list[dict[str, Any]]) -> list[str]:
    """The shards whose status could not be read (their error lines)."""
    return [st["error"] for st in status if "error" in st]


def score(
    islands: list[Island],
    windows: list[FaultWindow],
    events: list[dict[str, Any]],
    errors: list[str],
    status: list[dict[str, Any]],
    sampler: regions_run.LinkSampler,
    t0: float,
    run_end: float,
    compute_s: float,
    params: int,
    fault_scale: float,
    targets: dict[str, int],
    ideal: Callable[[int, int], float | None],
) -> dict[str, Any]:
    """The faulted run's report from what the run collected (`bench.regions_faults` scores).

    `ideal(region, bytes)` is a round's bytes / bandwidth at the links' real
    rates (`regions_run.bytes_over_bandwidth_s`; the cut is not in it).
    """
    names = {i.region: regions_run.island_name(i.region) for i in islands}
    region_names = {i.region: REGIONS[i.region].name for i in islands}
    rounds = {i.region: i.settled() for i in islands}
    applied: dict[str, int] = {}
    for st in status:
        for name, entry in st.get("islands", {}).items():
            applied[name] = applied.get(name, 0) + int(entry.get("accepted", 0))
    duplicates = sum(int(st.get("duplicates", 0)) for st in status)
    scored = regions_faults.score_faults(windows, rounds, region_names, t0, run_end)
    for entry, event in zip(scored, [e for e in events if e["kind"] in regions_faults.KINDS],
                            strict=False):  # fmt: skip
        entry.update({k: v for k, v in event.items() if k != "kind"})
    first_fault = windows[0].start if windows else run_end
    ledger = regions_faults.acked_vs_applied(rounds, names, applied, duplicates)
    return {
        "params": params,
        "compute_s_per_round_at_speed_1": compute_s,
        "codec": "int8 (random deltas, bench.load_cluster.random_frames)",
        "fault_scale": fault_scale,
        "durations_s": {
            "kill_down": regions_faults.KILL_DOWN_S * fault_scale,
            "cut_link": regions_faults.CUT_S * fault_scale,
            "partition": regions_faults.PARTITION_S * fault_scale,
        },
        "targets": {k: REGIONS[v].name for k, v in targets.items()},
        "recovery_factor": regions_faults.RECOVERY_FACTOR,
        "recovery_slack_s": regions_faults.RECOVERY_SLACK_S,
        "run_s": round(run_end - t0, 3),
        "islands": [
            {
                "island": names[i.region],
                "region": region_names[i.region],
                "speed": REGIONS[i.region].island_speed,
                "instances": len(i.starts),
                "rounds": [
                    {
                        "round": r.round,
                        "started_s": round(r.started - t0, 3),
                        "seconds": round(r.seconds, 4),
                        "compute_s": round(compute_s / REGIONS[i.region].island_speed, 4),
                        "acked": r.acked,
                        "fragments": r.fragments,
                        "bytes_sent": nbytes,
                        "bytes_over_bandwidth_s": _rounded(ideal(i.region, nbytes)),
                    }
                    for r, nbytes in i.settled_bytes()
                ],
                "client": [res["client"] for res in i.results],
                "failed": [res["failed"] for res in i.results if res["failed"]],
            }
            for i in islands
        ],
        "faults": scored,
        "acked_vs_applied": ledger,
        "goodput_per_region": {
            region_names[i.region]: regions_faults.region_goodput(
                i.settled(), compute_s / REGIONS[i.region].island_speed
            )
            for i in islands
        },
        "goodput_per_region_before_faults": {
            region_names[i.region]: regions_faults.region_goodput(
                i.settled(), compute_s / REGIONS[i.region].island_speed, first_fault
            )
            for i in islands
        },
        "shard_status": [
            {
                k: st.get(k)
                for k in ("shard", "accepted", "duplicates", "rejected", "error")
                if k in st
            }
            for st in status
        ],  # fmt: skip
        "link_utilisation": sampler.utilisation(t0),
        "targets_met": {
            "acked_equals_applied": ledger["acked_equals_applied"] and not errors_status(status),
            "every_fault_injected": len(scored) == len(regions_faults.KINDS),
            "trained_during_every_fault": all(f["trained_during"] for f in scored),
            "recovered_after_every_fault": regions_faults.all_known(
                [f["recovered"] for f in scored]
            ),
        },
        "errors": errors,
    }
