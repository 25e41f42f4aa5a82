"""`diloco-worker start` when things go wrong: the server gone, the id in use, a bad data
dir, nobody listening. Real worker processes; real shards in threads; real sockets."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import Cluster, free_port, wait_for

from worker import island_files, outbox

FAST = ("--model", "tiny", "--batch-size", "2", "--seq-len", "16", "--eval-every", "0")


def worker_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "worker.cli", "start", *args]


def island_status(data_dir: Path) -> dict:
    return island_files.read_status(data_dir) or {}


def counted(cluster: Cluster) -> int:
    """Deltas shard 0 accepted or acked as duplicates (its counters survive restarts)."""
    counters = cluster.servers[0].state.counters
    return counters.accepted + counters.duplicates


def error_lines(stderr: str) -> list[str]:
    """The lines diloco-worker itself printed (log records carry a timestamp first)."""
    return [line for line in stderr.splitlines() if line.startswith("diloco-worker:")]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_island_stops_in_seconds_without_its_server_and_resends_its_deltas_at_restart(
    tmp_path,
):
    cluster = Cluster(tmp_path, shards=1)
    data_dir = tmp_path / "island"
    log = (tmp_path / "island.log").open("w")
    args = ("--connect", cluster.connect, "--island", "isl", "--data-dir", str(data_dir))
    args = (*args, *FAST, "--inner-steps", "1", "--heartbeat-interval-s", "0.2")
    args = (*args, "--flush-timeout-s", "1")
    proc = subprocess.Popen(worker_cmd(*args), stdout=log, stderr=log)
    try:
        wait_for(
            lambda: island_status(data_dir).get("acked", 0) > 0, "the first acks", timeout_s=180
        )
        cluster.stop_shard(0)  # the server is gone
        before = counted(cluster)
        gone = island_status(data_dir).get("round", 0)

        def blocked() -> bool:  # the next round does not fit under max_unacked (16): it blocks
            status = island_status(data_dir)
            full = status.get("pending", 0) > 16 - cluster.cfg.num_fragments
            return status.get("round", 0) > gone and full

        wait_for(blocked, "a full buffer of unacked deltas", timeout_s=60, poll_s=0.05)
        proc.send_signal(signal.SIGTERM)
        try:  # a blocked island still hears SIGTERM: it exits, not waits for its acks
            assert proc.wait(timeout=30) == 0
        except subprocess.TimeoutExpired:
            pytest.fail("the island ignored SIGTERM while blocked")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    saved = outbox.load(data_dir / outbox.OUTBOX_FILE)
    assert saved is not None and saved.island == "isl"
    kept = len(saved.deltas)
    assert kept >= 16  # the blocked round's deltas too: queued past the limit once stopped
    assert len({(d.fragment, d.round) for d in saved.deltas}) == kept

    cluster.start(0)  # same ports, same data dir
    try:
        again = subprocess.run(
            worker_cmd(*args, "--max-rounds", "1"), stdout=log, stderr=log, timeout=180
        )
        assert again.returncode == 0
        after = counted(cluster)
    finally:
        cluster.stop()
        log.close()
    assert not (data_dir / outbox.OUTBOX_FILE).exists()  # removed once resolved
    final = island_files.read_rows(data_dir)[-1]
    fragments = cluster.cfg.num_fragments
    assert final["final"] and final["rejected"] == 0
    assert final["pushes"] == final["acked"] == kept + fragments  # the kept ones, one round
    assert after - before == kept + fragments  # each answered once by the restarted shard


@pytest.mark.timeout(120)
def test_a_second_island_with_a_live_id_exits_non_zero_with_one_line(start_shard, peer, tmp_path):
    shard = start_shard(heartbeat_interval_s=30.0)  # the first island's binding stays live
    peer(shard.router, "dup").hello()
    proc = subprocess.run(
        worker_cmd("--connect", shard.router, "--island", "dup", "--data-dir", str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = error_lines(proc.stderr)
    assert "island id 'dup' is in use by another running island" in line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("detach", [(), ("--detach",)])
def test_an_unusable_data_dir_is_one_clear_line(tmp_path, detach):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    proc = subprocess.run(
        worker_cmd("--data-dir", str(afile / "sub"), *detach),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"diloco-worker: cannot use --data-dir {afile / 'sub'}: Not a directory "
        f"({afile / 'sub'}); give a writable directory"
    ]


@pytest.mark.timeout(120)
def test_a_worker_without_a_server_says_it_waits_and_gives_up_at_the_join_timeout(tmp_path):
    port = free_port()  # nothing listens here
    proc = subprocess.Popen(
        worker_cmd("--connect", f"tcp://127.0.0.1:{port}", "--join-timeout-s", "3",
                   "--data-dir", str(tmp_path)),
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in proc.stderr:
            lines.append((time.monotonic(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert proc.wait(timeout=100) == 1
    exited = time.monotonic()
    reader.join(10)
    text = "\n".join(line for _, line in lines)
    assert "Traceback" not in text
    waiting = [
        t for t, line in lines if f"waiting for the server at tcp://127.0.0.1:{port}" in line
    ]
    assert waiting, text
    assert exited - waiting[0] > 2.5  # it waited out the join timeout (3 s, not 60: below)
    (line,) = error_lines(text)
    assert f"127.0.0.1:{port}" in line and "within 3s" in line
