"""Merge weighting: the named weightings, building blocks, validation and normalization."""

from collections import namedtuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paramserver.weighting import (
    WEIGHTINGS,
    WeightingError,
    make_weighting,
    normalized_weights,
    polynomial_staleness,
    token_weight,
)

Contribution = namedtuple("Contribution", "tokens steps base_version")


def test_building_blocks():
    assert token_weight(100, 4) == 2500.0
    assert polynomial_staleness(0, 0.5) == 1.0
    assert polynomial_staleness(3, 0.5) == pytest.approx(0.5)
    assert polynomial_staleness(3, 0.0) == 1.0


def test_default_is_tokens_squared_over_steps_times_staleness_decay():
    w = make_weighting()
    assert w(100, 4, 0) == 2500.0
    assert w(100, 4, 3) == pytest.approx(1250.0)
    w1 = make_weighting("default", staleness_exponent=1.0)
    assert w1(100, 4, 4) == pytest.approx(500.0)


@pytest.mark.parametrize(
    "name, expected",
    [("uniform", 1.0), ("tokens", 100.0), ("no-staleness", 2500.0)],
)
def test_named_weightings_ignore_what_they_should(name, expected):
    w = make_weighting(name)
    assert w(100, 4, 0) == expected
    assert w(100, 4, 9) == expected


def test_tokens_weighting_ignores_steps():
    assert make_weighting("tokens")(100, 1, 0) == make_weighting("tokens")(100, 50, 0)


def test_staler_and_smaller_contributions_weigh_less():
    w = make_weighting()
    assert w(100, 10, 5) < w(100, 10, 1) < w(100, 10, 0)
    assert w(50, 10, 0) < w(100, 10, 0)
    # Same tokens in fewer steps (bigger batches) count more.
    assert w(100, 20, 0) < w(100, 10, 0)


def test_unknown_name_lists_valid_names():
    with pytest.raises(WeightingError) as err:
        make_weighting("fedbuff")
    for name in WEIGHTINGS:
        assert name in str(err.value)


@pytest.mark.parametrize("exponent", [-0.5, float("nan"), float("inf"), "1"])
def test_bad_exponent(exponent):
    with pytest.raises(WeightingError, match="staleness_exponent"):
        make_weighting("default", staleness_exponent=exponent)


@pytest.mark.parametrize("name", WEIGHTINGS)
@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 1, 0), "tokens=0"),
        ((-5, 1, 0), "tokens=-5"),
        ((10, 0, 0), "steps=0"),
        ((10, 1, -1), "staleness=-1"),
        ((float("nan"), 1, 0), "tokens=nan"),
        ((10, 1, float("inf")), "staleness=inf"),
    ],
)
def test_every_weighting_validates_its_inputs(name, args, match):
    with pytest.raises(WeightingError, match=match):
        make_weighting(name)(*args)


def test_normalized_weights_accepts_objects_and_tuples():
    w = make_weighting()
    contributions = [Contribution(100, 4, 10), (100, 4, 7)]
    got = normalized_weights(w, contributions, current_version=10)
    # staleness 0 and 3 -> raw 2500 and 1250
    np.testing.assert_allclose(got, [2 / 3, 1 / 3])
    assert got.sum() == pytest.approx(1.0)


def test_normalized_weights_uniform():
    got = normalized_weights(make_weighting("uniform"), [(1, 1, 0)] * 4, current_version=3)
    np.testing.assert_allclose(got, [0.25] * 4)


def test_normalized_weights_rejects_future_base_and_empty():
    with pytest.raises(WeightingError, match="base_version=6 is newer than current_version=5"):
        normalized_weights(make_weighting(), [(1, 1, 6)], current_version=5)
    with pytest.raises(WeightingError, match="no contributions"):
        normalized_weights(make_weighting(), [], current_version=5)


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(WEIGHTINGS),
    st.lists(
        st.tuples(st.integers(1, 10**7), st.integers(1, 10**4), st.integers(0, 50)),
        min_size=1,
        max_size=10,
    ),
)
def test_normalized_weights_sum_to_one(name, contributions):
    got = normalized_weights(make_weighting(name), contributions, current_version=50)
    assert got.shape == (len(contributions),)
    assert np.all(got > 0)
    assert got.sum() == pytest.approx(1.0)
