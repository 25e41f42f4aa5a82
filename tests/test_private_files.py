"""Private files: a shard's data dir is 0700 and its log, checkpoints, pid and log files 0600, whatever the umask.

The shard runs as a real subprocess started under umask 0o022 (which would
leave files 0644 and directories 0755); it is initialized, takes a push and
stops, writing a checkpoint. `daemon.spawn`'s log file is checked the same way.
"""

from __future__ import annotations

import os
import stat
import sys

import numpy as np
import pytest
from conftest import Peer, wait_for
from shard_helpers import delta_frames, init_payload, plan_for, push_header, small_flat
from shard_process import ShardProcess

from paramserver.plumbing import daemon
from paramserver.server.storage.wal import WriteAheadLog

pytestmark = pytest.mark.timeout(120)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_a_shards_files_are_private_under_umask_022(tmp_path, zmq_ctx, umask_022):
    data = tmp_path / "cluster" / "server"  # neither exists yet: the shard makes both
    shard = ShardProcess(data, "--mode", "async", "--checkpoint-every-steps", "1")
    p = Peer(zmq_ctx, shard.router, "a")
    directory = data / "shard-0"
    try:
        shard.wait_ready(zmq_ctx)
        flat = small_flat()
        plan = plan_for(flat, 1, 2)
        p.hello()
        reply, _ = p.request(
            {"kind": "init", "island": "a", "plan": plan.to_wire()}, init_payload(plan, flat)
        )
        assert reply["kind"] == "init_ok", reply
        vec = np.full(plan.fragments[0].size, 0.01, np.float32)
        ack, _ = p.request(push_header(plan, "a", 1, 0), delta_frames(vec))
        assert ack["outcome"] == "accepted", ack
        wait_for(lambda: list(directory.glob("checkpoint-*.ckpt")), "a checkpoint", timeout_s=60)
        assert mode(directory / "daemon.pid") == 0o600
    finally:
        p.close()
        assert shard.stop() == 0, shard.output
    files = sorted(f.name for f in directory.iterdir())
    assert "daemon.log" in files and any(f.startswith("wal-") for f in files), files
    for name in files:
        assert mode(directory / name) == 0o600, (name, oct(mode(directory / name)))
    assert mode(directory) == 0o700
    assert mode(data) == 0o700 and mode(data.parent) == 0o700


def test_an_older_logs_wider_mode_is_tightened_when_opened(tmp_path, umask_022):
    path = tmp_path / "wal-0.log"
    WriteAheadLog(path, fsync=False).close()
    os.chmod(path, 0o644)
    WriteAheadLog(path, fsync=False).close()
    assert mode(path) == 0o600


def test_a_spawned_daemons_log_is_private(tmp_path, umask_022):
    log = tmp_path / "logs" / "daemon.log"
    proc = daemon.spawn([sys.executable, "-c", "print('hi')"], log, tmp_path / "run" / "ready")
    try:
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert log.read_text().strip() == "hi"
    assert mode(log) == 0o600 and mode(log.parent) == 0o700
    assert mode(tmp_path / "run") == 0o700
