"""The regions bench's topology with real namespaces and processes: probe accuracy and cleanup.

A small topology at low rates (a few Mbit/s): the probe reads within 10% of
the configured rate and RTT; every namespace, veth and relay process is gone
afterwards, also after the bench was killed with -9 (the next `--cleanup`
of that prefix, or the next run, removes the leftovers, and only those).
Skipped without root or where `ip netns` does not work.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import wait_for

from bench import netns

pytestmark = pytest.mark.skipif(
    bool(netns.can_build()), reason=f"regions topology: {netns.can_build() or 'ok'}"
)

BENCH = [sys.executable, "-m", "bench.cli", "regions"]
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def _prefix() -> str:
    return "drg" + secrets.token_hex(2)


def _ours(prefix: str) -> list[str]:
    return [ns for ns in netns.namespaces() if ns.startswith(prefix + "-")]


def _pids_in(prefix: str) -> list[int]:
    pids: list[int] = []
    for ns in _ours(prefix):
        pids += [int(p) for p in netns.sh("ip", "netns", "pids", ns).split()]
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.timeout(120)
def test_probe_reads_the_configured_rate_and_rtt_and_nothing_is_left() -> None:
    link = netns.LinkShape(0, 1, mbit=4.0, rtt_ms=40.0)
    seen_pids: list[int] = []
    with netns.Topology(2, [link], []) as topo:
        prefix = topo.prefix
        probe = topo.probe(link, seconds=1.5, pings=15)
        seen_pids = _pids_in(prefix)
        assert len(_ours(prefix)) == 3  # two regions and the WAN
    assert abs(probe["mbit_s"] - 4.0) <= 0.1 * 4.0, probe
    # the fastest ping is the link's round trip; the median also holds the relay's scheduling
    # delay on a loaded machine (44.8 ms beside a benchmark), so it gets a one-sided bound
    assert abs(probe["rtt_ms_min"] - 40.0) <= 0.1 * 40.0, probe
    assert 0.9 * 40.0 <= probe["rtt_ms_median"] <= 1.5 * 40.0, probe
    assert seen_pids  # the relay and the probe servers ran inside the namespaces
    assert _ours(prefix) == []
    assert not netns.state_file(prefix).exists()
    assert not [p for p in seen_pids if _alive(p)]
    assert not [line for line in netns.sh("ip", "link").splitlines() if prefix in line]


@pytest.mark.timeout(60)
def test_cli_probe_only_reports_achieved_against_configured(tmp_path: Path) -> None:
    prefix = _prefix()
    proc = subprocess.run(
        [*BENCH, "--probe-only", "--regions", "2", "--scale", "0.001", "--prefix", prefix,
         "--probe-seconds", "1", "--probe-pings", "10", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=50, env=ENV,
    )  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    assert report["prefix"] == prefix
    assert report["scale_initial"] == 0.001
    (line,) = report["links"]  # 2 regions: us-east - us-central, 5 Gbit/s x 0.001
    assert line["configured_mbit"] == pytest.approx(5.0 * report["scale"] / 0.001)
    achieved = min(line["achieved_mbit"], line["achieved_mbit_together"])  # the lower counts
    assert line["rate_ratio"] == pytest.approx(achieved / line["configured_mbit"], rel=1e-3)
    assert line["rtt_ms"] == 30.0
    assert json.loads((tmp_path / "out" / "regions.json").read_text())["prefix"] == prefix
    assert _ours(prefix) == []


def _start_and_kill(prefix: str) -> list[int]:
    """Start a probe-only run, wait until its relays run, kill it with -9; the pids it had inside."""
    bench = subprocess.Popen(
        [*BENCH, "--probe-only", "--regions", "2", "--scale", "0.001", "--prefix", prefix,
         "--probe-seconds", "20"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV,
    )  # fmt: skip
    try:
        pids = wait_for(
            lambda: len(_ours(prefix)) == 3 and len(_pids_in(prefix)) >= 3 and _pids_in(prefix),
            "the run's relay and probe servers",
            timeout_s=40,
        )
    finally:
        bench.send_signal(signal.SIGKILL)
        bench.wait(timeout=10)
    return pids


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_leftovers_of_a_killed_run_are_removed_and_only_its_own() -> None:
    first, second = _prefix(), _prefix()
    # a namespace this test makes, named like a run's but without a run's state file:
    # neither --cleanup nor the next run may touch it
    foreign = f"{_prefix()}-r0"
    netns.sh("ip", "netns", "add", foreign)
    try:
        pids_first = _start_and_kill(first)
        assert len(_ours(first)) == 3  # kill -9 left them
        workdir = Path(json.loads(netns.state_file(first).read_text())["workdir"])
        assert workdir.is_dir()  # and the relays' configs
        out = subprocess.run(
            [*BENCH, "--cleanup", "--prefix", first], capture_output=True, text=True,
            timeout=60, env=ENV,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert sorted(json.loads(out.stdout)["removed"][first]) == sorted(
            [f"{first}-r0", f"{first}-r1", f"{first}-wan"]
        )
        assert _ours(first) == []
        assert not netns.state_file(first).exists()
        assert not workdir.exists()
        wait_for(lambda: not [p for p in pids_first if _alive(p)], "the first run's helpers gone")

        pids_second = _start_and_kill(second)
        assert len(_ours(second)) == 3
        # the next run removes what the killed one left
        proc = subprocess.run(
            [*BENCH, "--probe-only", "--regions", "2", "--scale", "0.001", "--probe-seconds",
             "0.5", "--probe-pings", "3"],
            capture_output=True, text=True, timeout=60, env=ENV,
        )  # fmt: skip
        assert proc.returncode in (0, 1), proc.stderr
        assert second in json.loads(proc.stdout)["leftovers_removed"]
        assert _ours(second) == []
        assert not netns.state_file(second).exists()
        wait_for(lambda: not [p for p in pids_second if _alive(p)], "the second run's helpers gone")
        assert foreign in netns.namespaces()
    finally:
        for prefix in (first, second):
            if netns.state_file(prefix).exists():
                netns.cleanup_prefix(prefix)
        netns.sh("ip", "netns", "del", foreign)


@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv to drop root")
def test_without_root_it_exits_2_with_one_line() -> None:
    proc = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *BENCH, "--probe-only"],
        capture_output=True, text=True, timeout=50, env=ENV,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "root" in proc.stderr


@pytest.mark.timeout(90)
def test_sigterm_mid_run_removes_everything() -> None:
    prefix = _prefix()
    bench = subprocess.Popen(
        [*BENCH, "--probe-only", "--regions", "2", "--scale", "0.001", "--prefix", prefix,
         "--probe-seconds", "20"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV,
    )  # fmt: skip
    try:
        pids = wait_for(
            lambda: len(_ours(prefix)) == 3 and len(_pids_in(prefix)) >= 3 and _pids_in(prefix),
            "the run's relay and probe servers",
            timeout_s=40,
        )
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=40) != 0
        assert _ours(prefix) == []
        assert not netns.state_file(prefix).exists()
        assert not [p for p in pids if _alive(p)]
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        if netns.state_file(prefix).exists():
            netns.cleanup_prefix(prefix)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_small_run_pushes_through_the_wan_and_reports_rounds() -> None:
    prefix = _prefix()
    proc = subprocess.run(
        [*BENCH, "--regions", "2", "--scale", "0.002", "--prefix", prefix, "--probe-seconds",
         "1", "--probe-rounds", "1", "--params", "200000", "--rounds", "2", "--compute-s", "0.2",
         "--run-timeout", "300"],
        capture_output=True, text=True, timeout=400, env=ENV,
    )  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    run = report["run"]
    assert run["errors"] == []
    assert len(run["islands"]) == 2
    for island in run["islands"]:
        assert island["failed"] == ""
        assert island["client"]["acked"] == island["client"]["pushes"] > 0
        assert [r["round"] for r in island["rounds"]] == [0, 1]
    remote = next(i for i in run["islands"] if i["links_to_shards"])
    assert remote["links_to_shards"][0]["mbit"] == pytest.approx(5.0 * 1000 * report["scale"])
    assert all(r["ratio"] > 0 for r in remote["rounds"])
    assert report["relay_bytes"]  # the relays counted what crossed the WAN
    assert _ours(prefix) == []
