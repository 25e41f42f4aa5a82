"""Islands as the real client drives them: a healthy join shows no rejections; a stalled shard
lets the island's reconnect in quickly. Real shards (threads or a subprocess), real sockets."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from conftest import Peer, free_port
from shard_helpers import delta_frames, small_flat
from shard_process import ShardProcess

from paramserver.client import Client, ClientConfig
from paramserver.server.config import ShardConfig
from paramserver.server.shard import ShardServer

pytestmark = pytest.mark.timeout(90)

WAIT_S = 30.0


def _poll(predicate, what: str, timeout_s: float = WAIT_S, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every_s)


@pytest.fixture
def two_shards(tmp_path):
    """Two ShardServers in threads, advertising the endpoints they bind."""
    cfg = ShardConfig(
        data_dir=str(tmp_path / "server"),
        fsync=False,
        shards=2,
        mode="async",
        heartbeat_interval_s=0.2,
    )
    endpoints = [(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}") for _ in "ab"]
    stops, threads, servers = [], [], []
    for i, (router, pub) in enumerate(endpoints):
        server = ShardServer(cfg, i, endpoints, router_bind=router, pub_bind=pub)
        stop = threading.Event()
        thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
        thread.start()
        assert server.ready.wait(WAIT_S), "shard did not start"
        stops.append(stop), threads.append(thread), servers.append(server)
    yield endpoints
    for stop, thread in zip(stops, threads, strict=True):
        stop.set()
        thread.join(WAIT_S)
        assert not thread.is_alive()


def test_a_healthy_two_shard_join_with_heartbeats_shows_no_rejections(two_shards, zmq_ctx):
    watchers = [Peer(zmq_ctx, router, "watcher") for router, _ in two_shards]
    try:
        cfg = ClientConfig(connect=two_shards[0][0], island="i1", heartbeat_interval_s=0.2)
        with Client(cfg) as client:
            client.join(small_flat(0))
            # the island is live on both shards: it heartbeats both (and says hello where asked)
            _poll(
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
            _poll(lambda: client.stats()["acked"] >= 1, "the first ack")
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                _poll(lambda: client.stats()["reconnects"] >= 1, "the client to reconnect")
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            resumed = time.monotonic()
            client.push(0, 2, 0, 100, 10, frames)
            _poll(lambda: client.stats()["acked"] >= 2, "the ack after the reconnect", 10.0)
            assert time.monotonic() - resumed < 5.0
            status = probe.status()
            assert status["islands_live"] == ["i1"] and status["accepted"] == 2
    finally:
        probe.close()
        assert shard.stop() == 0, shard.output
