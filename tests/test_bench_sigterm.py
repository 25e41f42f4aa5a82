"""A bench ended by SIGTERM (`timeout`, a scheduler) stops the daemons it started, as on Ctrl-C.

A real `diloco-bench session_overhead` run starts a local server (a detached
supervisor and its shards, in their own sessions); once it serves, the bench
gets SIGTERM the way coreutils `timeout` sends it: to the bench, then to its
process group (two signals). Every daemon must be gone afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.launcher import LocalCluster
from paramserver.plumbing import daemon, probe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _wait_for(check, timeout_s: float, what: str, proc: subprocess.Popen) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        if proc.poll() is not None:
            raise AssertionError(f"the bench exited ({proc.returncode}) before {what}")
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout_s} s")


def _ready(ready: Path) -> dict | None:
    try:
        return json.loads(ready.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _island_joined(router: str) -> bool:
    """Whether an island said hello to the shard at `router` (the bench is past its start)."""
    try:
        shards = probe.cluster_status(router, timeout_s=2.0)["shards"]
    except probe.ProbeError:
        return False
    return any(s.get("islands_known", 0) >= 1 for s in shards)


def test_sigterm_as_timeout_sends_it_stops_every_daemon_the_bench_started(tmp_path):
    out = tmp_path / "o"
    argv = [sys.executable, "-m", "bench.cli", "session_overhead", "--rounds", "100000",
            "--inner-steps", "5", "--hidden", "64", "--batch", "16", "--out", str(out)]  # fmt: skip
    log = (tmp_path / "bench.log").open("w+")
    bench = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    pids: list[int] = []
    try:
        ready = out / "mlp" / "server" / "ready.json"  # the supervisor's, once every shard serves
        info = _wait_for(lambda: _ready(ready), 90.0, "a serving server", bench)
        pids = [info["pid"], *info["shard_pids"]]
        assert all(daemon.pid_alive(p) for p in pids), pids
        # the bench's island joined: its server start returned (a SIGTERM while
        # `diloco-server start` still runs is not what this test covers)
        router = info["endpoints"][0][0]
        _wait_for(lambda: _island_joined(router), 90.0, "the bench's island", bench)
        os.kill(bench.pid, signal.SIGTERM)  # as `timeout` does: the command, then its group
        os.killpg(bench.pid, signal.SIGTERM)
        code = bench.wait(60)
        alive = [p for p in pids if daemon.pid_alive(p)]
        deadline = time.monotonic() + 10.0  # the supervisor reaps its shards as it exits
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [p for p in pids if daemon.pid_alive(p)]
        log.seek(0)
        assert not alive, f"daemons left alive: {alive}\n{log.read()[-2000:]}"
        assert code == 128 + signal.SIGTERM, log.read()[-2000:]
    finally:
        for pid in [bench.pid, *pids]:
            if daemon.pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        if bench.poll() is None:
            bench.wait(10)
        log.close()


def test_a_server_whose_stop_fails_is_killed_by_the_cluster_that_started_it(tmp_path, capsys):
    """`diloco-server stop` can fail (a pid file lost or taken for stale); the bench's
    cluster still stops what it started, and says so."""
    cluster = LocalCluster(tmp_path / "c", shards=1)
    pids: list[int] = []
    try:
        cluster.start_server()
        info = json.loads((cluster.server_dir / "ready.json").read_text())
        pids = [info["pid"], *info["shard_pids"]]
        assert len(pids) == 2 and all(daemon.pid_alive(p) for p in pids)
        for d in (cluster.server_dir, cluster.shard_dir(0)):  # the stop finds no server
            daemon.pid_path(d).unlink()
        cluster.stop()
        assert not [p for p in pids if daemon.pid_alive(p)]
        err = capsys.readouterr().err
        assert "no diloco-server is running" in err and "outlived their stop" in err, err
    finally:
        for pid in pids:
            if daemon.pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
