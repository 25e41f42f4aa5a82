"""Island ids on a live shard: one connection per id (island_in_use), takeover after silence.

Raw DEALER peers on 127.0.0.1 against a real shard; every wait polls with a deadline.
"""

import numpy as np
import pytest
from conftest import wait_for
from shard_helpers import delta_frames, init_payload, plan_for, push_header, small_flat

pytestmark = pytest.mark.timeout(60)

SLOW_HB = {"heartbeat_interval_s": 5.0, "liveness": 20}


def _refused(reply, kind="rejected"):
    assert reply["kind"] == kind, reply
    if kind == "ack":
        assert reply["outcome"] == "rejected", reply
    assert reply["reason"] == "island_in_use", reply
    return reply


def _init(peer_factory, shard, island="a"):
    flat = small_flat()
    plan = plan_for(flat, 1, 2)
    p = peer_factory(shard.router, island)
    p.hello()
    reply, _ = p.request(
        {"kind": "init", "island": island, "plan": plan.to_wire()}, init_payload(plan, flat)
    )
    assert reply["kind"] == "init_ok", reply
    return p, plan


def test_a_live_id_is_refused_on_another_connection(start_shard, peer):
    shard = start_shard(mode="sync", **SLOW_HB)
    first, plan = _init(peer, shard)
    peer(shard.router, "quiet").hello()  # a second live island: nothing steps
    second = peer(shard.router, "a")
    reply, _ = second.request({"kind": "hello", "island": "a"})
    assert "'a'" in _refused(reply)["detail"] and "another connection" in reply["detail"]
    assert first.hello()["kind"] == "welcome"  # the bound connection may say hello again
    zeros = delta_frames(np.zeros(plan.fragments[0].size, np.float32))
    reply, _ = second.request(push_header(plan, "a", 1, 0), zeros)
    assert reply["detail"]
    _refused(reply, "ack")
    _refused(second.request({"kind": "heartbeat", "island": "a"})[0])
    _refused(second.request({"kind": "bye", "island": "a"})[0])
    # read-only requests need no binding
    reply, _ = second.request({"kind": "snapshot", "island": "a", "fragment": 0})
    assert reply["kind"] == "snapshot_reply"
    ack, _ = first.request(push_header(plan, "a", 1, 0), zeros)
    assert ack["outcome"] == "accepted"
    status = first.status()
    assert status["islands_live"] == ["a", "quiet"]
    assert status["rejected"] == {"island_in_use": 4} and status["accepted"] == 1


def test_a_silent_connection_loses_its_id_to_the_next_hello(start_shard, peer):
    # quiet_s = 2 intervals = 0.4 s; liveness 50 intervals: the island is never dead here
    shard = start_shard(mode="sync", heartbeat_interval_s=0.2, liveness=50)
    old, plan = _init(peer, shard)
    new = peer(shard.router, "a")  # a reconnect: new socket, same id; the old one is closed
    _refused(new.request({"kind": "hello", "island": "a"})[0])
    old.close()

    def forgotten() -> bool:  # what a client does: heartbeat; on unknown_island, say hello
        reply, _ = new.request({"kind": "heartbeat", "island": "a"})
        if reply["kind"] == "rejected" and reply["reason"] == "unknown_island":
            return True
        _refused(reply)
        return False

    wait_for(forgotten, "the old connection's binding to expire", timeout_s=10.0, poll_s=0.05)
    assert new.hello()["kind"] == "welcome"  # when exactly: tests/test_shard_core_sim.py
    zeros = delta_frames(np.zeros(plan.fragments[0].size, np.float32))
    ack, _ = new.request(push_header(plan, "a", 1, 0), zeros)
    assert ack["outcome"] == "accepted"
    assert "a" in new.status()["islands_live"]


def test_the_same_session_takes_its_id_over_at_once(start_shard, peer):
    shard = start_shard(**SLOW_HB)
    old = peer(shard.router, "a")
    reply, _ = old.request({"kind": "hello", "island": "a", "session": "s-1"})
    assert reply["kind"] == "welcome"
    other, _ = peer(shard.router, "a").request({"kind": "hello", "island": "a", "session": "s-2"})
    _refused(other)
    new = peer(shard.router, "a")
    reply, _ = new.request({"kind": "hello", "island": "a", "session": "s-1"})
    assert reply["kind"] == "welcome"
    _refused(old.request({"kind": "heartbeat", "island": "a"})[0])
    assert new.request({"kind": "heartbeat", "island": "a"})[0]["kind"] == "heartbeat"


def test_a_dead_islands_id_may_be_taken_over(start_shard, peer):
    shard = start_shard(heartbeat_interval_s=0.1, liveness=1)  # dead after 0.1 s of silence
    peer(shard.router, "a").hello()
    taker = peer(shard.router, "a")

    def welcomed() -> bool:
        reply, _ = taker.request({"kind": "hello", "island": "a"})
        if reply["kind"] == "welcome":
            return True
        _refused(reply)
        return False

    wait_for(welcomed, "the dead island's id to be taken over", timeout_s=10.0, poll_s=0.05)
    assert taker.status()["islands_live"] == ["a"]


def test_the_status_probe_says_bye_on_the_connection_of_its_hello(start_shard, peer, zmq_ctx):
    from paramserver.plumbing import probe

    shard = start_shard(**SLOW_HB)
    assert probe.cluster_endpoints(zmq_ctx, shard.router, timeout_s=10)
    status = peer(shard.router, "watcher").status()
    assert status["islands_live"] == [] and status["rejected"] == {}  # not left live


def test_an_attached_connection_pushes_as_the_island_while_the_other_heartbeats(start_shard, peer):
    shard = start_shard(mode="sync", **SLOW_HB)
    control, plan = _init(peer, shard)
    assert (
        control.request({"kind": "hello", "island": "a", "session": "s-1"})[0]["kind"] == "welcome"
    )
    bulk = peer(shard.router, "a")
    zeros = delta_frames(np.zeros(plan.fragments[0].size, np.float32))
    ack, _ = bulk.request(push_header(plan, "a", 1, 0), zeros)
    _refused(ack, "ack")  # not attached yet: another live connection holds the id
    attach = {"kind": "hello", "island": "a", "attach": True}
    for wrong in ({}, {"session": "s-2"}):
        _refused(bulk.request({**attach, **wrong})[0])
    stranger = peer(shard.router, "b")
    reply, _ = stranger.request({**attach, "island": "b", "session": "s-9"})
    assert reply["reason"] == "unknown_island", reply  # an attach never binds a free id
    reply, _ = bulk.request({**attach, "session": "s-1"})
    assert reply["kind"] == "welcome" and reply["plan_hash"] == plan.hash
    ack, _ = bulk.request(push_header(plan, "a", 1, 0), zeros)
    assert ack["outcome"] == "accepted", ack
    assert control.request({"kind": "heartbeat", "island": "a"})[0]["kind"] == "heartbeat"
    ack, _ = control.request(push_header(plan, "a", 1, 0), zeros)  # a re-send on the other one
    assert ack["outcome"] == "duplicate", ack
    status = control.status()
    assert status["islands_live"] == ["a"] and status["islands_known"] == 1
    assert status["accepted"] == 1 and status["duplicates"] == 1
    # a hello that moves the id (same session, new connection) lets the attached one go
    mover = peer(shard.router, "a")
    assert mover.request({"kind": "hello", "island": "a", "session": "s-1"})[0]["kind"] == "welcome"
    _refused(bulk.request({"kind": "heartbeat", "island": "a"})[0])
