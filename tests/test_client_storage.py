"""The client against a shard whose disk fails: a `storage_error` refusal keeps the delta.

The shard is a real subprocess; its file-size limit (RLIMIT_FSIZE via prlimit)
makes appends to its write-ahead log fail, then is lifted.
"""

from __future__ import annotations

import resource

import numpy as np
import pytest
from conftest import wait_for
from shard_helpers import delta_frames, small_flat
from shard_process import ShardProcess

from paramserver.client import Client, ClientConfig


@pytest.mark.timeout(60)
def test_a_push_refused_with_storage_error_is_kept_and_accepted_once_writes_succeed(
    tmp_path, zmq_ctx
):
    flags = ("--mode", "async", "--fsync", "true", "--checkpoint-every-steps", "0")
    shard = ShardProcess(tmp_path / "server", *flags, "--checkpoint-every-s", "0")
    wal = tmp_path / "server" / "shard-0" / "wal-0.log"
    settings = {"heartbeat_interval_s": 0.2, "ack_timeout_s": 0.2, "ack_timeout_cap_s": 0.4}
    client = Client(ClientConfig(connect=shard.router, island="a", **settings))
    try:
        shard.wait_ready(zmq_ctx)
        res = client.join(small_flat(0))
        _, hard = resource.prlimit(shard.proc.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(shard.proc.pid, resource.RLIMIT_FSIZE, (wal.stat().st_size + 100, hard))
        delta = np.full(res.plan.fragments[0].size, 0.01, np.float32)
        client.push(0, 1, res.versions[0], 100, 5, delta_frames(delta))
        # refused, re-sent after the back-off, refused again: kept all along
        wait_for(
            lambda: client.stats()["deferred"] >= 2, "two storage_error refusals", timeout_s=30
        )
        stats = client.stats()
        assert (stats["acked"], stats["pending"], stats["rejected"]) == (0, 1, {})
        resource.prlimit(shard.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, hard))
        wait_for(
            lambda: client.stats()["acked"] == 1, "the ack once the log can grow", timeout_s=30
        )
        stats = client.stats()
        assert stats["pending"] == 0 and stats["rejected"] == {} and stats["duplicates"] == 0
    finally:
        client.close(flush_timeout_s=1.0)
        assert shard.stop() == 0, shard.output
