"""The client against real ShardServer instances (threads, real sockets on 127.0.0.1)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import free_port
from shard_helpers import delta_frames, nan_frames, small_flat

from paramserver import protocol
from paramserver.client import Client, ClientConfig, ClientError
from paramserver.config import ShardConfig
from paramserver.shard import ShardServer

WAIT_S = 20.0


class Cluster:
    """N shards serving in threads, with the endpoints they advertise matching their binds."""

    def __init__(self, tmp_path, shards: int = 1, **overrides) -> None:
        settings = {"mode": "async", "heartbeat_interval_s": 0.2, **overrides}
        self.cfg = ShardConfig(
            data_dir=str(tmp_path / "server"), fsync=False, shards=shards, **settings
        )
        self.endpoints = [
            (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
            for _ in range(shards)
        ]
        self.servers: list = [None] * shards
        self.threads: list = [None] * shards
        self.stops: list = [None] * shards
        for i in range(shards):
            self.start(i)

    def start(self, i: int) -> None:
        """Start (or restart, on the same ports and data dir) shard i."""
        router, pub = self.endpoints[i]
        server = ShardServer(self.cfg, i, self.endpoints, router_bind=router, pub_bind=pub)
        stop = threading.Event()
        thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
        thread.start()
        self.servers[i], self.threads[i], self.stops[i] = server, thread, stop
        assert server.ready.wait(WAIT_S), "shard did not start"

    def stop_shard(self, i: int) -> None:
        self.stops[i].set()
        self.threads[i].join(WAIT_S)
        assert not self.threads[i].is_alive()

    @property
    def connect(self) -> str:
        return self.endpoints[0][0]

    def stop(self) -> None:
        for i in range(len(self.threads)):
            self.stop_shard(i)


@pytest.fixture
def cluster(tmp_path):
    made = []

    def make(shards: int = 1, **overrides) -> Cluster:
        c = Cluster(tmp_path, shards, **overrides)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


@pytest.fixture
def client():
    made = []

    def make(connect: str, island: str, **overrides) -> Client:
        settings = {"heartbeat_interval_s": 0.2, "join_timeout_s": WAIT_S, **overrides}
        cfg = ClientConfig(connect=connect, island=island, **settings)
        c = Client(cfg)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close(flush_timeout_s=1.0)


def wait_for(predicate, what: str):
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def snapshot(peer, fragment):
    reply, payload = peer.request({"kind": "snapshot", "island": "peer", "fragment": fragment})
    assert reply["kind"] == "snapshot_reply", reply
    import codec

    return reply["version"], codec.decode(payload)["values"]


@pytest.mark.parametrize("shards", [1, 2])
def test_first_join_initializes_and_second_gets_the_same_params(cluster, client, shards):
    c = cluster(shards)
    flat = small_flat(0)
    first = client(c.connect, "a").join(flat)
    assert first.plan.num_shards == shards
    assert set(first.versions) == set(range(first.plan.num_fragments))
    for name, value in flat.items():
        np.testing.assert_array_equal(first.params[name], value)
        assert first.params[name].dtype == np.float32

    b = client(c.connect, "b")
    second = b.join(small_flat(1))  # other values, same shapes: the cluster's values win
    assert second.plan.hash == first.plan.hash
    assert second.versions == first.versions
    for name, value in flat.items():
        np.testing.assert_array_equal(second.params[name], value)
    assert b.stats()["snapshots"] == first.plan.num_fragments


def test_plan_mismatch_names_both_hashes(cluster, client):
    c = cluster(1)
    res = client(c.connect, "a").join(small_flat(0))
    other = {"a/w": np.zeros((8, 15), np.float32), "b": np.zeros(40, np.float32)}
    with pytest.raises(
        ClientError,
        match=rf"plan mismatch: the cluster's plan hash is {res.plan.hash}, this island's is \w+",
    ):
        client(c.connect, "b").join(other)


def test_push_is_acked_and_the_update_equals_the_shards_snapshot(cluster, client, peer):
    c = cluster(2)
    a = client(c.connect, "a")
    res = a.join(small_flat(0))
    fragment = res.plan.fragments_of(1)[0].index
    size = res.plan.fragments[fragment].size
    delta = np.full(size, 0.01, np.float32)
    a.push(fragment, 0, res.versions[fragment], 1000, 10, delta_frames(delta))

    wait_for(lambda: a.stats()["acked"] == 1, "the ack")
    updates = []
    wait_for(lambda: updates.extend(a.poll_updates()) or updates, "the update")
    (update,) = updates
    assert update.fragment == fragment and update.version == res.versions[fragment] + 1
    version, values = snapshot(peer(c.endpoints[1][0]), fragment)
    assert version == update.version
    np.testing.assert_array_equal(update.values, values)  # bit-exact replica
    assert not np.array_equal(values, res.plan.gather(res.params, fragment))

    stats = a.stats()
    assert stats["pushes"] == 1 and stats["pending"] == 0 and stats["rejected"] == {}
    assert stats["updates_applied"] == 1 and stats["version_lag"] == 0
    assert stats["bytes_sent"] >= protocol.message_bytes(delta_frames(delta))
    assert stats["bytes_received"] >= size * 4 * (res.plan.num_fragments + 1)


def test_duplicate_resend_is_acked_as_duplicate_and_not_applied_twice(cluster, client, peer):
    c = cluster(1)
    a = client(c.connect, "a")
    res = a.join(small_flat(0))
    delta = np.full(res.plan.fragments[0].size, 0.5, np.float32)
    a.push(0, 7, res.versions[0], 100, 5, delta_frames(delta))
    wait_for(lambda: a.stats()["acked"] == 1, "the first ack")
    a.push(0, 7, res.versions[0], 100, 5, delta_frames(delta))  # same key again
    wait_for(lambda: a.stats()["acked"] == 2, "the second ack")
    assert a.stats()["duplicates"] == 1
    status = peer(c.connect).status()
    assert status["accepted"] == 1 and status["duplicates"] == 1
    assert status["versions"]["0"] == res.versions[0] + 1


def test_rejected_push_is_counted_by_reason(cluster, client):
    c = cluster(1)
    a = client(c.connect, "a")
    res = a.join(small_flat(0))
    a.push(0, 1, res.versions[0], 100, 5, nan_frames(res.plan.fragments[0].size))
    wait_for(lambda: a.stats()["rejected"], "the rejection")
    assert a.stats()["rejected"] == {"non_finite": 1}
    assert a.stats()["acked"] == 0
    assert a.stats()["pending"] == 0


def test_full_pending_buffer_defers_the_push_instead_of_dropping_it(cluster, client):
    # sync mode with two islands: nothing merges until b contributes, and a may keep
    # only one unmerged delta per fragment on the shard
    c = cluster(1, mode="sync", max_pending_per_island=1)
    # a long ack timeout: only the published step can trigger the re-send in time
    a = client(c.connect, "a", ack_timeout_s=30.0, ack_timeout_cap_s=60.0)
    b = client(c.connect, "b")
    res = a.join(small_flat(0))
    b.join(small_flat(0))
    size = res.plan.fragments[0].size
    a.push(0, 1, 0, 10, 1, delta_frames(np.full(size, 0.1, np.float32)))
    a.push(0, 2, 0, 10, 1, delta_frames(np.full(size, 0.2, np.float32)))
    wait_for(lambda: a.stats()["deferred"] >= 1, "the shard to refuse a's second delta for now")
    assert a.stats()["acked"] == 1 and a.stats()["pending"] == 1 and not a.stats()["rejected"]
    b.push(0, 1, 0, 10, 1, delta_frames(np.full(size, 0.3, np.float32)))  # quorum -> step
    wait_for(lambda: a.stats()["acked"] == 2, "the deferred delta to be re-sent after the step")
    assert a.stats()["pending"] == 0 and not a.stats()["rejected"]


def test_updates_from_another_island_reach_every_replica(cluster, client):
    c = cluster(2)
    a, b = client(c.connect, "a"), client(c.connect, "b")
    res = a.join(small_flat(0))
    b.join(small_flat(0))
    for fragment in range(res.plan.num_fragments):
        size = res.plan.fragments[fragment].size
        a.push(fragment, 0, 0, 10, 1, delta_frames(np.full(size, 0.1, np.float32)))
    got: dict = {}

    def collect():
        got.update({u.fragment: u for u in b.poll_updates()})
        return len(got) == res.plan.num_fragments

    wait_for(collect, "updates on the other island")
    a.close()
    assert all(u.version == 1 for u in got.values())


def test_close_flushes_then_reports_nothing_dropped(cluster, client):
    c = cluster(1)
    a = client(c.connect, "a")
    res = a.join(small_flat(0))
    a.push(0, 0, 0, 10, 1, delta_frames(np.zeros(res.plan.fragments[0].size, np.float32)))
    assert a.close(flush_timeout_s=WAIT_S) == 0
    with pytest.raises(ClientError, match="closed"):
        a.push(0, 1, 0, 10, 1, [b"x"])


def test_shard_restart_reconnects_and_resends_the_unacked_delta(cluster, client, peer):
    c = cluster(1)
    a = client(c.connect, "a", heartbeat_interval_s=0.1, liveness=3, ack_timeout_s=0.2)
    res = a.join(small_flat(0))
    c.stop_shard(0)
    size = res.plan.fragments[0].size
    a.push(0, 0, res.versions[0], 100, 5, delta_frames(np.full(size, 0.25, np.float32)))
    wait_for(lambda: a.stats()["shards_down"] == 1, "the client to notice the shard is down")
    assert a.stats()["pending"] == 1

    c.start(0)  # same ports, same data dir: recovers its state
    wait_for(lambda: a.stats()["acked"] == 1, "the ack after the restart")
    stats = a.stats()
    assert stats["reconnects"] >= 1 and stats["shards_down"] == 0 and stats["pending"] == 0
    assert stats["resyncs"] >= 1  # the welcome after the restart re-snapshots
    got = {}
    wait_for(lambda: got.update({u.fragment: u for u in a.poll_updates()}) or 0 in got, "update")
    version, values = snapshot(peer(c.connect), 0)
    wait_for(
        lambda: got.update({u.fragment: u for u in a.poll_updates()}) or got[0].version == version,
        "newest",
    )
    assert version == res.versions[0] + 1
    np.testing.assert_array_equal(got[0].values, values)


def test_push_blocks_when_the_unacked_buffer_is_full(cluster, client):
    c = cluster(1)
    a = client(c.connect, "a", max_unacked=1, push_timeout_s=0.3)
    res = a.join(small_flat(0))
    c.stop_shard(0)
    frames = delta_frames(np.zeros(res.plan.fragments[0].size, np.float32))
    a.push(0, 0, 0, 10, 1, frames)
    with pytest.raises(ClientError, match=r"push: 1 deltas still unacked after 0.3s"):
        a.push(0, 1, 0, 10, 1, frames)
    c.start(0)
    wait_for(lambda: a.stats()["acked"] == 1, "the ack after the restart")
    a.push(0, 1, 0, 10, 1, frames)  # a slot is free again
    wait_for(lambda: a.stats()["acked"] == 2, "the second ack")


@pytest.mark.parametrize("downlink", ["float32", "int8"])
def test_replica_stays_bit_exact_over_many_steps(cluster, client, peer, downlink):
    c = cluster(1, downlink=downlink)
    a, b = client(c.connect, "a"), client(c.connect, "b")
    res = a.join(small_flat(0))
    b.join(small_flat(0))
    size = res.plan.fragments[1].size
    rng = np.random.default_rng(3)
    for round in range(5):
        delta = rng.standard_normal(size).astype(np.float32) * 0.01
        a.push(1, round, round, 10, 1, delta_frames(delta, "int8"))
        wait_for(lambda r=round: a.stats()["acked"] == r + 1, "the ack")
    version, values = snapshot(peer(c.connect), 1)
    latest = {}

    def caught_up():
        latest.update({u.fragment: u for u in b.poll_updates()})
        return 1 in latest and latest[1].version == version

    wait_for(caught_up, "the other island's replica")
    assert version == 5
    np.testing.assert_array_equal(latest[1].values, values)


def test_concurrent_first_joins_agree_on_one_initializer(cluster, client):
    c = cluster(2)
    flats = [small_flat(0), small_flat(1)]
    clients = [client(c.connect, "a", ack_timeout_s=0.2), client(c.connect, "b", ack_timeout_s=0.2)]
    results: list = [None, None]
    barrier = threading.Barrier(2)

    def join(i):
        barrier.wait()
        results[i] = clients[i].join(flats[i])

    threads = [threading.Thread(target=join, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 2)
    assert all(r is not None for r in results)
    winner = next(f for f in flats if np.array_equal(f["b"], results[0].params["b"]))
    for res in results:  # both replicas hold one island's values, not a mix
        for name, value in winner.items():
            np.testing.assert_array_equal(res.params[name], value)
