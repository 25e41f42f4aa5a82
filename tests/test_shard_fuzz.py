"""Fuzzing a live shard with 10,000 hostile messages while an honest island keeps pushing.

Accounting (checked): every hostile message gets exactly one reply, in order
(one DEALER, one ROUTER). Across the fuzz, the shard's counters move by what
the replies say and nothing else: per reason, `rejected` grows by the
rejections replied (ack outcome `rejected` or a `rejected` reply); `accepted`
and `duplicates` grow by the hostile messages acked so plus the honest
island's accepted and duplicate acks. The remaining replies are served
requests (welcome, heartbeat, status, snapshot, bye) that count nowhere.
The shard runs in sync mode with a silent second island, so no outer step
happens and the parameters must come out bit-identical. Its request limits are
off (`max_requests_per_s` and `max_refusals_per_s` 0: every message answered;
tests/test_shard_fairness.py tests them), and a message whose first frame is
empty is answered like a REQ socket's: the empty frame first.
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import zmq
from conftest import REPLY_TIMEOUT_S, wait_for
from hostile import FAMILIES, hostile_messages
from shard_helpers import delta_frames, push_header, small_flat

import codec
from paramserver.client import Client, ClientConfig
from paramserver.wire import protocol

pytestmark = pytest.mark.timeout(60)

SLOW_HB = {"heartbeat_interval_s": 5.0, "liveness": 20}
MAX_BYTES = 65_536
WINDOW = 250  # messages in flight: well below the ROUTER's send high-water mark
COUNT = 10_000


def _snapshots(p, fragments):
    out = {}
    for f in fragments:
        reply, body = p.request({"kind": "snapshot", "island": p.island, "fragment": f})
        assert reply["kind"] == "snapshot_reply", reply
        out[f] = (reply["version"], codec.decode(body)["values"].tobytes())
    return out


def _recv(sock: zmq.Socket) -> dict:
    """The next reply's header; one to a message whose first frame was empty comes after one."""
    assert sock.poll(int(REPLY_TIMEOUT_S * 1000)), "no reply"
    frames = sock.recv_multipart()
    if frames and not frames[0]:  # the shard took the empty frame for a REQ delimiter
        frames = frames[1:]
    return protocol.unpack(frames, role=protocol.REPLY)[0]


def _classify(reply: dict) -> str:
    if reply["kind"] == "ack":
        return reply["outcome"] if reply["outcome"] != "rejected" else f"rejected:{reply['reason']}"
    if reply["kind"] == "rejected":
        return f"rejected:{reply['reason']}"
    return f"served:{reply['kind']}"


def _wait_acked(client: Client, pushes: int) -> dict:
    def answered() -> dict | None:
        stats = client.stats()
        return stats if stats["acked"] + sum(stats["rejected"].values()) >= pushes else None

    return wait_for(answered, f"{pushes} honest pushes to be answered", timeout_s=60)


def test_ten_thousand_hostile_messages(start_shard, peer):
    shard = start_shard(
        mode="sync", max_message_bytes=MAX_BYTES, max_pending_per_island=4,
        max_requests_per_s=0.0, max_refusals_per_s=0.0, **SLOW_HB,
    )  # fmt: skip
    flat = small_flat()
    honest = Client(
        ClientConfig(connect=shard.router, island="honest", heartbeat_interval_s=5.0, liveness=20)
    )
    try:
        plan = honest.join(flat).plan
        silent = peer(shard.router, "silent")
        silent.hello()  # a live island that never pushes: sync mode never steps
        victim = peer(shard.router, "victim")
        victim.hello()
        size = plan.fragments[0].size
        valid = []
        for rnd in (1, 2):
            header = push_header(plan, "victim", rnd, 0)
            payload = delta_frames(np.full(size, 0.01 * rnd, np.float32), "int8")
            ack, _ = victim.request(header, payload)
            assert ack["outcome"] == "accepted", ack
            valid.append((header, [bytes(f) for f in payload]))
        watcher = peer(shard.router, "watcher")
        before = _snapshots(watcher, (0, 1))
        status0 = watcher.status()

        messages = hostile_messages(
            random.Random(1234), COUNT, valid, size, MAX_BYTES, frozenset({"silent", "honest"})
        )
        # the victim's own connection: replays from any other are refused island_in_use
        # before the dedup table is consulted (tests/test_shard_identity.py)
        attacker = victim
        outcomes: Counter = Counter()
        by_family: dict[str, Counter] = {f: Counter() for f in FAMILIES}
        honest_pushes = 0
        frames0, _ = codec.int8().encode({"delta": np.full(size, 1e-3, np.float32)})
        for start in range(0, COUNT, WINDOW):
            batch = messages[start : start + WINDOW]
            for _, frames in batch:
                attacker.send_raw(frames)
            if start % (WINDOW * 8) == 0 and honest_pushes < 6:  # honest traffic meanwhile
                honest.push(honest_pushes % 2, 10 + honest_pushes, 0, 1000, 10, frames0)
                honest_pushes += 1
            for family, _ in batch:
                label = _classify(_recv(attacker.sock))
                outcomes[label] += 1
                by_family[family][label] += 1
        assert not attacker.sock.poll(100), "more replies than messages"
        assert sum(outcomes.values()) == COUNT

        stats = _wait_acked(honest, honest_pushes)
        assert stats["acked"] == honest_pushes and not stats["rejected"], stats
        status1 = watcher.status()
        after = _snapshots(watcher, (0, 1))
    finally:
        honest.close(flush_timeout_s=1.0)

    assert after == before, "a hostile message changed the parameters"
    assert status1["steps"] == status0["steps"] == 0
    rejected = Counter(
        {k.split(":", 1)[1]: v for k, v in outcomes.items() if k.startswith("rejected:")}
    )
    grown = Counter(status1["rejected"])
    grown.subtract(status0["rejected"])
    grown["unknown_island"] += status1["hello_requests"] - status0["hello_requests"]
    assert +grown == rejected
    honest_accepted = stats["acked"] - stats["duplicates"]
    assert status1["accepted"] - status0["accepted"] == outcomes["accepted"] + honest_accepted
    assert (
        status1["duplicates"] - status0["duplicates"] == outcomes["duplicate"] + stats["duplicates"]
    )
    assert "internal_error" not in rejected, rejected
    # every family fired, and the faults we meant to inject were seen as such
    assert all(sum(c.values()) >= COUNT // len(FAMILIES) for c in by_family.values())
    assert by_family["replay"]["duplicate"] > 0
    assert by_family["oversize"]["rejected:oversize"] > 0
    assert by_family["non_finite"]["rejected:non_finite"] > 0
    assert by_family["wrong_shape"]["rejected:bad_shape"] > 0
    assert by_family["wrong_dtype"]["rejected:bad_dtype"] > 0
    assert by_family["flip_payload"]["rejected:codec_error"] > 0
    assert by_family["forged_island"]["rejected:unknown_island"] > 0
    assert by_family["bad_version"]["rejected:bad_version"] > 0
    assert by_family["unknown_kind"]["rejected:unknown_kind"] > 0
    assert by_family["random_bytes"]["rejected:malformed"] > 0


def test_per_island_pending_limit_over_the_wire(start_shard, peer):
    shard = start_shard(mode="sync", max_pending_per_island=2, **SLOW_HB)
    honest = Client(ClientConfig(connect=shard.router, island="a", heartbeat_interval_s=5.0))
    try:
        plan = honest.join(small_flat()).plan
        peer(shard.router, "silent").hello()
        p = peer(shard.router, "b")
        p.hello()
        size = plan.fragments[0].size
        zeros = delta_frames(np.zeros(size, np.float32))
        outcomes = [
            p.request(push_header(plan, "b", r, 0), zeros)[0] for r in range(1, 5)
        ]  # two accepted, then refused with a reason, never buffered
        assert [a["outcome"] for a in outcomes] == ["accepted"] * 2 + ["rejected"] * 2
        assert {a["reason"] for a in outcomes[2:]} == {"too_many_pending"}
        status = p.status()
        assert status["pending"] == {"0": 2, "1": 0}
        assert status["rejected"] == {"too_many_pending": 2}
        # another island is not limited by b's backlog
        frames, _ = codec.int8().encode({"delta": np.zeros(size, np.float32)})
        honest.push(0, 1, 0, 100, 1, frames)
        stats = _wait_acked(honest, 1)
        assert stats["acked"] == 1
    finally:
        honest.close(flush_timeout_s=1.0)
