"""paramserver.server.state: validation, dedup, limits, the outer step against a hand computation, replay."""

from dataclasses import replace

import numpy as np
import pytest
from shard_helpers import (
    delta_frames,
    init_payload,
    nan_frames,
    plan_for,
    push_header,
    small_flat,
)

from paramserver.server.config import ShardConfig
from paramserver.server.fragment import StateError
from paramserver.server.state import ShardState
from paramserver.wire.protocol import ACCEPTED, DUPLICATE, REJECTED

T0 = 1_000_000.0


def fresh(cfg=None, flat=None, islands=("a", "b")):
    cfg = cfg or ShardConfig(mode="sync", fsync=False)
    flat = flat or small_flat()
    plan = plan_for(flat, cfg.shards, cfg.num_fragments)
    state = ShardState(cfg, 0)
    out = state.initialize(plan.to_wire(), init_payload(plan, flat))
    assert out.status == ACCEPTED, out
    for island in islands:
        state.hello(island, T0)
    return state, plan, flat


def vec(plan, fragment, seed):
    size = plan.fragments[fragment].size
    return np.random.default_rng(seed).standard_normal(size).astype(np.float32) * 0.01


def push(state, plan, island, rnd, fragment=0, base=0, tokens=1000, steps=10, v=None, now=T0):
    v = vec(plan, fragment, rnd * 31 + hash(island) % 7) if v is None else v
    h = push_header(plan, island, rnd, fragment, base, tokens, steps)
    return state.submit_delta(h, delta_frames(v), now)


def test_init_takes_the_gathered_values_and_a_second_init_is_refused():
    state, plan, flat = fresh()
    for f in plan.fragments_of(0):
        version, values = state.snapshot(f.index)
        assert version == 0
        np.testing.assert_array_equal(values, plan.gather(flat, f.index))
    again = state.initialize(plan.to_wire(), init_payload(plan, flat))
    assert (again.status, again.reason) == (REJECTED, "already_initialized")
    assert state.counters.rejected == {"already_initialized": 1}


def test_init_refuses_a_plan_for_another_cluster_shape():
    flat = small_flat()
    plan = plan_for(flat, 1, 3)
    state = ShardState(ShardConfig(fsync=False), 0)  # 2 fragments
    out = state.initialize(plan.to_wire(), init_payload(plan, flat))
    assert out.reason == "plan_mismatch"
    assert not state.initialized


def test_step_equals_a_hand_computed_nesterov_step_of_the_weighted_merge():
    # exact fp32 downlink: the published state is the optimizer step itself
    cfg = ShardConfig(
        mode="sync", fsync=False, outer_lr=0.5, outer_momentum=0.8, downlink="float32"
    )
    state, plan, _ = fresh(cfg)
    before = state.snapshot(0)[1].copy()
    da, db = vec(plan, 0, 1), vec(plan, 0, 2)
    assert push(state, plan, "a", 1, tokens=4000, steps=10, v=da).status == ACCEPTED
    assert state.due_fragments(T0) == ([], None)  # sync: waiting for b
    assert push(state, plan, "b", 1, tokens=1000, steps=5, v=db).status == ACCEPTED
    due, _ = state.due_fragments(T0)
    assert due == [0]
    event, update = state.step(0, T0)
    assert event.keys == (("a", 1), ("b", 1))
    # default weighting: (tokens / steps)^2 * (1 + staleness)^-0.5, staleness 0 here
    wa, wb = (4000 / 10) ** 2, (1000 / 5) ** 2
    g = (wa * da.astype(np.float64) + wb * db) / (wa + wb)
    # optax sgd(nesterov): m = g (first step), update = g + momentum * m
    expected = before - 0.5 * (g + 0.8 * g)
    np.testing.assert_allclose(update.values, expected, rtol=1e-5, atol=1e-7)
    assert update.version == 1 and state.versions()[0] == 1
    assert state.fragments[0].pending == []
    assert state.counters.staleness == {0: 2} and state.counters.steps == 1


def test_staleness_weights_down_an_old_base_version():
    cfg = ShardConfig(
        mode="async", fsync=False, outer_optimizer="sgd", outer_lr=1.0, downlink="float32"
    )
    state, plan, _ = fresh(cfg)
    push(state, plan, "a", 1)
    state.step(0, T0)
    start = state.snapshot(0)[1].copy()
    da, db = vec(plan, 0, 3), vec(plan, 0, 4)
    push(state, plan, "a", 2, base=1, v=da)  # fresh
    push(state, plan, "b", 1, base=0, v=db)  # one version stale
    _, update = state.step(0, T0)
    # equal work (1000 tokens, 10 steps): w = 1/2 each. The first step merged a alone of
    # the two live islands: half a round, so b's base is half a round old: g(0) = 1,
    # g(1/2) = 1.5^-0.5 (absolute)
    g = 0.5 * da.astype(np.float64) + 0.5 * 1.5**-0.5 * db
    np.testing.assert_allclose(update.values, start - g, rtol=1e-5, atol=1e-7)
    assert state.counters.staleness == {0: 2, 1: 1}


def test_dedup_window_duplicates_out_of_order_and_replays():
    cfg = ShardConfig(mode="sync", fsync=False, dedup_window=4, max_pending_per_island=100)
    state, plan, _ = fresh(cfg)
    assert push(state, plan, "a", 10).status == ACCEPTED
    assert push(state, plan, "a", 10).status == DUPLICATE
    assert push(state, plan, "a", 8).status == ACCEPTED  # older but inside the window, unseen
    assert push(state, plan, "a", 8).status == DUPLICATE
    out = push(state, plan, "a", 5)
    assert (out.status, out.reason) == (REJECTED, "replayed_round")
    assert push(state, plan, "a", 10, fragment=1).status == ACCEPTED  # key includes fragment
    assert state.counters.accepted == 3 and state.counters.duplicates == 2


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda h, p: h.update(plan_hash="0" * 64), "plan_mismatch"),
        (lambda h, p: h.update(fragment=7), "unknown_fragment"),
        (lambda h, p: h.update(island="stranger"), "unknown_island"),
        (lambda h, p: h.update(base_version=3), "future_base_version"),
    ],
)
def test_header_rejections(mutate, reason):
    state, plan, _ = fresh()
    h = push_header(plan, "a", 1, 0)
    mutate(h, plan)
    out = state.submit_delta(h, delta_frames(vec(plan, 0, 0)), T0)
    assert (out.status, out.reason) == (REJECTED, reason)
    if reason == "unknown_island":  # "say hello": counted apart from real rejections
        assert state.counters.rejected == {} and state.counters.hello_requests == 1
    else:
        assert state.counters.rejected == {reason: 1} and state.counters.hello_requests == 0
    assert state.counters.accepted == 0


def test_payload_rejections():
    state, plan, _ = fresh()
    size = plan.fragments[0].size
    h = push_header(plan, "a", 1, 0)
    cases = [
        (delta_frames(np.zeros(size - 1, np.float32)), "bad_shape"),
        (delta_frames(np.zeros((size // 2, 2), np.float32)), "bad_shape"),
        (delta_frames(np.zeros(size + 1, np.float32)), "codec_error"),  # over max_elements
        (delta_frames(np.zeros(size, np.float16)), "bad_dtype"),
        (nan_frames(size), "non_finite"),
        (nan_frames(size, float("inf")), "non_finite"),
        ([b"garbage", b"more"], "codec_error"),
        (delta_frames(np.zeros(size, np.float32))[:1], "codec_error"),
    ]
    for payload, reason in cases:
        out = state.submit_delta(h, payload, T0)
        assert (out.status, out.reason) == (REJECTED, reason), (reason, out)
    assert state.fragments[0].pending == []


def test_pending_limit_per_island():
    cfg = ShardConfig(mode="sync", fsync=False, max_pending_per_island=2)
    state, plan, _ = fresh(cfg)
    assert push(state, plan, "a", 1).status == ACCEPTED
    assert push(state, plan, "a", 2).status == ACCEPTED
    assert push(state, plan, "a", 3).reason == "too_many_pending"
    assert push(state, plan, "b", 1).status == ACCEPTED


def test_island_capacity_evicts_only_silent_islands():
    cfg = ShardConfig(fsync=False, max_islands=2, heartbeat_interval_s=1.0, liveness=2)
    state = ShardState(cfg, 0)
    assert state.hello("a", T0).status == ACCEPTED
    assert state.hello("b", T0).status == ACCEPTED
    assert state.hello("c", T0 + 1).reason == "too_many_islands"
    state.touch("b", T0 + 2)
    assert state.hello("c", T0 + 2.5).status == ACCEPTED  # a is silent (> 2 s) and forgotten
    assert set(state.last_seen) == {"b", "c"}


def test_quorum_counts_live_islands_only():
    cfg = ShardConfig(mode="quorum", quorum=2, fsync=False, heartbeat_interval_s=1, liveness=1)
    state, plan, _ = fresh(cfg)
    later = T0 + 5  # b has been silent for 5 intervals: dead
    state.touch("a", later)
    push(state, plan, "a", 1, now=later)
    assert state.due_fragments(later)[0] == [0]  # every live island is pending


def test_replaying_the_events_rebuilds_the_state_bit_for_bit():
    cfg = ShardConfig(mode="quorum", fsync=False)
    state, plan, _ = fresh(cfg, islands=("a", "b", "c"))
    events = []
    fresh_state = ShardState(cfg, 0)
    events.append(fresh_state.initialize(plan.to_wire(), init_payload(plan, small_flat())).event)
    now = T0
    for rnd in range(1, 7):
        for island in ("a", "b", "c"):
            now += 0.01
            out = push(state, plan, island, rnd, fragment=rnd % 2, base=state.versions()[rnd % 2])
            events.append(out.event)
        for fragment in state.due_fragments(now + 100)[0]:
            events.append(state.step(fragment, now + 100)[0])
    replica = ShardState(cfg, 0)
    for event in events:
        replica.apply(event)
    assert replica.versions() == state.versions() and state.counters.steps == 6  # one a round
    for f in state.fragments:
        assert state.snapshot(f)[1].tobytes() == replica.snapshot(f)[1].tobytes()
    assert replica.counters.accepted == state.counters.accepted


def test_a_step_event_for_a_delta_that_is_not_pending_is_an_error():
    state, plan, _ = fresh()
    push(state, plan, "a", 1)
    event, _ = state.step(0, T0)
    with pytest.raises(StateError, match="not pending"):
        state.apply(replace(event))


def test_status_is_json_ready():
    import json

    state, plan, _ = fresh()
    push(state, plan, "a", 1)
    push(state, plan, "z", 1)
    status = json.loads(json.dumps(state.status(T0)))
    assert status["versions"] == {"0": 0, "1": 0}
    assert status["pending"] == {"0": 1, "1": 0}
    assert status["islands_live"] == ["a", "b"]
    assert status["rejected"] == {} and status["hello_requests"] == 1


def test_a_snapshot_view_survives_later_steps():
    cfg = ShardConfig(mode="async", fsync=False)
    state, plan, _ = fresh(cfg)
    _, view = state.snapshot(0)
    kept = view.copy()
    for rnd in range(1, 4):
        push(state, plan, "a", rnd, base=state.versions()[0])
        state.step(0, T0)
    assert view.tobytes() == kept.tobytes()
    assert state.snapshot(0)[1].tobytes() != kept.tobytes()
