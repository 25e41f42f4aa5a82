"""The round clock: staleness counts the rounds completed since a delta's base, and N
counts the islands that push, not every island heard. Expected values by hand."""

from __future__ import annotations

import numpy as np
import pytest
from shard_helpers import init_payload, plan_for, push_header, small_flat

import codec
from paramserver.server.config import ShardConfig
from paramserver.server.state import ShardState
from paramserver.server.step.weighting import CLOCK_HISTORY as HISTORY
from paramserver.server.step.weighting import (
    ClockError,
    RoundClock,
    make_weighting,
    merge_coefficients,
)
from paramserver.server.storage.checkpoint import export_state, restore_state
from paramserver.wire.protocol import ACCEPTED

pytestmark = pytest.mark.timeout(120)
T0 = 1_000_000.0
G1, G3 = 2**-0.5, 0.5  # g(1) = 2^-0.5 = 0.7071, g(3) = 4^-0.5 at the default exponent 0.5


def test_the_clock_sums_the_shares_of_the_steps_taken():
    clock = RoundClock()
    for share in (1.0, 0.25, 0.25, 0.25, 0.25, 1.0):
        clock.advance(share, [])
    assert clock.version == 6
    assert clock.rounds_at(1) == 1.0 and clock.rounds_at(5) == 2.0 and clock.now == 3.0
    assert clock.staleness(1, 5) == pytest.approx(1.0)  # four quarter steps: one round
    assert clock.staleness(0) == pytest.approx(3.0)
    with pytest.raises(ClockError, match="newer"):
        clock.rounds_at(7)


def test_a_base_older_than_the_history_counts_the_kept_steps_mean_share():
    clock = RoundClock(first_version=10, rounds=[5.0, 5.5, 6.0])  # mean share 1/2
    assert clock.rounds_at(6) == pytest.approx(5.0 - 4 * 0.5)
    assert RoundClock(first_version=4).rounds_at(1) == pytest.approx(-3.0)  # none kept: 1


def test_the_clock_keeps_a_bounded_history():
    clock = RoundClock()
    for _ in range(HISTORY + 6):
        clock.advance(0.5, [])
    assert len(clock.rounds) == HISTORY + 1 and clock.first_version == 6
    assert clock.rounds_at(0) == pytest.approx(0.0)  # 3.0 - 6 versions * the mean 0.5
    assert clock.staleness(0) == pytest.approx((HISTORY + 6) * 0.5)


def test_the_clock_round_trips_through_its_wire_form():
    clock = RoundClock()
    clock.expected({"a", "b", "idle"}, {"a", "b"})
    clock.advance(1.0, ["a", "b"])
    again = RoundClock.from_wire(clock.to_wire(), 1)
    assert again == clock
    assert RoundClock.from_wire(None, 7).version == 7  # a checkpoint before the clock
    with pytest.raises(ClockError, match="ends at version 1, not 2"):
        RoundClock.from_wire(clock.to_wire(), 2)


def test_merge_coefficients_read_staleness_from_the_clock():
    clock = RoundClock()
    for share in (1.0, 1.0, 1.0):
        clock.advance(share, [])
    # a delta 3 full rounds old, merged alone as one of 5 islands: share 1/5, g(3)
    # (versions times the step's share: 3 * 1/5 = 0.6, g = 1.6^-0.5 = 0.79)
    c, _ = merge_coefficients(make_weighting(), [("e", 10, 1, 0)], 3, expected=5, clock=clock)
    assert c == pytest.approx([0.2 * G3])
    c, _ = merge_coefficients(make_weighting(), [("e", 10, 1, 0)], 3, expected=5)
    assert c == pytest.approx([0.2 * 1.6**-0.5])  # without the clock: the approximation


# ----- through the shard's state -------------------------------------------------------


def shard(mode: str, islands) -> tuple[ShardState, object]:
    flat = small_flat()
    plan = plan_for(flat, 1, 1)
    cfg = ShardConfig(mode=mode, quorum=3, fsync=False, downlink="float32", fragments=1)
    state = ShardState(cfg, 0)
    assert state.initialize(plan.to_wire(), init_payload(plan, flat)).status == ACCEPTED
    for island in islands:
        state.hello(island, T0)
    return state, plan


def push(state, plan, island, rnd, base, seed=0):
    size = plan.fragments[0].size
    delta = np.random.default_rng(seed + rnd).standard_normal(size).astype(np.float32) * 0.01
    frames, _ = codec.raw("float32").encode({"delta": delta})
    header = push_header(plan, island, rnd, 0, base, 1000, 10)
    outcome = state.submit_delta(header, frames, T0)
    assert outcome.status == ACCEPTED
    return outcome.event


def step(state) -> dict[str, float]:
    return state.step(0, T0)[1].coefficients  # island -> coefficient, rounded to 4 digits


def test_a_delta_one_round_old_after_four_single_island_steps_gets_g1():
    state, plan = shard("async", "abcd")
    for island in "abcd":
        push(state, plan, island, 1, base=0)
    assert step(state) == {i: 0.25 for i in "abcd"}  # v1: a whole round (clock 1)
    for island, rnd, base in (("a", 2, 1), ("b", 2, 2), ("c", 2, 3), ("a", 3, 4)):
        push(state, plan, island, rnd, base)
        assert step(state) == {island: 0.25}  # one of 4: a quarter round, fresh
    assert state.fragments[0].clock.now == pytest.approx(2.0)  # v5
    for island, rnd in (("a", 4), ("b", 3), ("c", 3)):
        push(state, plan, island, rnd, base=5)
    push(state, plan, "d", 2, base=1)  # four quarter steps old: one round
    # a full step (4 of 4): w = 1/4 each; d: g(1) = 0.7071, not g(4 versions) = 0.447
    got = step(state)
    assert got == pytest.approx({"a": 0.25, "b": 0.25, "c": 0.25, "d": 0.25 * G1}, abs=1e-4)


def test_a_delta_three_full_rounds_old_gets_g3():
    state, plan = shard("async", "abcd")
    for rnd in (1, 2, 3):
        for island in "abcd":
            push(state, plan, island, rnd, base=rnd - 1)
        assert step(state) == {i: 0.25 for i in "abcd"}  # full rounds: clock 1, 2, 3
    state.hello("e", T0)  # a slow newcomer whose delta is based on version 0
    push(state, plan, "e", 1, base=0)
    # merged alone, one of 5 live islands: share 1/5, g(3) = 0.5 -> 0.1 (not 0.2 * 0.79)
    assert step(state) == pytest.approx({"e": 0.2 * G3}, abs=1e-4)


def test_an_island_heard_but_never_pushing_leaves_n_after_a_round():
    state, plan = shard("quorum", "abcd")  # d is live (heartbeats) but never pushes
    shares = []
    for rnd in (1, 2, 3, 4):
        for island in "abcd":
            state.touch(island, T0)
        for island in "abc":
            push(state, plan, island, rnd, base=rnd - 1)
        shares.append(3 * step(state)["a"])  # equal work: coefficient = share / 3
    # d counts one round from when a step first saw it: 3/4, 3/4 (clock 0.75 <= 1),
    # then the 3 pushing islands are a whole round
    assert shares == pytest.approx([0.75, 0.75, 1.0, 1.0], abs=1e-3)
    # once d pushes it counts again, for two rounds after its push
    push(state, plan, "d", 1, base=4)
    for island in "abc":
        push(state, plan, island, 5, base=4)
    assert step(state) == pytest.approx({i: 0.25 for i in "abcd"}, abs=1e-4)
    for island in "abc":
        push(state, plan, island, 6, base=5)
    assert 3 * step(state)["a"] == pytest.approx(0.75, abs=1e-3)


def test_an_island_that_left_does_not_count():
    state, plan = shard("quorum", "abcd")
    for island in "abcd":
        push(state, plan, island, 1, base=0)
    step(state)
    state.bye("d")
    for island in "abc":
        push(state, plan, island, 2, base=1)
    assert 3 * step(state)["a"] == pytest.approx(1.0, abs=1e-3)


def test_the_clock_survives_a_checkpoint_and_replay():
    state, plan = shard("async", "abcd")
    events = [push(state, plan, island, 1, base=0) for island in "abcd"]
    events.append(state.step(0, T0)[0])
    events.append(push(state, plan, "a", 2, base=1))
    events.append(state.step(0, T0)[0])  # one of 4: clock 1, 1.25
    assert [e.expected for e in events if hasattr(e, "expected")] == [4, 4]
    meta, arrays = export_state(state)
    restored = restore_state(state.cfg, 0, meta, arrays)
    assert restored.fragments[0].clock == state.fragments[0].clock
    # replay on a fresh state that heard no island: the logged share rebuilds the clock
    fresh, _ = shard("async", "")
    for event in events:
        fresh.apply(event)
    assert fresh.fragments[0].clock.rounds == pytest.approx([0.0, 1.0, 1.25])
    assert fresh.fragments[0].clock.pushed == {"a": 1.25, "b": 1.0, "c": 1.0, "d": 1.0}


# ----- the per-entry sparse merge is not diluted by the share ------------------------


def test_a_topk_entry_one_island_sent_in_async_lands_at_g_times_its_value():
    state, plan = shard("async", "abc")
    size = plan.fragments[0].size
    top = codec.topk(density=0.02, bits=4)

    def topk_push(island, rnd, base, spikes):
        v = np.random.default_rng(rnd).standard_normal(size).astype(np.float32) * 1e-3
        for pos, value in spikes.items():
            v[pos] = value
        frames, _ = top.encode({"delta": v})
        header = push_header(plan, island, rnd, 0, base, 1000, 10)
        assert state.submit_delta(header, frames, T0).status == ACCEPTED
        return codec.decode(frames)["delta"]

    before = state.snapshot(0)[1].copy()  # sparse steps: SGD at sparse_outer_lr 1.0
    sent = topk_push("a", 1, 0, {3: 1.0, 10: 0.5})
    step(state)  # one of 3 islands: a third of a round (clock 1/3), fresh: g = 1
    move = before - state.snapshot(0)[1]
    for pos in (3, 10):  # applied whole, not at 1/3 (the share)
        assert move[pos] == pytest.approx(sent[pos], rel=1e-6)
    mid = state.snapshot(0)[1].copy()
    sent = topk_push("b", 1, 0, {20: -0.8, 30: 0.6})  # based before a's step: 1/3 round old
    step(state)
    move = mid - state.snapshot(0)[1]
    for pos in (20, 30):  # g(1/3) = (4/3)^-0.5 = 0.866 of its value
        assert move[pos] == pytest.approx((4 / 3) ** -0.5 * sent[pos], rel=1e-5)
