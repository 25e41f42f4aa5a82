"""`diloco-bench regions --faults` end to end: real namespaces, shards and islands, scaled faults.

A small run at low rates (2 regions, 200k parameters, faults at a tenth of
their durations): an island killed with -9 mid-push and restarted, its
region's link cut to a tenth, the region partitioned and restored. Checked:
acked = applied per island (none lost, none applied twice: the killed
round's re-push comes back as duplicates), the island of the other region
settles rounds inside every fault's span, every namespace is gone
afterwards, and the plots are PNG files named in the JSON. A second run is
stopped with SIGTERM while its region is partitioned: everything is deleted.
Skipped without root or where `ip netns` does not work.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import wait_for

from bench import netns

pytestmark = [
    pytest.mark.skipif(
        bool(netns.can_build()), reason=f"regions topology: {netns.can_build() or 'ok'}"
    ),
    pytest.mark.slow,
]

BENCH = [sys.executable, "-m", "bench.cli", "regions", "--faults", "--regions", "2",
         "--scale", "0.001", "--params", "200000", "--compute-s", "0.5",
         "--probe-seconds", "1", "--probe-pings", "5", "--probe-rounds", "2",
         "--run-timeout", "120"]  # fmt: skip
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _prefix() -> str:
    return "drg" + secrets.token_hex(2)


def _ours(prefix: str) -> list[str]:
    return [ns for ns in netns.namespaces() if ns.startswith(prefix + "-")]


@pytest.mark.timeout(420)
def test_faulted_run_loses_nothing_trains_through_and_cleans_up(tmp_path: Path) -> None:
    prefix = _prefix()
    out = tmp_path / "out"
    try:
        proc = subprocess.run(
            [*BENCH, "--fault-scale", "0.1", "--prefix", prefix, "--out", str(out)],
            capture_output=True, text=True, timeout=400, env=ENV,
        )  # fmt: skip
    finally:
        leftovers = _ours(prefix)
        if leftovers:
            netns.cleanup_prefix(prefix)
    assert leftovers == []
    assert not netns.state_file(prefix).exists()
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    run = report["run"]
    assert run["errors"] == [], run["errors"]
    assert [f["kind"] for f in run["faults"]] == ["kill_island", "cut_link", "partition"]
    ledger = run["acked_vs_applied"]
    assert ledger["acked"] > 0
    assert ledger["acked_equals_applied"], ledger
    for island in ledger["per_island"].values():
        assert island["acked"] == island["applied"]
    assert [st.get("error") for st in run["shard_status"]] == [None]
    # the island of the other region settled rounds inside every fault's span
    for fault in run["faults"]:
        assert fault["region"] == "us-central"
        assert fault["rounds_during"]["us-east"] >= 1, fault
        assert fault["trained_during"] is True
    kill = run["faults"][0]
    assert kill["restarted_at_round"] >= 1
    victim = next(i for i in run["islands"] if i["region"] == "us-central")
    assert victim["instances"] == 2
    assert set(run["goodput_per_region"]) == {"us-east", "us-central"}
    # the plots: PNG files next to the JSON, named in it
    assert set(report["plots"]) == {"link_utilisation", "round_breakdown", "round_times_faults"}
    for path in report["plots"].values():
        assert Path(path).parent == out
        assert Path(path).read_bytes()[:8] == PNG_MAGIC
    assert json.loads((out / "regions.json").read_text())["plots"] == report["plots"]


def _link_up(prefix: str) -> bool | None:
    """Whether region 1's WAN end is up (None before it exists)."""
    try:
        text = netns.sh("ip", "-n", netns.wan_ns(prefix), "link", "show", f"{prefix}w1")
    except netns.NetnsError:
        return None
    return ",UP" in text.split(">")[0]


@pytest.mark.timeout(300)
def test_sigterm_during_a_partition_removes_everything() -> None:
    prefix = _prefix()
    bench = subprocess.Popen(
        [*BENCH, "--fault-scale", "0.3", "--prefix", prefix],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV,
    )  # fmt: skip
    try:
        wait_for(lambda: _link_up(prefix), "the topology", timeout_s=60, poll_s=0.2)
        wait_for(lambda: _link_up(prefix) is False, "the partition", timeout_s=240, poll_s=0.2)
        bench.send_signal(signal.SIGTERM)
        bench.wait(timeout=90)
        assert _ours(prefix) == []
        assert not netns.state_file(prefix).exists()
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(30)
        if _ours(prefix):
            netns.cleanup_prefix(prefix)
