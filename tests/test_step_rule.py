"""The step per round does not grow with the island count; staleness is per increment.

Through the shard's core (`ShardState`, default outer settings, float32
downlink): K islands each push the same delta d in one round, and the
parameters' movement over the round, measured against the pushed d, stays
within 20% of K = 1's in async and quorum mode. The expected values are
written out by hand from the rule (weighting.py's module docstring).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import codec
from paramserver.server.config import ShardConfig
from paramserver.server.state import ShardState
from paramserver.server.step.weighting import make_weighting, merge_coefficients
from paramserver.wire.plan import leaf_specs, make_plan

pytestmark = pytest.mark.timeout(120)

T0 = 1_000_000.0
# the hand values below take DiLoCo's Nesterov 0.7 / 0.9 for quorum steps and lr 0.7
# without momentum for async steps, given (the defaults depend on H and the island count:
# config.outer_defaults)
OUTER = {
    "quorum": {"outer_lr": 0.7, "outer_momentum": 0.9},
    "async": {"outer_lr": 0.7, "outer_momentum": 0.0},
}
SIZE = 2048


def _round(mode: str, k: int, spaced: bool = True) -> float:
    """K islands push the same d (base 0) one second apart; |movement| / |d| over the round."""
    rng = np.random.default_rng(7)
    init = {"w": rng.standard_normal(SIZE).astype(np.float32)}
    d = (rng.standard_normal(SIZE) * 0.01).astype(np.float32)
    cfg = ShardConfig(
        mode=mode, fsync=False, downlink="float32", fragments=1, **OUTER.get(mode, {})
    )
    plan = make_plan(leaf_specs(init), 1, 1)
    state = ShardState(cfg, 0)
    state.initialize(plan.to_wire(), codec.raw("float32").encode({"0": init["w"]})[0])
    islands = [f"i{i}" for i in range(k)]
    for island in islands:
        state.hello(island, T0)
    payload = codec.raw("float32").encode({"delta": d})[0]

    def step_due(now: float) -> float | None:
        for island in islands:  # every island is live: heartbeats
            state.touch(island, now)
        while True:
            due, wake = state.due_fragments(now)
            if not due:
                return wake
            state.step(0, now)

    wake = None
    for i, island in enumerate(islands):
        now = T0 + (i if spaced else 0)
        while wake is not None and wake <= now:  # the grace window closed first
            wake = step_due(wake)
        header = {"island": island, "round": 1, "fragment": 0, "base_version": 0,
                  "tokens": 1000, "steps": 10, "plan_hash": plan.hash}  # fmt: skip
        assert state.submit_delta(header, payload, now).status == "accepted"
        wake = step_due(now)
    while wake is not None:
        wake = step_due(wake)
    assert not state.fragments[0].pending
    moved = state.snapshot(0)[1].astype(np.float64) - init["w"]
    return float(np.linalg.norm(moved) / np.linalg.norm(d.astype(np.float64)))


def test_async_round_movement_is_the_same_for_1_2_4_8_islands():
    # async at lr 0.7, no momentum (given). The k-th delta (k = 0..K-1) is k versions
    # old, k/K of a round: c_k = (1/K) * (1 + k/K)^-0.5, movement 0.7 * sum_k c_k
    moved = {k: _round("async", k) for k in (1, 2, 4, 8)}
    for k, m in moved.items():
        by_hand = 0.7 / k * sum((1 + j / k) ** -0.5 for j in range(k))
        assert m == pytest.approx(by_hand, rel=1e-4), k
        assert abs(m / moved[1] - 1) <= 0.2, (k, m, moved[1])  # counting versions: 1.7x at K=2


def test_quorum_round_movement_is_the_same_for_1_2_4_8_islands():
    # quorum 2, arrivals 1 s apart: the window closes on every pair, K/2 steps a round.
    # K = 1: one Nesterov step (lr 0.7, momentum 0.9) on d: 0.7 * 1.9 = 1.33 |d|
    moved = {k: _round("quorum", k) for k in (1, 2, 4, 8)}
    assert moved[1] == pytest.approx(1.33, rel=1e-4)
    assert moved[2] == pytest.approx(1.33, rel=1e-4)  # one step on the mean of two
    # K = 4: two steps of half a round. Step 1: g1 = d/2, momentum m = 0.9*0 + g1, no
    # momentum move (-0.7 g1). Step 2 (1 version = 1/2 round stale): g2 = (1.5)^-0.5 d/2,
    # m = g1 + g2, the round is complete: -0.7 * (g2 + 0.9 m)
    g1, g2 = 0.5, 0.5 * 1.5**-0.5
    assert moved[4] == pytest.approx(0.7 * (g1 + g2 + 0.9 * (g1 + g2)), rel=1e-4)
    for k, m in moved.items():
        assert abs(m / moved[1] - 1) <= 0.2, (k, m, moved[1])  # counting versions: 2.1x at K=4


def test_a_round_arriving_at_once_is_one_step_on_the_mean():
    assert _round("quorum", 8, spaced=False) == pytest.approx(1.33, rel=1e-4)


def test_each_increment_takes_its_own_staleness():
    # island a pushed two increments, bases 9 and 10; b one, base 10; version 10;
    # uniform work weights (1/2 each), g(s) = (1 + s)^-0.5
    contributions = [("a", 100, 4, 9), ("a", 100, 4, 10), ("b", 100, 4, 10)]
    coefficients, shares = merge_coefficients(
        make_weighting("uniform"), contributions, current_version=10
    )
    assert coefficients == pytest.approx([0.5 * 2**-0.5, 0.5, 0.5])  # the fresh one undamped
    a = shares[0]
    assert a.coefficient == pytest.approx(0.5 * 2**-0.5 + 0.5)
    assert a.factor == pytest.approx((2**-0.5 + 1) / 2)  # tokens-weighted mean of g
    # 4 islands expected: the step is half a round, a version half a round of staleness
    coefficients, _ = merge_coefficients(
        make_weighting("uniform"), contributions, current_version=10, expected=4
    )
    assert coefficients == pytest.approx([0.25 * 1.5**-0.5, 0.25, 0.25])


def test_the_version_rule_is_the_rule_before_the_round_share():
    contributions = [("a", 100, 4, 9), ("b", 100, 4, 10)]
    weighting = make_weighting("uniform", step_rule="version")
    coefficients, _ = merge_coefficients(weighting, contributions, 10, expected=8)
    assert coefficients == pytest.approx([0.5 * 2**-0.5, 0.5])  # no share, versions


def test_the_bench_prints_the_round_movement_table(capsys):
    from bench import cli

    assert (
        cli.main(["step_rule", "--part", "movement", "--rules", "round,version", "--ks", "1,4"])
        == 0
    )
    table = json.loads(capsys.readouterr().out)["movement"]
    assert table["round"]["async"]["max_deviation"] <= 0.2
    # counting versions: 0.7 * (1 + 2^-0.5 + 3^-0.5 + 4^-0.5) = 1.949 |d| at K = 4
    assert table["version"]["async"]["4"]["movement"] == pytest.approx(1.949, abs=1e-3)
