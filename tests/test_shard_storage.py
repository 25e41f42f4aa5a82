"""Storage faults on a live shard: a write-ahead log that cannot grow is never acked.

The shard runs as a real subprocess; the test lowers its file-size limit
(RLIMIT_FSIZE via prlimit; Python ignores SIGXFSZ, so writes fail with EFBIG)
so appends to the log really fail, then lifts it. Works as root, where a
read-only chmod would not stop writes.
"""

from __future__ import annotations

import re
import resource
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import Peer, wait_for
from shard_helpers import delta_frames, init_payload, plan_for, push_header, small_flat
from shard_process import ShardProcess

from paramserver.server.config import ShardConfig
from paramserver.server.storage.shard_storage import ShardStorage
from paramserver.server.storage.wal import LogReader, WriteAheadLog

pytestmark = pytest.mark.timeout(60)

LOG_RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ ")  # LOG_FORMAT's head
CFG = ShardConfig(mode="async", fsync=True, checkpoint_every_steps=0, checkpoint_every_s=0)


def _limit_file_size(pid: int, size: int) -> None:
    _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (size, hard))


def test_a_log_that_cannot_grow_refuses_pushes_keeps_serving_and_recovers(tmp_path, zmq_ctx):
    shard = ShardProcess(
        tmp_path / "server", "--mode", "async", "--fsync", "true",
        "--checkpoint-every-steps", "0", "--checkpoint-every-s", "0",
        "--heartbeat-interval-s", "5", "--liveness", "20",
    )  # fmt: skip
    proc = shard.proc
    wal = tmp_path / "server" / "shard-0" / "wal-0.log"
    p = Peer(zmq_ctx, shard.router, "a")
    try:
        shard.wait_ready(zmq_ctx)
        flat = small_flat()
        plan = plan_for(flat, 1, 2)
        assert p.hello()["max_message_bytes"] == CFG.max_message_bytes
        reply, _ = p.request(
            {"kind": "init", "island": "a", "plan": plan.to_wire()}, init_payload(plan, flat)
        )
        assert reply["kind"] == "init_ok", reply
        size = plan.fragments[0].size

        def push(rnd: int):
            vec = np.full(size, 0.01 * rnd, np.float32)
            return p.request(push_header(plan, "a", rnd, 0, base_version=0), delta_frames(vec))[0]

        assert push(1)["outcome"] == "accepted"
        # a snapshot waits for the step's record (status may show it before its fsync)
        wait_for(lambda: p.snapshot(0)[0]["version"] == 1, "the step of round 1", timeout_s=30)
        good = wal.stat().st_size
        # room for part of a record: the write is cut short, then fails (EFBIG)
        _limit_file_size(proc.pid, good + 100)
        refused = [push(2), push(3)]
        for ack in refused:
            assert (ack["kind"], ack["outcome"], ack["reason"]) == (
                "ack",
                "rejected",
                "storage_error",
            )
            assert "File too large" in ack["detail"] and "send it again" in ack["detail"]
        assert wal.stat().st_size == good, "the partial record was not cut off"
        reply, _ = p.request({"kind": "snapshot", "island": "a", "fragment": 0})
        assert (reply["kind"], reply["version"]) == ("snapshot_reply", 1)
        assert p.request({"kind": "heartbeat", "island": "a"})[0]["kind"] == "heartbeat"
        status = p.status()
        assert status["rejected"] == {"storage_error": 2}
        assert status["accepted"] == 1 and status["pending"] == {"0": 0, "1": 0}

        _limit_file_size(proc.pid, resource.RLIM_INFINITY)
        assert push(2)["outcome"] == "accepted"
        wait_for(lambda: p.snapshot(0)[0]["version"] == 2, "the step of round 2", timeout_s=30)
        # stopping while the disk is full: the final checkpoint fails, the log has it all
        _limit_file_size(proc.pid, wal.stat().st_size)
    finally:
        p.close()
        code = shard.stop()
    text = shard.output
    assert code == 0, text
    # logged once a minute, not per failure: one of the shard's records names the error. Its
    # daemon.log is under the same size limit, so `logging` may also print tracebacks that
    # end "OSError: [Errno 27] File too large" for records it could not add there: not records
    records = [line for line in text.splitlines() if LOG_RECORD.match(line)]
    assert sum("File too large" in line for line in records) == 1, text
    assert "writable again after 2 failure(s)" in text, text
    left = sorted(f.name for f in wal.parent.iterdir())
    # no checkpoint, no tmp; the checkpoint's log segment was begun before its write failed
    assert left == ["daemon.log", "wal-0.log", "wal-1.log"]
    # acked => logged: a restart replays rounds 1 and 2 (never 3), with no corrupt record
    state = ShardStorage(replace(CFG, data_dir=str(tmp_path / "server")), 0).recover()
    assert state.versions() == {0: 2, 1: 0}
    assert state.counters.accepted == 2
    assert state.dedup[("a", 0)].rounds == {1, 2}


def _append_until_it_fails(path: Path, limit: int) -> str:
    """Run in a child: append 100-byte records under a file-size limit; report sizes."""
    code = f"""
import resource
from paramserver.server.storage.wal import WriteAheadLog
log = WriteAheadLog({str(path)!r})
log.append({{"n": 0}}, [b"x" * 100])
log.sync()
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    for n in range(1, 100):
        log.append({{"n": n}}, [b"x" * 100])
except OSError as exc:
    print(exc.errno, log.size, log.broken)
log.close()
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_a_failed_append_leaves_no_partial_record(tmp_path):
    path = tmp_path / "wal-0.log"
    errno, size, broken = _append_until_it_fails(path, 700)
    assert errno == "27" and broken == "False"  # EFBIG
    assert path.stat().st_size == int(size) <= 700
    records = list(LogReader(path))
    assert [r.header["n"] for r in records] == list(range(len(records)))
    log = WriteAheadLog(path)  # appending after the fault continues the same good log
    log.append({"n": len(records)}, [b"y"])
    log.close()
    reader = LogReader(path)
    assert [r.header["n"] for r in reader] == list(range(len(records) + 1))
    assert reader.torn_at is None
