"""A live shard over real sockets: join, init, snapshot, push/ack, publish, and bad input."""

import threading

import msgpack
import numpy as np
import pytest
import zmq
from conftest import wait_for
from shard_helpers import delta_frames, init_payload, nan_frames, plan_for, push_header, small_flat

import codec
from paramserver.wire import protocol

pytestmark = pytest.mark.timeout(60)

# Liveness long enough that no island dies during a test on a loaded machine.
SLOW_HB = {"heartbeat_interval_s": 5.0, "liveness": 20}


def init_shard(peer_factory, shard, flat=None, island="a"):
    flat = flat or small_flat()
    cfg = shard.server.cfg
    plan = plan_for(flat, cfg.shards, cfg.num_fragments)
    p = peer_factory(shard.router, island)
    welcome = p.hello()
    assert welcome["initialized"] is False and welcome["plan_hash"] is None
    reply, _ = p.request(
        {"kind": "init", "island": island, "plan": plan.to_wire()}, init_payload(plan, flat)
    )
    assert reply["kind"] == "init_ok", reply
    assert reply["versions"] == {str(f.index): 0 for f in plan.fragments}
    return p, plan, flat


def snapshot(p, fragment):
    reply, body = p.request({"kind": "snapshot", "island": p.island, "fragment": fragment})
    assert reply["kind"] == "snapshot_reply", reply
    return reply, codec.decode(body)["values"]


def test_join_init_and_snapshot(start_shard, peer):
    shard = start_shard(mode="sync", **SLOW_HB)
    a, plan, flat = init_shard(peer, shard)
    b = peer(shard.router, "b")
    welcome = b.hello()
    assert welcome["initialized"] is True and welcome["plan_hash"] == plan.hash
    assert welcome["num_shards"] == 1 and welcome["num_fragments"] == 2
    assert welcome["plan"] == plan.to_wire()
    again, _ = b.request(
        {"kind": "init", "island": "b", "plan": plan.to_wire()}, init_payload(plan, flat)
    )
    assert (again["kind"], again["reason"]) == ("rejected", "already_initialized")
    for f in (0, 1):
        reply, values = snapshot(b, f)
        assert (reply["fragment"], reply["version"], reply["seq"]) == (f, 0, 0)
        assert values.tobytes() == plan.gather(flat, f).tobytes()
    status = b.status()
    assert status["islands_live"] == ["a", "b"]
    assert status["rejected"] == {"already_initialized": 1}


def test_push_ack_step_and_publish(start_shard, peer, zmq_ctx):
    shard = start_shard(mode="sync", heartbeat_interval_s=0.05, liveness=400, downlink="float32")
    sub = zmq_ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(shard.pub)
    try:
        assert sub.poll(10_000), "no heartbeat on the PUB"
        hb, _ = protocol.unpack(sub.recv_multipart(), role=protocol.PUB)
        assert hb["kind"] == "heartbeat" and hb["seq"] == 0
        a, plan, flat = init_shard(peer, shard)
        b = peer(shard.router, "b")
        b.hello()
        size = plan.fragments[1].size
        for p, seed in ((a, 1), (b, 2)):
            d = np.random.default_rng(seed).standard_normal(size).astype(np.float32)
            ack, _ = p.request(push_header(plan, p.island, 1, 1), delta_frames(d, "int8"))
            assert ack["kind"] == "ack" and ack["outcome"] == "accepted", ack
            assert (ack["round"], ack["fragment"]) == (1, 1)
        while True:
            assert sub.poll(10_000), "no update published"
            msg, body = protocol.unpack(sub.recv_multipart(), role=protocol.PUB)
            if msg["kind"] == "update":
                break
        assert (msg["fragment"], msg["version"], msg["seq"], msg["mode"]) == (1, 1, 1, "full")
        published = codec.decode(body)["values"]
        reply, values = snapshot(a, 1)
        assert (reply["version"], reply["seq"]) == (1, 1)
        assert values.tobytes() == published.tobytes()
        assert values.tobytes() != plan.gather(flat, 1).tobytes()
        dup, _ = a.request(push_header(plan, "a", 1, 1), delta_frames(np.zeros(size, np.float32)))
        assert dup["outcome"] == "duplicate" and dup["version"] == 1
        status = a.status()
        assert status["versions"] == {"0": 0, "1": 1} and status["steps"] == 1
        assert status["accepted"] == 2 and status["duplicates"] == 1
        # in: at least the duplicate's raw float32 payload; out: at least the snapshot's values
        assert status["bytes_in"] >= 4 * size and status["bytes_out"] >= values.nbytes
        assert status["staleness_histogram"] == {"0": 2}
    finally:
        sub.close(linger=0)


def _bad_cases(plan, size):
    """(name, frames or (header, payload), expected reply kind, expected reason)."""
    good = push_header(plan, "a", 50, 0)
    zeros = delta_frames(np.zeros(size, np.float32))
    return [
        ("malformed msgpack", [b"\xc1\xc1\xc1"], "rejected", "malformed"),
        ("header not a map", [msgpack.packb([1, 2, 3])], "rejected", "malformed"),
        ("unknown kind", ({"kind": "explode", "island": "a"}, []), "rejected", "unknown_kind"),
        (
            "wrong protocol version",
            [msgpack.packb({**good, "v": 99}), *zeros],
            "rejected",
            "bad_version",
        ),
        ("wrong plan hash", ({**good, "plan_hash": "f" * 64}, zeros), "ack", "plan_mismatch"),
        (
            "wrong shape",
            (good, delta_frames(np.zeros(size - 1, np.float32))),
            "ack",
            "bad_shape",
        ),
        ("wrong dtype", (good, delta_frames(np.zeros(size, np.float16))), "ack", "bad_dtype"),
        ("NaN payload", (good, nan_frames(size)), "ack", "non_finite"),
        ("Inf payload", (good, nan_frames(size, float("-inf"))), "ack", "non_finite"),
        ("garbage codec frames", (good, [b"junk", b"\x00" * 64]), "ack", "codec_error"),
        ("no codec frames", (good, []), "ack", "codec_error"),
        ("oversize", (good, [b"\x00" * 70_000]), "ack", "oversize"),
        ("unknown island", ({**good, "island": "nobody"}, zeros), "ack", "unknown_island"),
        ("another's island id", ({**good, "island": "h"}, zeros), "ack", "island_in_use"),
        ("replayed round", ({**good, "round": 1}, zeros), "ack", "replayed_round"),
        ("future base", ({**good, "base_version": 9}, zeros), "ack", "future_base_version"),
        ("missing field", ({"kind": "push", "island": "a"}, zeros), "rejected", "malformed"),
        ("negative t_step", ({**good, "t_step": -1.0}, zeros), "rejected", "malformed"),
        ("t_step not a number", ({**good, "t_step": "fast"}, zeros), "rejected", "malformed"),
        ("infinite t_step", ({**good, "t_step": float("inf")}, zeros), "rejected", "malformed"),
    ]


def test_bad_input_is_rejected_counted_and_never_touches_parameters(start_shard, peer):
    # request limits off: the honest peer asks after every bad message, faster than 20 a second
    shard = start_shard(
        mode="sync", max_message_bytes=65_536, dedup_window=4, max_requests_per_s=0.0, **SLOW_HB
    )
    honest, plan, _ = init_shard(peer, shard, island="h")
    peer(shard.router, "b").hello()  # a third live island: pushes of a and h alone never step
    size = plan.fragments[0].size
    attacker = peer(shard.router, "a")
    attacker.hello()
    ack, _ = attacker.request(
        push_header(plan, "a", 40, 0), delta_frames(np.ones(size, np.float32))
    )
    assert ack["outcome"] == "accepted" and "detail" not in ack
    before = {f: snapshot(honest, f)[1].tobytes() for f in (0, 1)}
    expected: dict[str, int] = {}
    for name, message, kind, reason in _bad_cases(plan, size):
        if isinstance(message, tuple):
            rid = attacker.send(*message)
        else:
            rid = None
            attacker.send_raw(message)
        reply, _ = attacker.recv()
        assert reply["kind"] == kind, (name, reply)
        assert reply.get("reason") == reason, (name, reply)
        if kind == "ack":
            assert reply["outcome"] == "rejected" and reply["id"] == rid, (name, reply)
            assert reply["detail"], (name, reply)
        if reason != "unknown_island":  # "say hello" is counted apart from rejections
            expected[reason] = expected.get(reason, 0) + 1
        # the honest peer is still served after every bad message
        hb, _ = honest.request({"kind": "heartbeat", "island": "h"})
        assert hb["kind"] == "heartbeat", (name, hb)
    after = {f: snapshot(honest, f)[1].tobytes() for f in (0, 1)}
    assert after == before
    status = honest.status()
    assert status["rejected"] == expected and status["hello_requests"] == 1
    assert status["accepted"] == 1 and status["steps"] == 0
    assert status["pending"] == {"0": 1, "1": 0}
    ack, _ = honest.request(push_header(plan, "h", 41, 0), delta_frames(np.ones(size, np.float32)))
    assert ack["outcome"] == "accepted"


def test_past_the_hard_size_cap_the_connection_is_dropped_and_others_are_served(start_shard, peer):
    shard = start_shard(max_message_bytes=65_536, **SLOW_HB)
    honest, plan, _ = init_shard(peer, shard)
    big = peer(shard.router, "big")
    big.send(push_header(plan, "a", 1, 0), [b"\x00" * (3 * 65_536)])
    assert not big.sock.poll(300), "no reply past ZMQ_MAXMSGSIZE"
    assert honest.status()["accepted"] == 0


def test_requests_before_init_and_from_strangers(start_shard, peer):
    shard = start_shard(**SLOW_HB)
    p = peer(shard.router, "x")
    reply, _ = p.request({"kind": "snapshot", "island": "x", "fragment": 0})
    assert (reply["kind"], reply["reason"]) == ("rejected", "not_initialized")
    reply, _ = p.request({"kind": "heartbeat", "island": "x"})
    assert (reply["kind"], reply["reason"]) == ("rejected", "unknown_island")
    p.hello()
    reply, _ = p.request({"kind": "heartbeat", "island": "x"})
    assert (reply["kind"], reply["shard"], reply["seq"]) == ("heartbeat", 0, 0)
    reply, _ = p.request({"kind": "bye", "island": "x"})
    assert reply["kind"] == "bye_ok"
    assert p.status()["islands_live"] == []


def test_too_many_islands(start_shard, peer):
    shard = start_shard(max_islands=1, **SLOW_HB)
    peer(shard.router, "one").hello()
    two = peer(shard.router, "two")
    reply, _ = two.request({"kind": "hello", "island": "two"})
    assert (reply["kind"], reply["reason"]) == ("rejected", "too_many_islands")


def test_sync_merge_through_the_sockets_adds_an_islands_increments(start_shard, peer):
    # Island a pushes two increments d1, d2 before b pushes dB; uniform weights, no staleness
    # decay, SGD lr 1: the published version is G0 - ((d1 + d2) + dB) / 2 (DiLoCo's mean over
    # islands of their whole work), computed here by hand in float64.
    shard = start_shard(
        mode="sync",
        weighting="uniform",
        staleness_exponent=0.0,
        outer_optimizer="sgd",
        outer_lr=1.0,
        downlink="float32",
        **SLOW_HB,
    )
    a, plan, flat = init_shard(peer, shard)
    b = peer(shard.router, "b")
    b.hello()
    size = plan.fragments[0].size
    d1, d2, db = (
        np.random.default_rng(s).standard_normal(size).astype(np.float32) for s in (1, 2, 3)
    )
    for p, rnd, d in ((a, 1, d1), (a, 2, d2), (b, 1, db)):
        ack, _ = p.request(push_header(plan, p.island, rnd, 0), delta_frames(d))
        assert ack["outcome"] == "accepted" and ack["merged_version"] == 1, ack
    for _ in range(200):  # the step follows the last push within a loop turn
        reply, values = snapshot(a, 0)
        if reply["version"] == 1:
            break
        threading.Event().wait(0.01)
    assert reply["version"] == 1
    g0 = plan.gather(flat, 0).astype(np.float64)
    expected = g0 - ((d1.astype(np.float64) + d2) + db) / 2
    np.testing.assert_allclose(values, expected, rtol=0, atol=1e-5)
    assert a.status()["credited_tokens"] == pytest.approx(
        {"a": 2000 * size / plan.total_size, "b": 1000 * size / plan.total_size}, abs=1e-2
    )


@pytest.mark.parametrize("reported", [True, False])
def test_eq3_grace_waits_on_the_reported_pace_for_a_second_island(start_shard, peer, reported):
    # Quorum 1 with the eq3 rule: island a reports inner steps of 0.5 s and the overlap is
    # 10 steps, so the window after its push is 0.5 * 10 * 0.5 s = 2.5 s and b's delta joins
    # the same step. Without a reported pace the window is grace_min_s = 0: a's delta is
    # merged alone at once.
    shard = start_shard(
        mode="quorum", quorum=1, grace_rule="eq3", grace_min_s=0.0, grace_overlap_steps=10,
        **SLOW_HB,
    )  # fmt: skip
    a, plan, _ = init_shard(peer, shard)
    b = peer(shard.router, "b")
    b.hello()
    size = plan.fragments[0].size
    pace = {"t_step": 0.5} if reported else {}
    hb, _ = a.request({"kind": "heartbeat", "island": "a", **pace})
    assert hb["kind"] == "heartbeat"
    header = {**push_header(plan, "a", 1, 0, 0, 1000, 10), **pace}
    ack, _ = a.request(header, delta_frames(np.ones(size, np.float32)))
    assert ack["outcome"] == "accepted", ack
    if not reported:  # the step runs off the serving loop: status answers meanwhile
        status = wait_for(lambda: (s := a.status())["steps"] == 1 and s, "the step")
        assert status["pending"]["0"] == 0 and status["paces"] == {}
        return
    status = a.status()
    assert status["paces"] == {"a": {"step_s": 0.5, "steps": 10, "round_s": 5.0}}
    assert status["pending"]["0"] == 1 and status["steps"] == 0  # inside the window
    ack, _ = b.request(push_header(plan, "b", 1, 0), delta_frames(np.ones(size, np.float32)))
    assert ack["outcome"] == "accepted" and ack["merged_version"] == 1, ack
    status = wait_for(lambda: (s := a.status())["steps"] == 1 and s, "the step")
    assert status["pending"]["0"] == 0  # one step merged both


def test_an_island_pushes_every_fragment_at_once_under_the_default_request_limit(start_shard, peer):
    # 60 fragments, more than request_burst (16) and the answers a second (20): pushes acked
    # in order take no token, so none is throttled or dropped while another island is served
    flat = {"w": np.random.default_rng(0).standard_normal(6000).astype(np.float32)}
    shard = start_shard(mode="async", fragments=60, **SLOW_HB)
    a, plan, _ = init_shard(peer, shard, flat)
    b = peer(shard.router, "b")
    b.hello()
    frames = {f.index: delta_frames(np.full(f.size, 0.01, np.float32)) for f in plan.fragments}
    ack, _ = a.request(push_header(plan, "a", 1, 0), frames[0])
    assert ack["outcome"] == "accepted", ack
    sent = []
    for f in range(1, 60):
        sent.append(a.send(push_header(plan, "a", 1, f), frames[f]))
        if f % 10 == 0:  # the shard is shared: b is heard meanwhile
            assert b.request({"kind": "heartbeat", "island": "b"})[0]["kind"] == "heartbeat"
    acks = [a.recv()[0] for _ in sent]
    assert [x["id"] for x in acks] == sent
    assert all(x["outcome"] == "accepted" for x in acks), [x for x in acks if "reason" in x]
    status = a.status()
    assert "throttled" not in status["rejected"] and status["dropped"] == {}, status
