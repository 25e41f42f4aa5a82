"""The ack timer against a real shard process that is SIGSTOPped for a while.

No push is re-sent before the timer's bound (the timeout it stood at when the
push went out, from the latency of the acks before), and the needless re-send
that a long stall causes raises the timer to the latency it saw.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from conftest import wait_for
from shard_helpers import delta_frames, small_flat
from shard_process import ShardProcess

from paramserver.client import Client, ClientConfig

pytestmark = pytest.mark.timeout(120)


def test_a_stalled_shard_gets_no_re_send_before_the_timer_bound(tmp_path, zmq_ctx):
    shard = ShardProcess(
        tmp_path / "server", "--fsync", "false", "--mode", "async",
        "--heartbeat-interval-s", "0.2", "--liveness", "500", "--log-level", "WARNING",
    )  # fmt: skip
    resumed = True
    try:
        shard.wait_ready(zmq_ctx)
        cfg = ClientConfig(
            connect=shard.router, island="i1", heartbeat_interval_s=0.2, liveness=500,
            ack_timeout_s=2.0, ack_timeout_floor_s=1.0,
        )  # fmt: skip
        with Client(cfg) as client:
            plan = client.join(small_flat(0)).plan
            frames = delta_frames(np.full(plan.fragments[0].size, 0.01, np.float32), "int8")
            for r in range(1, 5):  # fast acks: the timer learns a small latency
                client.push(0, r, 0, 100, 10, frames)
            wait_for(lambda: client.stats()["acked"] >= 4, "the first acks")
            bound = client.stats()["ack_timeout_s"]
            assert 1.0 <= bound <= 2.0  # at its floor or on the way down from 2 s
            os.kill(shard.proc.pid, signal.SIGSTOP)
            resumed = False
            pushed_before = time.monotonic()
            client.push(0, 5, 0, 100, 10, frames)
            wait_for(lambda: client.stats()["resent"] >= 1, "the timer's re-send")
            seen = time.monotonic()  # at or after the re-send, which came after push + bound
            assert seen - pushed_before >= bound
            os.kill(shard.proc.pid, signal.SIGCONT)
            resumed = True
            # the first copy is accepted, the re-send answered duplicate: a needless re-send,
            # whose first copy's latency (>= bound) raises the timer
            wait_for(lambda: client.stats()["spurious_resends"] >= 1, "the duplicate ack")
            assert client.stats()["acked"] == 5
            assert client.stats()["ack_timeout_s"] >= bound * 2
    finally:
        if not resumed:
            os.kill(shard.proc.pid, signal.SIGCONT)
        assert shard.stop() == 0, shard.output
