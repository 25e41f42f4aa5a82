"""A live shard under a flood: the flooder is throttled, the others keep being acked, garbage is capped.

Real sockets on 127.0.0.1 against a shard in a thread (counts, never times):
one peer pipelines a thousand pushes that are refused (pushes acked in order
take no token, so a flood is of pushes that are not) while another island is
served, so the shard is shared and the peer's bucket (`max_requests_per_s`,
`request_burst`) runs dry; it is answered `throttled` with `retry_after_s`
while the other island's pushes are all accepted. Garbage past
`max_refusals_per_s` is dropped unanswered and counted, and the shard serves
on. Our client treats `throttled` as "later", not as lost work.
"""

import numpy as np
import pytest
from conftest import wait_for
from shard_helpers import (
    delta_frames,
    init_payload,
    nan_frames,
    plan_for,
    push_header,
    small_flat,
)

from paramserver.client import Client, ClientConfig

pytestmark = pytest.mark.timeout(60)

SLOW_HB = {"heartbeat_interval_s": 5.0, "liveness": 20}
FLOOD = 1000


def _init(peer, shard, island="a"):
    flat = small_flat()
    plan = plan_for(flat, 1, 2)
    p = peer(shard.router, island)
    p.hello()
    reply, _ = p.request({"kind": "init", "island": island, "plan": plan.to_wire()},
                         init_payload(plan, flat))  # fmt: skip
    assert reply["kind"] == "init_ok", reply
    return p, plan


def test_a_flooding_island_is_throttled_and_the_others_keep_being_acked(start_shard, peer):
    # the honest island's init, just before the flood, and its pushes during it share the shard
    shard = start_shard(mode="async", max_requests_per_s=20.0, request_burst=10,
                        max_refusals_per_s=0.0, max_pending_per_island=FLOOD, **SLOW_HB)  # fmt: skip
    honest, plan = _init(peer, shard)
    flooder = peer(shard.router, "flood")
    flooder.hello()
    frames = [bytes(f) for f in nan_frames(plan.fragments[0].size)]  # each refused non_finite
    for rnd in range(FLOOD):  # pipelined: nothing read until all are sent
        flooder.send(push_header(plan, "flood", rnd, 0), frames)
    honest_frames = delta_frames(np.full(plan.fragments[1].size, 1e-3, np.float32))
    honest_acks = [
        honest.request(push_header(plan, "a", rnd, 1), honest_frames)[0] for rnd in range(5)
    ]
    replies = [flooder.recv()[0] for _ in range(FLOOD)]  # every one answered (refusals: all)

    assert [a["outcome"] for a in honest_acks] == ["accepted"] * 5
    throttled = [r for r in replies if r.get("reason") == "throttled"]
    assert throttled, "the flooder was never throttled"
    assert {r["kind"] for r in throttled} == {"ack"}
    assert all(r["retry_after_s"] > 0 for r in throttled)
    assert "max_requests_per_s=20" in throttled[0]["detail"]
    refused = sum(r.get("reason") == "non_finite" for r in replies)
    assert refused + len(throttled) == FLOOD
    status = honest.status()
    assert status["rejected"] == {"throttled": len(throttled), "non_finite": refused}
    assert status["accepted"] == 5


def test_garbage_is_answered_at_a_bounded_rate_and_the_shard_serves_on(start_shard, peer):
    shard = start_shard(max_requests_per_s=0.0, max_refusals_per_s=5.0, **SLOW_HB)
    garbage = peer(shard.router, "junk")
    for i in range(FLOOD):
        garbage.send_raw([b"\xc1" + i.to_bytes(4, "little")])  # never msgpack
    watcher = peer(shard.router, "watcher")

    def all_seen():
        status = watcher.status()
        seen = status["rejected"].get("malformed", 0) + status["dropped"].get("malformed", 0)
        return status if seen == FLOOD else None

    status = wait_for(all_seen, "the shard to have read every garbage message")
    answered = 0
    while garbage.sock.poll(500):  # the answers were sent before the status reply
        reply, _ = garbage.recv()
        assert reply["reason"] == "malformed"
        answered += 1
    assert answered == status["rejected"]["malformed"] >= 1
    assert status["dropped"]["malformed"] == FLOOD - answered > FLOOD // 2
    assert watcher.hello()["kind"] == "welcome"  # and the shard serves on


def test_our_client_re_sends_throttled_deltas_and_loses_none(start_shard, peer):
    # a dedup window over every round: re-sent after newer rounds got in, none is "replayed"
    # a bucket of 4 refilled every 5 s: the join's requests (hello, snapshot pieces) leave it
    # about empty, so the first pushes are throttled; once one is acked the others take no token
    shard = start_shard(mode="async", max_requests_per_s=0.2, request_burst=4,
                        max_refusals_per_s=0.0, max_pending_per_island=FLOOD,
                        dedup_window=FLOOD, **SLOW_HB)  # fmt: skip
    client = Client(ClientConfig(connect=shard.router, island="flood", max_unacked=300,
                                 heartbeat_interval_s=5.0, liveness=20))  # fmt: skip
    # another island heartbeating 5 times a second: the shard is shared, its limits apply
    other = Client(ClientConfig(connect=shard.router, island="other", heartbeat_interval_s=0.2))
    try:
        plan = client.join(small_flat()).plan
        other.join(small_flat())
        frames = delta_frames(np.zeros(plan.fragments[0].size, np.float32), "int8")
        pushes = 150
        for rnd in range(pushes):
            client.push(0, rnd, 0, 100, 1, frames)
        stats = wait_for(
            lambda: (s := client.stats())["acked"] >= pushes and s, "every push to be acked"
        )
        assert stats["deferred"] >= 1 and stats["rejected"] == {}  # throttled, then in
        status = peer(shard.router, "w").status()
        assert status["rejected"]["throttled"] >= 1 and status["accepted"] == pushes
    finally:
        client.close(flush_timeout_s=1.0)
        other.close(flush_timeout_s=1.0)
