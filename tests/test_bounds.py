"""Bounded inputs through a real shard on loopback: hostile pushes are refused, the model stays honest.

The attacks of issue 33 (a finite delta of 3e38 everywhere, tokens = 2**62 with a
+1 delta, tokens = 2**63, round = 2**64 - 1) are sent between two honest pushes
by a second island with its own id; the shard's parameters afterwards equal the
honest ones computed by hand (outer SGD, lr 1, float32 downlink, two live
islands: each async step merges 1/2 of its delta).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import wait_for
from shard_helpers import delta_frames, init_payload, plan_for, push_header, small_flat

from paramserver.wire.protocol import ACCEPTED, REJECTED

pytestmark = pytest.mark.timeout(120)

SETTINGS = dict(
    mode="async",
    outer_optimizer="sgd",
    outer_lr=1.0,
    downlink="float32",
    liveness=1000,  # both islands stay live for the whole test: every step is half a round
    max_requests_per_s=0.0,
)


def _now_round() -> int:
    return time.time_ns() // 1000


def _started(start_shard, peer, **overrides):
    shard = start_shard(**{**SETTINGS, **overrides})
    flat = small_flat()
    plan = plan_for(flat, 1, 2)
    honest = peer(shard.router, "honest")
    honest.hello()
    reply, _ = honest.request(
        {"kind": "init", "island": "honest", "plan": plan.to_wire()}, init_payload(plan, flat)
    )
    assert reply["kind"] == "init_ok", reply
    return shard, plan, flat, honest


def _push(p, plan, rnd, vec, base, **fields):
    header = {**push_header(plan, p.island, rnd, 0, base), **fields}
    reply, _ = p.request(header, delta_frames(np.asarray(vec, np.float32)))
    assert reply["kind"] == "ack", reply
    return reply


def _version(p) -> int:
    return p.status()["versions"]["0"]


def test_hostile_pushes_are_refused_and_the_model_stays_honest(start_shard, peer):
    shard, plan, flat, honest = _started(start_shard, peer)
    attacker = peer(shard.router, "mallory")
    attacker.hello()
    size = plan.fragments[0].size
    rng = np.random.default_rng(7)
    d1, d2 = (rng.standard_normal(size).astype(np.float32) * 1e-3 for _ in range(2))
    r0 = _now_round()

    assert _push(honest, plan, r0, d1, 0)["outcome"] == ACCEPTED
    wait_for(lambda: _version(honest) == 1, "the first honest step")

    attacks = {
        "3e38 everywhere": (np.full(size, 3e38, np.float32), {}),
        "tokens 2**62, +1 delta": (np.ones(size, np.float32), {"tokens": 2**62}),
        "tokens 2**63, +1 delta": (np.ones(size, np.float32), {"tokens": 2**63}),
        "steps 2**40": (np.ones(size, np.float32) * 1e-3, {"steps": 2**40}),
        "round 2**64 - 1": (np.ones(size, np.float32) * 1e-3, {"round": 2**64 - 1}),
    }
    reasons = {}
    for i, (name, (vec, fields)) in enumerate(attacks.items()):
        reply = _push(attacker, plan, fields.pop("round", r0 + i), vec, 1, **fields)
        assert reply["outcome"] == REJECTED, (name, reply)
        reasons[name] = reply["reason"]
    assert reasons == {
        "3e38 everywhere": "delta_too_large",
        "tokens 2**62, +1 delta": "bad_tokens",
        "tokens 2**63, +1 delta": "bad_tokens",
        "steps 2**40": "bad_tokens",
        "round 2**64 - 1": "bad_round",
    }

    assert _push(honest, plan, r0 + 1, d2, 1)["outcome"] == ACCEPTED
    wait_for(lambda: _version(honest) == 2, "the second honest step")
    _, values = honest.snapshot(0, size)

    # by hand: outer SGD lr 1; 2 live islands, 1 merged: each step applies half its delta
    p0 = plan.gather(flat, 0)
    expected = (p0 - np.float32(0.5) * d1) - np.float32(0.5) * d2
    assert np.all(np.isfinite(values))
    np.testing.assert_allclose(values, expected, rtol=0, atol=1e-6)

    # the island whose round 2**64 - 1 was refused is not locked out: its next round is taken
    reply = _push(attacker, plan, _now_round(), d1, 2)
    assert reply["outcome"] == ACCEPTED, reply
    status = honest.status()
    assert status["rejected"]["delta_too_large"] == 1
    assert status["rejected"]["bad_tokens"] == 3
    assert status["rejected"]["bad_round"] == 1
    assert status["non_finite_steps"] == 0


def test_an_outsized_delta_is_clipped_to_the_recent_median(start_shard, peer):
    """Past the warm-up (4 accepted norms), a delta far above the median is scaled to 10x it."""
    shard, plan, flat, honest = _started(start_shard, peer, liveness=5)
    size = plan.fragments[0].size
    rng = np.random.default_rng(3)
    r0 = _now_round()
    for k in range(4):
        d = rng.standard_normal(size).astype(np.float32) * 1e-3
        assert _push(honest, plan, r0 + k, d, k)["outcome"] == ACCEPTED
        wait_for(lambda k=k: _version(honest) == k + 1, "an honest step")
    _, before = honest.snapshot(0, size)
    # a +1 delta is within the absolute bound (10 x the parameter norm) but ~1000x the median
    assert _push(honest, plan, r0 + 4, np.ones(size, np.float32), 4)["outcome"] == ACCEPTED
    wait_for(lambda: _version(honest) == 5, "the step of the outsized delta")
    _, after = honest.snapshot(0, size)
    status = honest.status()
    assert status["clipped"] == 1
    moved = float(np.linalg.norm(after.astype(np.float64) - before))
    assert moved <= 10 * 1.1e-3 * np.sqrt(size)  # 10 x the median norm, lr 1, one island


def test_weight_cap_keeps_a_token_inflated_island_from_silencing_others():
    """Pure rule: one island's work weight is capped at max_weight_ratio x the others' largest."""
    from paramserver.server.step.weighting import cap_work, make_weighting, merge_coefficients

    assert cap_work({"a": 1.0, "b": 1e12}, 16.0) == {"a": 1.0, "b": 16.0}
    assert cap_work({"a": 1.0, "b": 4.0}, 16.0) == {"a": 1.0, "b": 4.0}
    assert cap_work({"a": 5.0}, 16.0) == {"a": 5.0}
    weighting = make_weighting(max_weight_ratio=16.0)
    coefficients, _ = merge_coefficients(
        weighting, [("a", 1000, 10, 0), ("b", 2**40, 10, 0)], current_version=0
    )
    assert coefficients == pytest.approx([1 / 17, 16 / 17])


def _checkpoint_bytes(data_dir) -> int:
    """The newest checkpoint's size (0 before the first); the shard removes older ones as
    it writes new ones, so a file listed may be gone by its stat: read the list again."""
    deadline = time.monotonic() + 30.0
    while True:
        sizes = {}
        try:
            for path in data_dir.rglob("checkpoint-*.ckpt"):
                st = path.stat()
                sizes[st.st_mtime_ns, path.name] = st.st_size
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise
            continue
        return sizes[max(sizes)] if sizes else 0


@pytest.mark.timeout(300)
def test_churn_of_3000_ids_leaves_status_and_checkpoints_bounded(start_shard, peer, tmp_path):
    """3,000 ids, each hello + one push + bye, from one connection: all forgotten after the TTL."""
    shard, plan, flat, honest = _started(
        start_shard, peer, island_ttl_s=0.5, checkpoint_every_steps=5, max_islands=4096
    )
    size = plan.fragments[0].size
    delta = np.full(size, 1e-4, np.float32)
    frames = delta_frames(delta)
    churn = peer(shard.router, "churn")
    r0 = _now_round()
    for k in range(5):  # the honest island's own history: the baseline checkpoint
        assert _push(honest, plan, r0 + k, delta, 0)["outcome"] == ACCEPTED
        # one step per push (a push during a step would join the next one)
        wait_for(lambda k=k: _version(honest) >= k + 1, "the honest step")
    wait_for(lambda: _checkpoint_bytes(tmp_path), "a first checkpoint")
    baseline = _checkpoint_bytes(tmp_path)
    ids, batch, acks = 3000, 100, 0
    for start in range(0, ids, batch):
        for i in range(start, start + batch):
            island = f"churn-{i:05d}"
            churn.send({"kind": "hello", "island": island})
            churn.send(push_header(plan, island, r0, 0, 0), frames)
            churn.send({"kind": "bye", "island": island})
        for _ in range(3 * batch):
            reply, _ = churn.recv()
            assert reply["kind"] in ("welcome", "ack", "bye_ok"), reply
            acks += reply["kind"] == "ack" and reply["outcome"] == ACCEPTED
    assert acks == ids
    wait_for(lambda: honest.status()["forgotten_islands"] >= ids, "the churned ids forgotten")
    for k in range(5, 25):  # more honest steps: a checkpoint after the forgetting
        assert _push(honest, plan, r0 + k, delta, 0)["outcome"] == ACCEPTED
        wait_for(lambda k=k: _version(honest) >= k + 1, "the later honest step")
    status = honest.status()
    after = _checkpoint_bytes(tmp_path)
    print(f"churn: checkpoint {baseline} -> {after} bytes, status.islands {len(status['islands'])}")
    assert len(status["islands"]) <= 3, sorted(status["islands"])[:5]
    assert len(status["credited_tokens"]) <= 3
    assert status["islands_known"] <= 3
    assert after < 2 * baseline + 4096, (baseline, after)


def test_median_merge_by_hand():
    """merge=median: (sum_i C_i) * the coordinate-wise median over islands of u_i / C_i."""
    from paramserver.server.step.merge import chunk_merge
    from paramserver.wire.plan import leaf_specs, make_plan

    flat = {"w": np.zeros(6, np.float32)}
    fragment = make_plan(leaf_specs(flat), 1, 1).fragments[0]
    a = np.array([1, 2, 3, 4, 5, 6], np.float32)
    b = np.array([2, 2, 2, 2, 2, 2], np.float32)
    evil = np.array([1e6, -1e6, 1e6, -1e6, 1e6, -1e6], np.float32)
    deltas = [("a", a), ("b", b), ("evil", evil)]
    coefficients = [0.2, 0.2, 0.6]  # evil claims most of the weight
    merged = chunk_merge("median", deltas, coefficients, fragment).whole()
    expected = 1.0 * np.median(np.stack([a, b, evil]).astype(np.float64), axis=0)
    np.testing.assert_allclose(merged, expected.astype(np.float32))
    assert np.abs(merged).max() <= 6.0  # the outlier moves nothing past the honest values
    # an island's two increments are summed first (u_i / C_i: its mean delta), one island = mean
    two = chunk_merge("median", [("a", a), ("a", b)], [0.25, 0.25], fragment).whole()
    np.testing.assert_allclose(two, 0.25 * a + 0.25 * b, rtol=1e-6)


def test_a_shard_steps_with_the_median_merge(start_shard, peer):
    """merge=median through a real shard: one island's step equals its delta's (mean) step."""
    shard, plan, flat, honest = _started(start_shard, peer, merge="median", liveness=5)
    size = plan.fragments[0].size
    d = np.random.default_rng(5).standard_normal(size).astype(np.float32) * 1e-3
    assert _push(honest, plan, _now_round(), d, 0)["outcome"] == ACCEPTED
    wait_for(lambda: _version(honest) == 1, "the median step")
    _, values = honest.snapshot(0, size)
    np.testing.assert_allclose(values, plan.gather(flat, 0) - d, rtol=0, atol=1e-6)


def test_a_silent_island_with_a_session_is_not_taken_over_without_its_token(start_shard, peer):
    """Through a real shard: past quiet_s a stranger's hello is still refused until expire_s."""
    shard = start_shard(heartbeat_interval_s=0.2, liveness=10, max_requests_per_s=0.0)
    owner = peer(shard.router, "x")
    reply, _ = owner.request({"kind": "hello", "island": "x", "session": "owner-token"})
    assert reply["kind"] == "welcome", reply
    heard = time.monotonic()
    stranger = peer(shard.router, "x")
    wait_for(lambda: time.monotonic() - heard > 0.6, "silence past quiet_s (0.4 s)", poll_s=0.05)
    reply, _ = stranger.request({"kind": "hello", "island": "x"})
    if time.monotonic() - heard < 2.0:  # still within expire_s (liveness x interval)
        assert reply["kind"] == "rejected" and reply["reason"] == "island_in_use", reply
    reply, _ = stranger.request({"kind": "hello", "island": "x", "session": "owner-token"})
    assert reply["kind"] == "welcome", reply  # the token takes it at once
    moved = time.monotonic()
    wait_for(lambda: time.monotonic() - moved > 2.2, "the island dead (expire_s 2 s)", poll_s=0.05)
    third = peer(shard.router, "x")
    reply, _ = third.request({"kind": "hello", "island": "x"})
    assert reply["kind"] == "welcome", reply  # a dead island's id is free again


def test_dedup_with_a_floor_refuses_only_below_it():
    """Pure state: with `floor` a round far below the newest is fresh until the floor passes it."""
    from paramserver.server.config import ShardConfig
    from paramserver.server.state import ShardState

    cfg = ShardConfig(mode="async", fsync=False, dedup_window=2, max_pending_per_island=64)
    flat = small_flat()
    plan = plan_for(flat, 1, 2)
    state = ShardState(cfg, 0)
    state.initialize(plan.to_wire(), init_payload(plan, flat))
    state.hello("a", 1000.0)
    frames = delta_frames(np.full(plan.fragments[0].size, 1e-3, np.float32))

    def push(rnd, floor=None):
        header = push_header(plan, "a", rnd, 0, 0)
        if floor is not None:
            header["floor"] = floor
        return state.submit_delta(header, frames, 1000.0)

    assert push(10, floor=10).status == ACCEPTED
    for rnd in range(11, 20):  # round 10's push is "unacked" at the client: floor stays 10
        assert push(rnd, floor=10).status == ACCEPTED
    assert push(10, floor=10).status == "duplicate"  # remembered past the window of 2
    assert push(20, floor=19).status == ACCEPTED  # the client now says all below 19 acked
    assert push(12, floor=19).reason == "replayed_round"  # forgotten: below the floor
    assert push(19, floor=19).status == "duplicate"
    # without a floor (an outside client) the window alone decides, as before
    state.hello("b", 1000.0)
    hb = push_header(plan, "b", 100, 0, 0)
    assert state.submit_delta(hb, frames, 1000.0).status == ACCEPTED
    old = push_header(plan, "b", 97, 0, 0)
    assert state.submit_delta(old, frames, 1000.0).reason == "replayed_round"
