"""Islands as the real client drives them: a healthy join shows no rejections; a stalled shard
lets the island's reconnect in quickly. Real shards (threads or a subprocess), real sockets."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from conftest import Peer, wait_for
from shard_helpers import delta_frames, small_flat
from shard_process import ShardProcess

from paramserver.client import Client, ClientConfig

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def two_shards(cluster):
    """Two shards in threads, advertising the endpoints they bind."""
    return cluster(2).endpoints


def test_a_healthy_two_shard_join_with_heartbeats_shows_no_rejections(two_shards, zmq_ctx):
    watchers = [Peer(zmq_ctx, router, "watcher") for router, _ in two_shards]
    try:
        cfg = ClientConfig(connect=two_shards[0][0], island="i1", heartbeat_interval_s=0.2)
        with Client(cfg) as client:
            client.join(small_flat(0))
            # the island is live on both shards: it heartbeats both (and says hello where asked)
            wait_for(
                lambda: all("i1" in w.status()["islands_live"] for w in watchers),
                "the island to be live on both shards",
            )
            for w in watchers:
                status = w.status()
                assert status["rejected"] == {}, status
    finally:
        for w in watchers:
            w.close()


def test_an_island_reconnecting_to_a_stalled_shard_gets_its_id_back_quickly(tmp_path, zmq_ctx):
    """SIGSTOP the shard until the client reconnects (new socket, old one closed); on SIGCONT
    the shard may still have the old connection's heartbeats queued, so the first hello can
    be refused island_in_use; the island must be back within a few heartbeat intervals."""
    shard = ShardProcess(
        tmp_path / "server", "--fsync", "false", "--mode", "async",
        "--heartbeat-interval-s", "0.2", "--liveness", "50", "--log-level", "WARNING",
    )  # fmt: skip
    proc, router = shard.proc, shard.router
    probe = Peer(zmq_ctx, router, "probe")
    try:
        shard.wait_ready(zmq_ctx)
        cfg = ClientConfig(connect=router, island="i1", heartbeat_interval_s=0.2, liveness=3)
        with Client(cfg) as client:
            plan = client.join(small_flat(0)).plan
            frames = delta_frames(np.full(plan.fragments[0].size, 0.01, np.float32), "int8")
            client.push(0, 1, 0, 100, 10, frames)
            wait_for(lambda: client.stats()["acked"] >= 1, "the first ack")
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                wait_for(lambda: client.stats()["reconnects"] >= 1, "the client to reconnect")
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            client.push(0, 2, 0, 100, 10, frames)
            wait_for(lambda: client.stats()["acked"] >= 2, "the ack after the reconnect")
            status = probe.status()
            assert status["islands_live"] == ["i1"] and status["accepted"] == 2
    finally:
        probe.close()
        assert shard.stop() == 0, shard.output
