"""Sparse top-k deltas (SparseLoCo): the per-entry merge by hand, no outer momentum, and
error feedback that keeps what the shards did not apply."""

from __future__ import annotations

import numpy as np
import pytest
from client_helpers import clients
from conftest import wait_for
from shard_helpers import init_payload, plan_for, push_header, small_flat

import codec
from bench import claims
from paramserver.server.config import ShardConfig
from paramserver.server.state import ShardState
from paramserver.server.step.merge import ArrayDelta, MergeError
from paramserver.server.step.sparse_merge import sparse_merge
from paramserver.wire.protocol import ACCEPTED

pytestmark = pytest.mark.timeout(60)
T0 = 1_000_000.0


def merged(deltas, coefficients, size=8):
    out = sparse_merge(deltas, coefficients, size).whole()
    assert out.dtype == np.float32
    return out


def test_an_entry_sent_by_one_of_three_islands_is_applied_at_full_weight():
    a = np.array([2, 0, 0, 4, 0, 0, 0, 0], np.float32)
    b = np.array([0, 0, 0, 1, 0, 6, 0, 0], np.float32)
    c = np.array([0, 0, 0, 1, 0, 0, 0, -3], np.float32)
    third = 1 / 3
    got = merged([("a", a), ("b", b), ("c", c)], [third, third, third])
    # e0: a alone -> 2; e3: all three -> (4 + 1 + 1) / 3; e5: b alone; e7: c alone
    np.testing.assert_allclose(got, [2, 0, 0, 2, 0, 6, 0, -3], rtol=1e-6)


def test_unequal_coefficients_average_each_entry_over_its_senders():
    a = np.array([2, 0, 4, 0, 0, 0, 0, 0], np.float32)
    b = np.array([0, 8, 4, 0, 0, 0, 0, 0], np.float32)
    c = np.array([0, 0, 4, 1, 0, 0, 0, 0], np.float32)
    got = merged([("a", a), ("b", b), ("c", c)], [0.5, 0.25, 0.25])
    # shares p = (0.5, 0.25, 0.25): e0 = 0.5*2/0.5, e1 = 0.25*8/0.25, e2 the mean = 4,
    # e3 = 0.25*1/0.25
    np.testing.assert_allclose(got, [2, 8, 4, 1, 0, 0, 0, 0], rtol=1e-6)
    # a stale step (coefficients summing to 0.5) keeps the step's size: entries halve
    half = merged([("a", a), ("b", b), ("c", c)], [0.25, 0.125, 0.125])
    np.testing.assert_allclose(half, [1, 4, 2, 0.5, 0, 0, 0, 0], rtol=1e-6)


def test_an_islands_increments_add_and_it_counts_once_per_entry():
    first = np.array([1, 0, 2, 0, 0, 0, 0, 0], np.float32)
    second = np.array([1, 0, 0, 0, 0, 0, 0, 5], np.float32)  # disjoint work of the same island
    other = np.array([0, 3, 2, 0, 0, 0, 0, 0], np.float32)
    got = merged([("a", first), ("b", other), ("a", second)], [0.5, 0.5, 0.5])
    # p_a = p_b = 1/2; e0: a alone, 0.5*(1+1)/0.5 = 2; e2: (0.5*2 + 0.5*2) / 1 = 2
    np.testing.assert_allclose(got, [2, 3, 2, 0, 0, 0, 0, 5], rtol=1e-6)


def test_any_split_of_the_fill_gives_the_same_bits():
    rng = np.random.default_rng(0)
    size = 70_001
    deltas = []
    for i in range(3):
        d = np.zeros(size, np.float32)
        picks = rng.choice(size, 3000, replace=False)
        d[picks] = rng.standard_normal(3000).astype(np.float32)
        deltas.append((f"i{i}", ArrayDelta(d)))
    merge = sparse_merge(deltas, [0.2, 0.3, 0.5], size)
    whole = merge.whole()
    parts = np.empty(size, np.float32)
    for lo, hi in [(0, 1), (1, 65_537), (65_537, 65_540), (65_540, size)]:
        merge.fill(lo, hi, parts[lo:hi])
    np.testing.assert_array_equal(parts, whole)


def test_bad_inputs_are_refused_clearly():
    with pytest.raises(MergeError, match="2 deltas but 1 coefficients"):
        sparse_merge([("a", np.zeros(8)), ("b", np.zeros(8))], [1.0], 8)
    with pytest.raises(MergeError, match="a delta of 4 elements for a fragment of 8"):
        sparse_merge([("a", np.zeros(4, np.float32))], [1.0], 8)
    with pytest.raises(MergeError, match="must be >= 0 with a positive sum"):
        sparse_merge([("a", np.zeros(8, np.float32))], [0.0], 8)


# -- through a live ShardState: topk-coded pushes ---------------------------------------


def shard(islands, **overrides):
    cfg = ShardConfig(mode="sync", fsync=False, downlink="float32", **overrides)
    flat = small_flat()
    plan = plan_for(flat, cfg.shards, cfg.num_fragments)
    state = ShardState(cfg, 0)
    assert state.initialize(plan.to_wire(), init_payload(plan, flat)).status == ACCEPTED
    for island in islands:
        state.hello(island, T0)
    return state, plan


def spiky(size, spikes):
    """A small noise vector with large entries at the given positions (topk sends those)."""
    v = np.random.default_rng(len(spikes)).standard_normal(size).astype(np.float32) * 1e-3
    for pos, value in spikes.items():
        v[pos] = value
    return v


def round_of(state, plan, deltas, rnd, now):
    top = codec.topk(density=0.02, bits=4)
    sent = {}
    for island, v in deltas.items():
        frames, _ = top.encode({"delta": v})
        sent[island] = codec.decode(frames)["delta"]
        header = push_header(plan, island, rnd, 0, rnd - 1, 1000, 10)
        assert state.submit_delta(header, frames, now).status == ACCEPTED
    assert state.due_fragments(now)[0] == [0]
    state.step(0, now)
    return sent


def test_a_live_shard_applies_a_lone_topk_entry_whole_and_keeps_no_momentum():
    state, plan = shard(["a", "b", "c"], sparse_outer_lr=1.0)
    size = plan.fragments[0].size  # 128 elements: 2 entries per push at density 0.02
    before = state.snapshot(0)[1].copy()
    deltas = {
        "a": spiky(size, {3: 1.0, 10: 0.5}),
        "b": spiky(size, {3: 2.0, 20: -0.8}),
        "c": spiky(size, {30: 0.6, 40: -0.4}),
    }
    sent = round_of(state, plan, deltas, 1, T0)
    assert all(np.count_nonzero(s) == 2 for s in sent.values())
    after = state.snapshot(0)[1]
    move = before - after  # SGD lr 1: the params move by the merged delta
    for pos, island in [(10, "a"), (20, "b"), (30, "c"), (40, "c")]:  # sent by one island
        assert move[pos] == pytest.approx(sent[island][pos], rel=1e-6)
    assert move[3] == pytest.approx((sent["a"][3] + sent["b"][3]) / 2, rel=1e-6)
    untouched = np.setdiff1d(np.arange(size), [3, 10, 20, 30, 40])
    np.testing.assert_array_equal(move[untouched], 0)
    # a second round that sends other entries: only they move (no momentum replays round 1)
    mid = after.copy()
    second = {i: spiky(size, {50 + k: 0.3, 60 + k: 0.2}) for k, i in enumerate("abc")}
    sent = round_of(state, plan, second, 2, T0 + 1)
    move = mid - state.snapshot(0)[1]
    for k, island in enumerate("abc"):
        assert move[50 + k] == pytest.approx(sent[island][50 + k], rel=1e-6)
    np.testing.assert_array_equal(move[[3, 10, 20, 30, 40]], 0)


def test_the_sparse_outer_lr_scales_the_step():
    state, plan = shard(["a"], sparse_outer_lr=0.5)
    size = plan.fragments[0].size
    before = state.snapshot(0)[1].copy()
    sent = round_of(state, plan, {"a": spiky(size, {7: 1.0, 9: 0.5})}, 1, T0)
    move = before - state.snapshot(0)[1]
    assert move[7] == pytest.approx(0.5 * sent["a"][7], rel=1e-6)


def test_sparse_outer_lr_must_be_positive():
    with pytest.raises(ValueError, match=r"sparse_outer_lr=0: must be a finite number > 0"):
        ShardConfig(sparse_outer_lr=0)


# -- the island's error feedback --------------------------------------------------------


def test_topk_error_feedback_keeps_what_a_refused_push_did_not_apply():
    top = codec.topk(density=0.02, bits=2)
    v = np.random.default_rng(5).standard_normal(4096).astype(np.float32)
    state = top.init({"delta": v})
    frames, state = top.encode({"delta": v}, state)
    sent = codec.decode(frames)["delta"]
    assert np.count_nonzero(sent) == 82  # 2% of one chunk went out, the rest stayed
    state = codec.refund(state, {"delta": sent})  # the shard refused it: nothing applied
    np.testing.assert_allclose(state.residuals[0], v, atol=1e-6)  # all of it is owed again
    again, state = top.encode({"delta": np.zeros_like(v)}, state)
    np.testing.assert_array_equal(
        np.flatnonzero(codec.decode(again)["delta"]), np.flatnonzero(sent)
    )


@pytest.fixture
def client():
    yield from clients()


def test_a_finally_refused_push_comes_back_from_the_client_for_its_error_feedback(cluster, client):
    c = cluster(1)
    a = client(c.connect, "a")
    res = a.join(small_flat(0))
    size = res.plan.fragments[0].size
    top = codec.topk(density=0.02, bits=2)
    v = spiky(size, {5: 1.0, 9: -0.7})
    state = top.init({"delta": v})
    frames, state = top.encode({"delta": v}, state)
    a.push(0, 1, res.versions[0] + 5, 100, 5, frames)  # a base version from the future
    wait_for(lambda: a.stats()["rejected"], "the rejection")
    assert a.stats()["rejected"] == {"future_base_version": 1}
    refused = a.take_refused()
    assert [(f, r) for f, r, _ in refused] == [(0, 1)]
    assert a.take_refused() == []  # handed out once
    back = codec.decode(refused[0][2])["delta"]
    np.testing.assert_array_equal(back, codec.decode(frames)["delta"])
    state = codec.refund(state, {"delta": back})
    np.testing.assert_allclose(state.residuals[0], v, atol=1e-6)


def test_the_report_claim_reads_topk_against_int8_at_h30():
    def runs(ratio, topk_loss):
        return {
            "h30-topk": {"ddp_over_this": ratio, "ddp_over_this_steady": 2000.0,
                         "eval_final": topk_loss},
            "h30-int8": {"ddp_over_this": 300.0, "eval_final": 2.0},
        }  # fmt: skip

    (met,) = claims._sparseloco_claims(runs(1100.0, 2.059))  # +2.95%
    assert met["met"] is True
    assert met["measured"]["loss_vs_int8_h30"] == pytest.approx(0.0295)
    assert claims._sparseloco_claims(runs(900.0, 2.0))[0]["met"] is False  # bytes
    assert claims._sparseloco_claims(runs(1100.0, 2.07))[0]["met"] is False  # +3.5%
    assert claims._sparseloco_claims({}) == []


def test_a_sparse_step_publishes_zstd_int8_frames_a_replica_adds_bit_exactly():
    cfg = ShardConfig(mode="sync", fsync=False, downlink="int8")
    flat = {"w": np.random.default_rng(1).standard_normal(40_000).astype(np.float32)}
    plan = plan_for(flat, cfg.shards, cfg.num_fragments)
    state = ShardState(cfg, 0)
    assert state.initialize(plan.to_wire(), init_payload(plan, flat)).status == ACCEPTED
    state.hello("a", T0)
    replica = plan.gather(flat, 0)
    v = np.random.default_rng(2).standard_normal(plan.fragments[0].size).astype(np.float32)
    frames, _ = codec.topk(density=0.02).encode({"delta": v})
    assert state.submit_delta(push_header(plan, "a", 1, 0), frames, T0).status == ACCEPTED
    _, update = state.step(0, T0)
    published = list(update.frames)
    assert codec.decode(published)["values"].dtype == np.float32
    replica = np.add(replica, codec.decode(published)["values"], dtype=np.float32)
    assert replica.tobytes() == state.snapshot(0)[1].tobytes()
    dense = plan.fragments[0].size  # uncompressed int8: one byte per entry
    assert sum(len(memoryview(f)) for f in published) < dense / 3  # 2% of the entries moved
