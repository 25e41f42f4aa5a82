"""The client's adaptive ack timeout against a real shard process that answers late.

The shard is stopped (SIGSTOP) for 0.6-0.9 s around each push, so every ack
comes later than the client's initial 0.5 s timeout: with a fixed timeout
every delta would be re-sent. The adaptive timer re-sends during a short
warm-up, measures the latency, and then re-sends nothing; every re-send it
did make is reported as spurious (the shard answered `duplicate`).
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from conftest import Peer, wait_for
from shard_helpers import delta_frames, small_flat
from shard_process import ShardProcess

from paramserver.client import Client, ClientConfig

pytestmark = pytest.mark.timeout(120)

WAIT_S = 30.0
WARM_UP = 3  # rounds the timer may need to back off and take its first samples
ROUNDS = 9
STOPS_S = (0.7, 0.9, 0.6)  # how long the shard is stopped around round r: STOPS_S[r % 3]


def test_acks_later_than_the_initial_timeout_stop_being_re_sent_once_measured(tmp_path, zmq_ctx):
    shard = ShardProcess(
        tmp_path / "server", "--fsync", "false", "--mode", "async",
        "--heartbeat-interval-s", "0.5", "--liveness", "50", "--log-level", "WARNING",
    )  # fmt: skip
    proc = shard.proc
    try:
        shard.wait_ready(zmq_ctx)
        cfg = ClientConfig(
            connect=shard.router,
            island="late-acks",
            heartbeat_interval_s=0.5,
            liveness=20,  # a shard stopped for < 1 s is not taken for dead
            ack_timeout_s=0.5,
            ack_timeout_cap_s=10.0,
        )
        with Client(cfg) as client:
            plan = client.join(small_flat(0)).plan
            frames = delta_frames(np.full(plan.fragments[0].size, 0.01, np.float32), "int8")
            resent_after = []
            for r in range(ROUNDS):
                os.kill(proc.pid, signal.SIGSTOP)
                try:
                    client.push(0, r, 0, 100, 10, frames)
                    time.sleep(STOPS_S[r % 3])
                finally:
                    os.kill(proc.pid, signal.SIGCONT)
                wait_for(
                    lambda r=r: client.stats()["acked"] >= r + 1,
                    f"the ack of round {r}",
                    timeout_s=WAIT_S,
                )
                resent_after.append(client.stats()["resent"])
            warm_up = resent_after[WARM_UP - 1]
            assert resent_after[-1] == warm_up, (
                f"re-sends after each round {resent_after}: none expected after round "
                f"{WARM_UP - 1} (acks take 0.6-0.9 s; a fixed 0.5 s timeout re-sends each)"
            )
            stats = client.stats()
            assert stats["acked"] == ROUNDS and stats["duplicates"] == 0
            assert stats["ack_timeout_s"] > max(STOPS_S)  # learned: above the latency
            # every re-send was needless (the shard had the first copy): the shard says
            # `duplicate` to each, and the client counts them as they arrive
            wait_for(
                lambda: client.stats()["spurious_resends"] == warm_up,
                "the duplicates",
                timeout_s=WAIT_S,
            )
        probe = Peer(zmq_ctx, shard.router, "probe")
        try:
            status = probe.status()
            assert status["accepted"] == ROUNDS and status["duplicates"] == warm_up
        finally:
            probe.close()
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        assert shard.stop() == 0, shard.output
