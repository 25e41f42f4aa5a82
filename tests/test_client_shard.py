"""The client against real ShardServer instances (threads, real sockets on 127.0.0.1).

Also when things go wrong: a stop while the server is gone, a half-initialised
cluster, an oversize push, an island id already in use.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from client_helpers import clients
from conftest import WAIT_S, free_port, wait_for
from shard_helpers import delta_frames, init_payload, nan_frames, plan_for, small_flat

from paramserver.client import Client, ClientConfig, ClientError
from paramserver.wire import protocol


@pytest.fixture
def client():
    yield from clients()


def snapshot(peer, fragment):
    reply, values = peer.snapshot(fragment)
    return reply["version"], values


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


def test_plan_mismatch_names_both_models_the_first_difference_and_both_hashes(cluster, client):
    c = cluster(1)
    res = client(c.connect, "a").join(small_flat(0))
    shapes = {name: value.shape for name, value in small_flat(0).items()}
    other = {"a/w": np.zeros((8, 15), np.float32), "b": np.zeros(40, np.float32)}
    with pytest.raises(ClientError) as caught:
        client(c.connect, "b").join(other)
    text = str(caught.value)
    assert text.startswith("plan mismatch: this island's model (160 parameters in 2 leaves)")
    total = sum(int(np.prod(s)) for s in shapes.values())
    assert f"the cluster's ({total:,} parameters in {len(shapes)} leaves)" in text
    assert f"leaf 'a/w' is float32[8, 15] here, float32{list(shapes['a/w'])}" in text
    assert "fresh --data-dir" in text and f"cluster {res.plan.hash[:12]}, island " in text


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
    # the explicit re-push is a duplicate; on a loaded machine the ack timer may
    # also have re-sent the first push before its ack came (one more duplicate)
    dups = a.stats()["duplicates"]
    assert 1 <= dups <= 2
    watcher = peer(c.connect)  # the step runs off the serving loop: wait for it
    merged = res.versions[0] + 1
    status = wait_for(lambda: (s := watcher.status())["versions"]["0"] == merged and s, "a step")
    assert status["accepted"] == 1 and status["duplicates"] == dups


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
    watcher = peer(c.connect)
    for round in range(5):
        delta = rng.standard_normal(size).astype(np.float32) * 0.01
        a.push(1, round, round, 10, 1, delta_frames(delta, "int8"))
        wait_for(lambda r=round: a.stats()["acked"] == r + 1, "the ack")
        # its step runs off the serving loop: the next push is based on it
        wait_for(lambda r=round, w=watcher: w.status()["versions"]["1"] == r + 1, "the step")
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


def in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    """Run fn in a thread; the dict gets "result" or "error"."""
    out: dict = {}

    def body():
        try:
            out["result"] = fn(*args, **kwargs)
        except Exception as exc:
            out["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, out


@pytest.mark.timeout(60)
def test_a_stopped_push_returns_at_once_and_close_hands_back_every_unacked_delta(cluster, client):
    c = cluster(1)
    # a push timeout far beyond the test's: only the stop event can end the wait for a slot
    a = client(c.connect, "a", max_unacked=1, push_timeout_s=3600.0, ack_timeout_s=0.2)
    res = a.join(small_flat(0))
    c.stop_shard(0)  # the server is gone
    size = res.plan.fragments[0].size
    first, second = (delta_frames(np.full(size, v, np.float32)) for v in (0.1, 0.2))
    a.push(0, 1, res.versions[0], 100, 5, first)
    stop = threading.Event()
    thread, out = in_thread(a.push, 0, 2, res.versions[0], 100, 5, second, stop=stop)
    thread.join(0.3)
    assert thread.is_alive(), "push did not wait for a free slot"
    stop.set()
    thread.join(WAIT_S)
    assert not thread.is_alive() and "error" not in out, out
    # a flush timeout far beyond the test's: the flush gives up because its shard is down
    assert a.close(flush_timeout_s=3600.0) == 2
    kept = a.unacked()
    assert [(d.fragment, d.round, d.base_version, d.tokens, d.steps) for d in kept] == [
        (0, 1, res.versions[0], 100, 5),
        (0, 2, res.versions[0], 100, 5),
    ]

    c.start(0)  # the same data dir: the shard recovers its state
    again = client(c.connect, "a")
    again.join(small_flat(0))
    for acks in (2, 4):  # twice: the shard's dedup keeps each delta exactly-once
        for d in kept:
            again.push(d.fragment, d.round, d.base_version, d.tokens, d.steps, d.frames)
        wait_for(lambda n=acks: again.stats()["acked"] == n, "the re-sent deltas' acks")
    stats = again.stats()
    assert stats["duplicates"] == 2 and stats["rejected"] == {}
    # each applied once (one step may merge both: the version count depends on timing)
    assert c.servers[0].state.counters.accepted == 2


@pytest.mark.timeout(60)
def test_join_gives_up_at_once_when_its_stop_event_is_set():
    port = free_port()  # nothing listens here
    # a join timeout far beyond the test's: only the stop event can end the join in time
    a = Client(ClientConfig(connect=f"tcp://127.0.0.1:{port}", island="a", join_timeout_s=3600))
    try:
        stop = threading.Event()
        thread, out = in_thread(a.join, small_flat(0), stop=stop)
        thread.join(0.3)
        assert thread.is_alive(), "join did not wait for the server"
        stop.set()
        thread.join(WAIT_S)
        assert isinstance(out.get("error"), ClientError), out
        assert "stopped" in str(out["error"])
    finally:
        a.close(flush_timeout_s=0.1)


@pytest.mark.timeout(60)
def test_a_half_initialised_cluster_is_completed_by_the_next_joiner(cluster, client, peer):
    c = cluster(2)
    mine, theirs = small_flat(0), small_flat(1)
    plan = plan_for(theirs, shards=2, fragments=c.cfg.num_fragments)
    dead = peer(c.endpoints[0][0], "dead")  # initialises shard 0, then dies
    dead.hello()
    reply, _ = dead.request(
        {"kind": "init", "island": "dead", "plan": plan.to_wire()}, init_payload(plan, theirs, 0)
    )
    assert reply["kind"] == "init_ok", reply
    dead.close()

    res = client(c.connect, "a", init_grace_s=0.5).join(mine)
    assert res.plan.hash == plan.hash
    for frag in plan.fragments:  # shard 0 keeps the dead island's values, shard 1 gets ours
        source = theirs if frag.shard == 0 else mine
        np.testing.assert_array_equal(
            res.plan.gather(res.params, frag.index), plan.gather(source, frag.index)
        )
    later = client(c.connect, "b").join(small_flat(2))  # the cluster is whole now
    assert later.versions == res.versions


@pytest.mark.timeout(60)
def test_a_half_initialised_cluster_refuses_another_model_with_a_clear_message(
    cluster, client, peer
):
    c = cluster(2)
    flat = small_flat(0)
    plan = plan_for(flat, shards=2, fragments=c.cfg.num_fragments)
    dead = peer(c.endpoints[0][0], "dead")
    dead.hello()
    reply, _ = dead.request(
        {"kind": "init", "island": "dead", "plan": plan.to_wire()}, init_payload(plan, flat, 0)
    )
    assert reply["kind"] == "init_ok", reply
    other = {"a/w": np.zeros((8, 15), np.float32), "b": np.zeros(40, np.float32)}
    with pytest.raises(ClientError, match=r"plan mismatch: .*\(plan hashes: cluster \w+"):
        client(c.connect, "a", init_grace_s=0.2).join(other)
    assert not peer(c.endpoints[1][0], "probe").hello()["initialized"]  # left alone


@pytest.mark.timeout(60)
def test_an_oversize_push_is_refused_locally_naming_the_fragment_and_the_limit(cluster, client):
    c = cluster(1, max_message_bytes=4096)
    a = client(c.connect, "a")
    res = a.join(small_flat(0))
    with pytest.raises(
        ClientError, match=r"fragment 1 \(round 3\) is \d+ bytes .* max_message_bytes=4096"
    ):
        a.push(1, 3, res.versions[1], 10, 1, [b"\0" * 5000])
    stats = a.stats()
    assert stats["pushes"] == 0 and stats["pending"] == 0  # never queued
    size = res.plan.fragments[1].size
    a.push(1, 3, res.versions[1], 10, 1, delta_frames(np.zeros(size, np.float32)))
    wait_for(lambda: a.stats()["acked"] == 1, "a push under the limit")


@pytest.mark.timeout(60)
def test_an_island_id_live_on_another_client_is_refused_at_join_in_one_line(cluster, client):
    c = cluster(2)
    a = client(c.connect, "a")
    a.join(small_flat(0))
    with pytest.raises(ClientError) as info:
        client(c.connect, "a").join(small_flat(0))
    message = str(info.value)
    assert "island id 'a' is in use by another running island" in message
    assert "\n" not in message
    a.close(flush_timeout_s=1.0)  # says bye: the id is free again
    client(c.connect, "a").join(small_flat(0))


@pytest.mark.timeout(60)
def test_a_restarted_island_gets_its_id_back_once_the_old_connection_is_silent(
    start_shard, peer, client
):
    # The crashed process's connection said hello as "a" and then went silent (kill -9):
    # the shard refuses "a" on a new connection for two heartbeats (0.5 s each), and the
    # restarted island's join asks again instead of failing at once.
    shard = start_shard(heartbeat_interval_s=0.5, liveness=20)
    peer(shard.router, "a").hello()
    # without the wait the join fails at once (the id is in use); the wait's timing is
    # test_client_core's (a fake clock)
    restarted = client(shard.router, "a", heartbeat_interval_s=0.5, in_use_wait_s=30.0)
    res = restarted.join(small_flat(0))
    assert res.versions  # joined
    # a second live island with the same id is still refused, after the wait
    third = client(shard.router, "a", heartbeat_interval_s=0.5, in_use_wait_s=1.0)
    with pytest.raises(ClientError, match="in use by another running island"):
        third.join(small_flat(0))


@pytest.mark.parametrize(
    "links", [{"control_link": False}, {"bulk_links": 3}], ids=["one_dealer", "control_and_3_bulk"]
)
def test_every_fragment_of_every_round_is_acked_once_whatever_the_links(cluster, client, links):
    c = cluster(2)
    a = client(c.connect, "a", **links)
    res = a.join(small_flat(0))
    rounds = 4
    for rnd in range(rounds):
        for f in res.plan.fragments:
            delta = np.full(f.size, 0.001, np.float32)
            a.push(f.index, rnd, res.versions[f.index], 100, 1, delta_frames(delta))
    pushed = rounds * res.plan.num_fragments
    wait_for(lambda: a.stats()["acked"] == pushed, "every ack")
    stats = a.stats()
    assert stats["duplicates"] == 0 and stats["rejected"] == {} and stats["reconnects"] == 0
    cores = [server.core for server in c.servers]
    assert sum(core.state.counters.accepted for core in cores) == pushed
    expected = 1 if "control_link" in links else 1 + links["bulk_links"]
    assert [core.bindings.connections("a") for core in cores] == [expected, expected]
