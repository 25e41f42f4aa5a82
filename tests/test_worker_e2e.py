"""Islands as real `diloco-worker` daemons training through real `diloco-server` shards.

Everything here is a subprocess talking ZeroMQ over 127.0.0.1 on random ports.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from conftest import wait_for

from bench.launcher import IslandSpec, LocalCluster
from paramserver.plumbing import daemon
from worker.data import default_corpus, unigram_entropy

UNIGRAM_NATS = unigram_entropy(default_corpus())
TINY_FAST = ("--model", "tiny", "--batch-size", "8", "--seq-len", "64", "--eval-every", "1")


def versions_total(cluster: LocalCluster) -> int:
    status = cluster.server_status()
    return sum(sum(s.get("versions", {}).values()) for s in status.get("shards", []))


def worker(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@pytest.fixture
def cluster(tmp_path):
    # quorum 1: the fast island never waits for the slow one (grace window still merges both)
    with LocalCluster(tmp_path / "run", shards=2, server_args=("--quorum", "1")) as c:
        c.start_server()
        yield c


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_islands_one_slow_train_below_unigram_entropy_and_a_wrong_model_is_refused(cluster):
    rounds = ("--inner-steps", "10", "--max-rounds", "10", *TINY_FAST)
    cluster.start_islands([IslandSpec("fast", 1.0, rounds), IslandSpec("slow", 0.5, rounds)])
    for name in ("fast", "slow"):
        wait_for(
            lambda n=name: cluster.island_status(n).get("state") == "stopped",
            f"island {name} to finish its rounds",
            timeout_s=420,
        )
    evals = [
        r["eval_global"]
        for name in ("fast", "slow")
        for r in cluster.island_metrics(name)
        if "eval_global" in r
    ]
    assert evals[0] > 5.0  # untrained byte model: about ln(256)
    final = min(cluster.island_metrics("fast")[-2]["eval_global"], evals[-1])
    assert final < UNIGRAM_NATS - 0.4, f"global eval loss {final:.3f} not well below unigram"
    status = cluster.server_status()
    assert sum(s["accepted"] for s in status["shards"]) >= 2 * 10 * 2  # both islands contributed
    for name in ("fast", "slow"):
        last = cluster.island_metrics(name)[-1]
        assert last["final"] and last["acked"] == last["pushes"] >= 10  # a push a round at least
        assert last["bytes_sent"] > 0 and last["bytes_received"] > 0
    # a model that differs from the cluster's is refused at join, with a clear message
    proc = worker(
        "start", "--connect", cluster.connect, "--island", "other", "--model", "small",
        "--data-dir", str(cluster.island_dir("other")),
    )  # fmt: skip
    assert proc.returncode == 1
    assert "plan mismatch" in proc.stderr
    assert "here, float32[256, 64] in the cluster's model" in proc.stderr  # the first leaf
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_island_rejoins_and_the_other_keeps_advancing(cluster):
    flags = ("--inner-steps", "5", "--heartbeat-interval-s", "0.5", *TINY_FAST)
    cluster.start_islands([IslandSpec("a", 1.0, flags), IslandSpec("b", 1.0, flags)])
    wait_for(
        lambda: cluster.island_status("b").get("round", 0) >= 2, "island b's rounds", timeout_s=300
    )
    pid = daemon.running_pid(daemon.pid_path(cluster.island_dir("b")))
    assert pid
    os.kill(pid, signal.SIGKILL)
    assert daemon.wait_exit(pid, 30)
    killed_at = versions_total(cluster)
    wait_for(
        lambda: versions_total(cluster) >= killed_at + 4,
        "versions to advance with island b dead",
        timeout_s=300,
    )
    rounds_before = len(cluster.island_metrics("b"))
    # same id, same data dir: the stale pid file is detected and replaced
    cluster.start_islands([IslandSpec("b", 1.0, flags)])
    wait_for(
        lambda: (
            cluster.island_status("b").get("acked", 0) > 0
            and len(cluster.island_metrics("b")) > rounds_before + 1
        ),
        "restarted island b to contribute again",
        timeout_s=300,
    )
    log = (cluster.island_dir("b") / "daemon.log").read_text()
    assert log.count("joined") >= 2
    # each start ran its CPU computations inline (worker.cpu_dispatch: RSS keeps its level)
    assert log.count("JAX dispatches CPU computations: inline") >= 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--model", "huge"), "model='huge': must be one of tiny, small, base"),
        (("--speed", "0"), "speed=0.0: must be a finite number > 0"),
        (("--speed", "fast"), "--speed"),
        (("--merge-rule", "average"), "merge_rule='average': must be one of"),
    ],
)
def test_bad_config_is_one_clear_line(tmp_path, flags, message):
    proc = worker("start", "--data-dir", str(tmp_path), *flags)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.serial  # compares the islands' measured waits: each needs its own core
@pytest.mark.timeout(600)
def test_sync_mode_paces_the_fast_island_and_its_wait_is_lost_goodput(tmp_path):
    # Synchronous DiLoCo: after each push an island waits until the shards merged its round.
    # With one island at half speed the fast one can never run more than a round ahead, and
    # the time it waits shows as goodput of about 0.5 (never as a stall).
    start = tmp_path / "start"
    rounds = ("--inner-steps", "30", "--max-rounds", "3", *TINY_FAST, "--eval-every", "0")
    rounds = (*rounds, "--start-file", str(start))
    with LocalCluster(tmp_path / "run", shards=2, server_args=("--mode", "sync")) as c:
        c.start_server()
        c.start_islands([IslandSpec("fast", 1.0, rounds), IslandSpec("slow", 0.5, rounds)])
        start.touch()  # both joined and compiled: start together
        worst_lead = 0

        def finished() -> bool:
            nonlocal worst_lead
            fast, slow = c.island_status("fast"), c.island_status("slow")
            worst_lead = max(worst_lead, fast.get("round", 0) - slow.get("round", 0))
            return fast.get("state") == "stopped" and slow.get("state") == "stopped"

        wait_for(
            finished, "both islands to finish 3 synchronous rounds", timeout_s=480, poll_s=0.05
        )
        fast_rows = [r for r in c.island_metrics("fast") if r.get("round", 0) >= 1]
        slow_rows = [r for r in c.island_metrics("slow") if r.get("round", 0) >= 1]
        status = c.server_status()
    assert worst_lead <= 1, f"fast island ran {worst_lead} rounds ahead in sync mode"
    assert sum(s["steps"] for s in status["shards"]) == 3 * 4  # 3 outer steps x 4 fragments
    fast, slow = fast_rows[-1], slow_rows[-1]
    assert fast["final"] and slow["final"]
    assert fast["credited_tokens"] == fast["tokens"]  # every round merged, never stale
    # the fast island waits for the slow one each round, and that wait is its lost goodput
    # (orderings that hold on any machine: the slow island's steps are padded to twice theirs)
    assert fast["wait_s"] > slow["wait_s"], (fast, slow)
    assert fast["goodput"] < slow["goodput"], (fast, slow)


@pytest.mark.timeout(60)
def test_control_commands_import_no_jax():
    # stop / status must answer fast and work where JAX is broken: they never import it
    code = "import sys, worker.cli, worker.config; sys.exit('jax' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, "importing worker.cli pulled in jax"
