"""A live shard's wire edge: strict `v`, the `id` of an oversize header, REQ sockets.

docs/protocol.md sections 1 and 2: a `true` where an int is required is
malformed (for `v`: bad_version); every reply to a header that decodes carries
its int `id`, a header frame over 4 MiB included; a REQ socket's empty
delimiter frame is stripped and put back, so a REQ client gets its replies.
"""

import msgpack
import pytest
import zmq
from conftest import REPLY_TIMEOUT_S

from paramserver.wire import protocol

pytestmark = pytest.mark.timeout(60)

SLOW_HB = {"heartbeat_interval_s": 5.0, "liveness": 20}


def test_v_true_and_v_one_point_zero_are_bad_version_with_the_id(start_shard, peer):
    shard = start_shard(**SLOW_HB)
    p = peer(shard.router, "a")
    for v in (True, 1.0):
        p.send_raw([msgpack.packb({"v": v, "kind": "status", "id": 41})])
        reply, _ = p.recv()
        assert (reply["kind"], reply["reason"], reply["id"]) == ("rejected", "bad_version", 41)
    assert p.status()["rejected"] == {"bad_version": 2}


def test_a_header_over_4_mib_is_refused_with_its_id(start_shard, peer):
    shard = start_shard(**SLOW_HB)
    p = peer(shard.router, "a")
    plan = {"leaves": "x" * (protocol.MAX_HEADER_BYTES + 10)}
    rid = p.send({"kind": "init_begin", "island": "a", "plan": plan})
    reply, _ = p.recv()
    assert (reply["kind"], reply["reason"], reply["id"]) == ("rejected", "malformed", rid)
    assert "limit 4194304" in reply["detail"]
    # a map with bytes after it decodes too: its id is echoed
    p.send_raw([msgpack.packb({"v": 1, "kind": "status", "id": 77}) + b"\x00"])
    reply, _ = p.recv()
    assert (reply["reason"], reply["id"]) == ("malformed", 77)


def test_a_req_socket_gets_every_reply(start_shard, zmq_ctx):
    shard = start_shard(**SLOW_HB)
    req = zmq_ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(shard.router)
    try:

        def ask(frames):
            req.send_multipart(frames)
            assert req.poll(int(REPLY_TIMEOUT_S * 1000)), "the REQ socket got no reply"
            return protocol.unpack(req.recv_multipart(), role=protocol.REPLY)[0]

        welcome = ask(protocol.pack({"kind": "hello", "island": "req", "id": 1}))
        assert (welcome["kind"], welcome["id"]) == ("welcome", 1)
        beat = ask(protocol.pack({"kind": "heartbeat", "island": "req", "id": 2}))
        assert (beat["kind"], beat["id"]) == ("heartbeat", 2)  # bound to the REQ's connection
        refused = ask([b"\xc1 not msgpack"])  # a refusal reaches it too, so it is not stuck
        assert (refused["kind"], refused["reason"]) == ("rejected", "malformed")
        status = ask(protocol.pack({"kind": "status", "id": 3}))
        assert status["status"]["islands_live"] == ["req"]
    finally:
        req.close(0)
