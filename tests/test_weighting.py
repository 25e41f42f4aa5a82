"""Merge weighting: work weights f, absolute staleness factors g, per-island grouping.

Every expected value here is computed by hand in the test.
"""

from collections import namedtuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paramserver.server.step.weighting import (
    WEIGHTINGS,
    WeightingError,
    make_weighting,
    merge_coefficients,
    polynomial_staleness,
    token_weight,
)

Contribution = namedtuple("Contribution", "island tokens steps base_version")


def test_building_blocks():
    assert token_weight(100, 4) == 2500.0
    assert polynomial_staleness(0, 0.5) == 1.0
    assert polynomial_staleness(3, 0.5) == pytest.approx(0.5)
    assert polynomial_staleness(3, 0.0) == 1.0


@pytest.mark.parametrize(
    "name, work, factor_at_3",
    [
        ("default", 625.0, 0.5),  # f = (100^2/4) per inner step = (100/4)^2, g(3) = 4^-0.5
        ("uniform", 1.0, 0.5),  # f = 1, staleness still applies
        ("tokens", 100.0, 0.5),  # f = tokens
        ("no-staleness", 625.0, 1.0),  # g = 1
    ],
)
def test_named_weightings(name, work, factor_at_3):
    w = make_weighting(name)
    assert w.work(100, 4) == work
    assert w.staleness_factor(0) == 1.0
    assert w.staleness_factor(3) == pytest.approx(factor_at_3)


def test_exponent_one():
    assert make_weighting("default", 1.0).staleness_factor(4) == pytest.approx(0.2)


def test_tokens_weighting_ignores_steps():
    assert make_weighting("tokens").work(100, 1) == make_weighting("tokens").work(100, 50)


def test_unknown_name_lists_valid_names():
    with pytest.raises(WeightingError) as err:
        make_weighting("fedbuff")
    for name in WEIGHTINGS:
        assert name in str(err.value)


@pytest.mark.parametrize("exponent", [-0.5, float("nan"), float("inf"), "1", True])
def test_bad_exponent(exponent):
    with pytest.raises(WeightingError, match="staleness_exponent"):
        make_weighting("default", staleness_exponent=exponent)


@pytest.mark.parametrize("name", WEIGHTINGS)
@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 1), "tokens=0"),
        ((-5, 1), "tokens=-5"),
        ((10, 0), "steps=0"),
        ((float("nan"), 1), "tokens=nan"),
    ],
)
def test_work_validates_its_inputs(name, args, match):
    with pytest.raises(WeightingError, match=match):
        make_weighting(name).work(*args)


@pytest.mark.parametrize("staleness, match", [(-1, "staleness=-1"), (float("inf"), "inf")])
def test_staleness_factor_validates(staleness, match):
    with pytest.raises(WeightingError, match=match):
        make_weighting().staleness_factor(staleness)


def test_one_islands_increments_are_summed_not_averaged():
    # island a pushed twice (bases 10 and 9), island b once; uniform f, g = 1
    contributions = [("a", 100, 4, 10), ("b", 50, 2, 10), ("a", 300, 6, 9)]
    coefficients, shares = merge_coefficients(
        make_weighting("uniform", 0.0), contributions, current_version=10
    )
    # two islands: each island's summed delta counts 1/2
    assert coefficients == [0.5, 0.5, 0.5]
    a = next(s for s in shares if s.island == "a")
    assert (a.tokens, a.steps, a.staleness) == (400, 10, 1)  # oldest base 9


def test_default_weights_islands_by_summed_work_and_oldest_base():
    contributions = [Contribution("a", 100, 4, 10), Contribution("a", 100, 4, 10)]
    contributions.append(Contribution("b", 100, 4, 7))
    coefficients, shares = merge_coefficients(make_weighting(), contributions, current_version=10)
    # a: tokens 200, steps 8 -> f = (200/8)^2 = 625, staleness 0 -> g 1
    # b: tokens 100, steps 4 -> f = (100/4)^2 = 625, staleness 3 -> g 0.5
    # w_a = w_b = 1/2; coefficients w*g
    assert coefficients == pytest.approx([1 / 2, 1 / 2, 1 / 4])
    assert [s.island for s in shares] == ["a", "b"]
    assert shares[1].factor == pytest.approx(0.5)


def test_summed_increments_weigh_by_their_work_not_its_square():
    # the case: a fast island sent two increments d (t tokens, s steps each), a
    # slow one one d. Work-conserving: w = 1/2 each, merged = 1/2 * 2d + 1/2 * d = 1.5 d
    # (tokens^2/steps over the sum gave f_a = (2t)^2/(2s) = 2 t^2/s, w_a = 2/3: 1.667 d)
    t, s = 1000, 10
    contributions = [("a", t, s, 5), ("a", t, s, 5), ("b", t, s, 5)]
    coefficients, _ = merge_coefficients(make_weighting(), contributions, current_version=5)
    assert sum(coefficients) == pytest.approx(1.5)
    # the same work sent as one delta of two rounds (a skipped push): the same 1.5 d
    coefficients, _ = merge_coefficients(
        make_weighting(), [("a", 2 * t, 2 * s, 5), ("b", t, s, 5)], current_version=5
    )
    assert coefficients == pytest.approx([0.5, 0.5])  # 0.5 * 2d + 0.5 * d
    # bigger batches still count more: 2x tokens per inner step -> f 4x -> w = 4/5
    coefficients, _ = merge_coefficients(
        make_weighting(), [("a", 2 * t, s, 5), ("b", t, s, 5)], current_version=5
    )
    assert coefficients == pytest.approx([0.8, 0.2])


def test_a_lone_stale_delta_keeps_its_staleness_factor():
    coefficients, _ = merge_coefficients(make_weighting(), [("a", 10, 1, 1)], current_version=4)
    assert coefficients == pytest.approx([0.5])  # (1 + 3)^-0.5, not renormalised to 1
    coefficients, _ = merge_coefficients(
        make_weighting("no-staleness"), [("a", 10, 1, 1)], current_version=4
    )
    assert coefficients == [1.0]


def test_equally_stale_deltas_do_not_cancel_the_factor():
    contributions = [("a", 10, 1, 0), ("b", 10, 1, 0)]
    coefficients, _ = merge_coefficients(make_weighting(), contributions, current_version=8)
    assert coefficients == pytest.approx([0.5 / 3, 0.5 / 3])  # w = 1/2, g(8) = 1/3


def test_rejects_future_base_and_empty():
    with pytest.raises(WeightingError, match="base_version=6 is newer than current_version=5"):
        merge_coefficients(make_weighting(), [("a", 1, 1, 6)], current_version=5)[1]
    with pytest.raises(WeightingError, match="no contributions"):
        merge_coefficients(make_weighting(), [], current_version=5)[1]


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(WEIGHTINGS),
    st.lists(
        st.tuples(
            st.sampled_from("abcd"),
            st.integers(1, 10**7),
            st.integers(1, 10**4),
            st.integers(0, 50),
        ),
        min_size=1,
        max_size=10,
    ),
)
def test_work_weights_sum_to_one_and_factors_are_at_most_one(name, contributions):
    shares = merge_coefficients(make_weighting(name), contributions, current_version=50)[1]
    assert len(shares) == len({c[0] for c in contributions})
    assert sum(s.weight for s in shares) == pytest.approx(1.0)
    assert all(0 < s.factor <= 1 for s in shares)
