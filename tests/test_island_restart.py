"""kill -9 of an island daemon: its unacked deltas come back from its outbox file and count
once; its restart is welcomed at once (its session token), another process with its id is not.

Real processes: a shard (`python -m paramserver.ops.cli shard`) and `diloco-worker start`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import Peer, wait_for
from shard_process import ShardProcess

from paramserver.server.fragment import AcceptEvent
from paramserver.server.storage.wal import LogReader, record_to_event
from worker import island_files, outbox

FAST = ("--model", "tiny", "--batch-size", "2", "--seq-len", "16", "--eval-every", "0")
MAX_UNACKED = 64  # 32 rounds of 2 fragments (~3 s at --speed 0.05): not blocked before the
# shard is judged down (1 s)


def worker_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "worker.cli", "start", *args]


def status(data_dir: Path) -> dict:
    return island_files.read_status(data_dir) or {}


def accepted_keys(server_dir: Path, island: str) -> list[tuple[int, int]]:
    """(round, fragment) of every delta of `island` the shard's log accepted, in log order."""
    keys = []
    for segment in sorted((server_dir / "shard-0").glob("wal-*.log")):
        for rec in LogReader(segment):
            event = record_to_event(rec)
            if isinstance(event, AcceptEvent) and event.contribution.island == island:
                keys.append((event.contribution.round, event.contribution.fragment))
    return keys


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_9_island_resends_its_unacked_deltas_once_and_is_welcomed_at_once(tmp_path, zmq_ctx):
    server_dir, data_dir = tmp_path / "server", tmp_path / "island"
    # the shard's heartbeat of 30 s: an island's connection counts as live for 60 s after it
    # was last heard, so only the session token can let the restarted island in sooner
    shard = ShardProcess(server_dir, "--mode", "async", "--heartbeat-interval-s", "30",
                         "--checkpoint-every-steps", "0", "--checkpoint-every-s", "0")  # fmt: skip
    shard.wait_ready(zmq_ctx)
    probe = Peer(zmq_ctx, shard.router, "probe")
    log_path = tmp_path / "island.log"
    log = log_path.open("w")
    args = ("--connect", shard.router, "--island", "isl", "--data-dir", str(data_dir), *FAST,
            "--inner-steps", "2", "--speed", "0.05", "--heartbeat-interval-s", "0.2",
            "--max-unacked", str(MAX_UNACKED), "--flush-timeout-s", "2")  # fmt: skip
    first = subprocess.Popen(worker_cmd(*args), stdout=log, stderr=log)
    second = intruder = None
    try:
        wait_for(lambda: status(data_dir).get("acked", 0) > 0, "the first acks", timeout_s=180)
        os.kill(shard.proc.pid, signal.SIGSTOP)  # acks are held from now on
        # the island judges the shard down after 5 heartbeats and queues its pushes; kill it
        # once a round was pushed after that (those never left the island)
        wait_for(lambda: "silent for" in log_path.read_text(), "the shard judged down",
                 timeout_s=30, poll_s=0.02)  # fmt: skip
        since = status(data_dir).get("pending", 0)
        wait_for(lambda: status(data_dir).get("pending", 0) >= since + 2, "a push after it",
                 timeout_s=30, poll_s=0.02)  # fmt: skip
        assert status(data_dir)["pending"] < MAX_UNACKED  # never blocked
        done_rounds = status(data_dir)["round"]
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        kept = outbox.load(data_dir / outbox.OUTBOX_FILE)  # written before each push left
        assert kept is not None and kept.island == "isl" and kept.torn == 0
        unacked = {(d.round, d.fragment) for d in kept.deltas}
        assert len(unacked) >= 4, unacked

        os.kill(shard.proc.pid, signal.SIGCONT)
        second = subprocess.Popen(worker_cmd(*args), stdout=log, stderr=log)
        restarted = {"pid": second.pid}  # its own status, not the killed one's

        def first_round() -> bool:
            now = status(data_dir)
            assert second.poll() is None, log_path.read_text()[-3000:]
            return now.get("pid") == restarted["pid"] and now.get("round", 0) >= 1

        wait_for(first_round, "the restarted island's first round", timeout_s=180)
        rejected = probe.status()["rejected"]
        assert rejected.get("island_in_use", 0) == 0, rejected  # welcomed at its first hello

        other = tmp_path / "other"
        intruder = subprocess.run(
            worker_cmd(*args[:4], "--data-dir", str(other), *FAST), capture_output=True,
            text=True, timeout=180,
        )  # fmt: skip
        assert intruder.returncode == 1, intruder.stderr
        assert "island id 'isl' is in use by another running island" in intruder.stderr
        assert probe.status()["rejected"]["island_in_use"] >= 1
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0
        counters = probe.status()
        applied = accepted_keys(server_dir, "isl")
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        if shard.proc.poll() is None:
            os.kill(shard.proc.pid, signal.SIGCONT)
        probe.close()
        shard.stop()
        log.close()
        print(log_path.read_text()[-6000:], shard.output[-3000:])  # shown if the test fails
    twice = [k for k, n in Counter(applied).items() if n > 1]
    assert twice == []  # none applied twice
    assert counters["accepted"] == len(applied)
    assert unacked <= set(applied)  # every delta left unacked at the kill, applied
    base = min(r for r, _ in applied)  # the first run's round 0
    first_run = {(r, f) for r, f in applied if r - base < 1_000}
    # the rounds the session handed over at the kill, less the one the push thread may still
    # have been framing (overlap_rounds=1: a round is durable once persisted, not once returned)
    assert first_run >= {(base + r, f) for r in range(done_rounds - 1) for f in (0, 1)}
    assert not (data_dir / outbox.OUTBOX_FILE).exists()  # all resolved at the graceful stop
    assert island_files.read_rows(data_dir)[-1]["rejected"] == 0
