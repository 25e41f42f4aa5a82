"""A shard answers while it steps: a real shard process, a fragment large enough that a step takes a while.

Shown by order, not by timing: while `status` says a step of fragment 0 is
under way, a heartbeat, a push to fragment 1 and a second `status` are sent
in one go on one connection; the replies come back in the order the shard
handled them, and the last still says the same step is under way (fragment
0 still at its old version). So the heartbeat was answered and the push
acked while the step ran, before its update was published; the update then
arrives on the PUB.
"""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
import zmq
from conftest import Peer, wait_for
from shard_helpers import delta_frames, init_payload, push_header
from shard_process import ShardProcess

from paramserver.wire.plan import leaf_specs, make_plan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# 2 x 2^25 float32: a step of one fragment decodes, merges, steps and quantizes 32M values
# (2 x 2^24 was stepped too fast to catch in 20 tries in two of three full runs on 2026-12-05)
ELEMENTS = 1 << 26
FLAGS = (
    *("--mode", "async", "--heartbeat-interval-s", "5", "--liveness", "100"),
    *("--checkpoint-every-s", "0", "--checkpoint-every-steps", "0"),
    *("--max-message-bytes", str(512 << 20)),  # the init in one message
    # no fsync: a batch's replies wait for its append's fsync (0.2-0.6 s on this disk), longer
    # than a step of the fused kernel; what is shown here is the loop serving beside the step
    *("--fsync", "false"),
)
TRIES = 20  # steps to catch in progress (one is plenty unless the machine stalls the test;
# a loaded full run missed 6 in a row)


def _caught_in_step(a: Peer, plan, rnd: int) -> dict | None:
    """Push to fragment 0; while its step runs, heartbeat + push to fragment 1 + status."""
    size0, size1 = plan.fragments[0].size, plan.fragments[1].size
    delta = np.random.default_rng(rnd).standard_normal(size0).astype(np.float32) * 0.01
    ack, _ = a.request(
        push_header(plan, "a", rnd, 0, base_version=rnd - 1), delta_frames(delta, "int8")
    )
    assert ack["outcome"] == "accepted", ack
    before = rnd - 1

    def stepping():
        status = a.status()
        if status["versions"]["0"] > before:
            return "done"
        work = status["stepping"]
        return work is not None and work["fragment"] == 0 and status

    seen = wait_for(stepping, "the step of fragment 0 to begin", timeout_s=120, poll_s=0.005)
    small = np.full(size1, 0.01, np.float32)
    if seen == "done":  # over before a status saw it: the round's push to fragment 1 alone
        ack, _ = a.request(
            push_header(plan, "a", rnd, 1, base_version=rnd - 1), delta_frames(small, "int8")
        )
        assert ack["outcome"] == "accepted", ack
        return None
    ids = [
        a.send({"kind": "heartbeat", "island": "a"}),
        a.send(push_header(plan, "a", rnd, 1, base_version=rnd - 1), delta_frames(small, "int8")),
        a.send({"kind": "status"}),
    ]
    # an ack waits for its record's fsync (the log writer thread): it may come after the status
    by_id = {r["id"]: r for r in (a.recv(timeout_s=120)[0] for _ in ids)}
    assert sorted(by_id) == sorted(ids), by_id
    heartbeat, ack1, status = (by_id[i] for i in ids)
    assert heartbeat["kind"] == "heartbeat", heartbeat
    assert ack1["kind"] == "ack" and ack1["outcome"] == "accepted", ack1
    work = status["status"]["stepping"]
    if work is None or work["fragment"] != 0 or status["status"]["versions"]["0"] != before:
        return None  # the step ended before the last of the three was handled: try again
    return {"heartbeat": heartbeat, "ack": ack1, "status": status["status"]}


def test_heartbeats_and_acks_are_answered_while_a_step_runs(tmp_path, zmq_ctx):
    flat = {"w": np.random.default_rng(0).standard_normal(ELEMENTS).astype(np.float32) * 0.1}
    plan = make_plan(leaf_specs(flat), 1, 2)
    shard = ShardProcess(tmp_path / "server", *FLAGS)
    sub = zmq_ctx.socket(zmq.SUB)
    a = None
    try:
        shard.wait_ready(zmq_ctx, timeout_s=120)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{shard.port + 1}")
        a = Peer(zmq_ctx, shard.router, "a")
        a.hello()
        reply, _ = a.request(
            {"kind": "init", "island": "a", "plan": plan.to_wire()}, init_payload(plan, flat)
        )
        assert reply["kind"] == "init_ok", reply
        caught = None
        for rnd in range(1, TRIES + 1):
            caught = _caught_in_step(a, plan, rnd)
            # each round's steps (fragment 0, then 1) are over before the next round
            wait_for(
                lambda r=rnd: a.status()["versions"] == {"0": r, "1": r},
                "the round's steps",
                timeout_s=120,
            )
            if caught is not None:
                break
        assert caught is not None, f"no step of fragment 0 caught in progress in {TRIES} tries"
        # the step caught in progress was published after the replies, and is version rnd
        versions = set()
        deadline = time.monotonic() + 60
        while (0, rnd) not in versions and time.monotonic() < deadline:
            if sub.poll(100):
                frames = sub.recv_multipart()
                header = msgpack.unpackb(frames[0], raw=False)
                if header["kind"] == "update":
                    versions.add((header["fragment"], header["version"]))
        assert (0, rnd) in versions, versions
    finally:
        if a is not None:
            a.close()
        sub.close(0)
        assert shard.stop() == 0, shard.output
