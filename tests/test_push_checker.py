"""A large push's payload checked off the serving loop: answered later, once, after the log has it."""

from __future__ import annotations

import time

import numpy as np
import pytest
from shard_helpers import delta_frames, nan_frames, plan_for, push_header
from shard_sim import Island, ShardSim

import codec
from paramserver.server.admission.outcomes import check_payload
from paramserver.server.effects import PushCheck
from paramserver.server.shard import PushChecker, run_batch
from paramserver.wire import protocol

pytestmark = pytest.mark.timeout(120)


def turn(sim: ShardSim, checker: PushChecker, *requests) -> list[dict]:
    """One loop turn with the checker thread; the replies' headers."""
    sent = run_batch(sim.core, sim.storage, list(requests), sim.now, True, None, checker)
    return [protocol.unpack(m, protocol.REPLY)[0] for c, m in sent if c is not None]


def turns_until(sim: ShardSim, checker: PushChecker, count: int) -> list[dict]:
    """Turns without requests until `count` replies came (the checks finished)."""
    replies: list[dict] = []
    deadline = time.monotonic() + 60
    while len(replies) < count:
        assert time.monotonic() < deadline, f"{len(replies)} of {count} replies after 60 s"
        checker.wait(1.0)
        replies += turn(sim, checker)
    return replies


@pytest.fixture
def checked(tmp_path):
    sim = ShardSim(tmp_path / "shard", mode="sync")  # island b never pushes: no step
    sim.core.check_off_loop_bytes = 1  # every push with a payload is checked off the loop
    checker = PushChecker()
    try:
        yield sim, checker
    finally:
        checker.close()
        sim.storage.close()


def test_a_push_checked_off_the_loop_is_acked_once_after_its_record(checked):
    sim, checker = checked
    a, b = Island("a"), Island("b")
    assert sim.init(a)["kind"] == "init_ok"
    assert sim.one(b.hello())["kind"] == "welcome"
    push = sim.push(a, 1)
    again = Island("a", conn=a.conn)  # the same push sent twice (a re-send before its ack)
    again._ids = iter([999])
    copy = again.request(push_header(sim.plan, "a", 1, 0, 0), delta_frames(sim.delta("a", 1)))
    # the turn that takes the pushes answers the heartbeat, not the pushes (being checked)
    first = turn(sim, checker, push, copy, b.heartbeat())
    assert [r["kind"] for r in first] == ["heartbeat"]
    assert sim.core.checking == 2
    acks = turns_until(sim, checker, 2)
    assert [(r["id"], r["outcome"]) for r in acks] == [(push_id(push), "accepted"),
                                                      (999, "duplicate")]  # fmt: skip
    assert sim.core.checking == 0
    accepted, _ = sim.logged()
    assert accepted == [("a", 1, 0)]  # logged once, before the acks were sent


def test_a_bad_payload_checked_off_the_loop_is_refused(checked):
    sim, checker = checked
    a = Island("a")
    assert sim.init(a)["kind"] == "init_ok"
    size = sim.plan.fragments[0].size
    bad = nan_frames(size)
    assert turn(sim, checker, a.request(push_header(sim.plan, "a", 1, 0, 0), bad)) == []
    (reply,) = turns_until(sim, checker, 1)
    assert reply["kind"] == "ack" and reply["outcome"] == "rejected"
    assert reply["reason"] == "non_finite"
    assert sim.logged()[0] == []


def test_the_check_is_the_norm_the_step_takes(tmp_path):
    vec = np.random.default_rng(0).standard_normal(5000).astype(np.float32)
    frames = delta_frames(vec, "int8")
    job = PushCheck(None, {}, frames, 5000).run()
    assert job.result is not None and job.result.refusal is None
    direct = check_payload(frames, 5000)
    assert job.result.norm == direct.norm
    assert direct.norm == pytest.approx(np.linalg.norm(codec_decoded(frames)), rel=1e-6)
    wrong = PushCheck(None, {}, frames, 4999).run()
    assert wrong.result is not None and wrong.result.refusal is not None


def codec_decoded(frames) -> np.ndarray:
    return codec.decode(frames)["delta"].astype(np.float64)


def push_id(request) -> int:
    return protocol.unpack(request.frames)[0]["id"]


def test_a_push_small_on_the_wire_but_of_a_large_fragment_is_checked_off_the_loop(checked):
    # zstd makes a flat int8 delta tiny to send; its check still decodes the whole fragment
    sim, checker = checked
    sim.flat = {"w": np.linspace(-1, 1, 1 << 16, dtype=np.float32)}  # what the init sends
    sim.plan = plan_for(sim.flat, 1, sim.cfg.num_fragments)
    size = sim.plan.fragments[0].size
    sim.core.check_off_loop_bytes = size  # pushes that send or decode `size` bytes or more
    a = Island("a")
    assert sim.init(a)["kind"] == "init_ok"
    frames, _ = codec.int8().encode({"delta": np.full(size, 0.01, np.float32)})
    sent = sum(memoryview(f).nbytes for f in frames)
    assert sent < size / 8, (sent, size)  # small on the wire
    assert turn(sim, checker, a.request(push_header(sim.plan, "a", 1, 0, 0), frames)) == []
    assert sim.core.checking == 1  # handed to the checker, not checked on the loop
    (reply,) = turns_until(sim, checker, 1)
    assert reply["kind"] == "ack" and reply["outcome"] == "accepted", reply
