"""Liveness, back-off and re-send decisions."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paramserver.wire.protocol import (
    LivenessError,
    is_silent,
    live_islands,
    next_backoff,
)


def test_silent_only_after_more_than_liveness_intervals():
    assert not is_silent(13.0, 10.0, interval_s=1.0, liveness=3)
    assert is_silent(13.01, 10.0, interval_s=1.0, liveness=3)
    assert not is_silent(9.0, 10.0, interval_s=1.0, liveness=3)  # heard "in the future"


def test_live_islands_drops_silent_ones():
    last_seen = {"a": 10.0, "b": 7.5, "c": 6.9}
    assert live_islands(10.0, last_seen, 1.0, 3) == frozenset({"a", "b"})
    assert live_islands(100.0, last_seen, 1.0, 3) == frozenset()
    assert live_islands(10.0, {}, 1.0, 3) == frozenset()


def test_an_island_heard_again_is_live_again():
    last_seen = {"a": 0.0}
    assert live_islands(5.0, last_seen, 1.0, 2) == frozenset()
    last_seen["a"] = 5.0
    assert live_islands(5.0, last_seen, 1.0, 2) == frozenset({"a"})


def test_backoff_doubles_from_base_and_caps():
    assert [next_backoff(a, 0.5, 3.0) for a in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert next_backoff(10**6, 0.5, 3.0) == 3.0
    assert next_backoff(0, 2.0, 2.0) == 2.0


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2000), st.floats(1e-3, 10), st.floats(1, 1000))
def test_backoff_is_monotonic_and_bounded(attempt, base, factor):
    cap = base * factor
    b0, b1 = next_backoff(attempt, base, cap), next_backoff(attempt + 1, base, cap)
    assert base <= b0 <= b1 <= cap


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: is_silent(1.0, 0.0, 0.0, 3), "interval_s=0.0"),
        (lambda: is_silent(1.0, 0.0, 1.0, -1), "liveness=-1"),
        (lambda: is_silent(math.nan, 0.0, 1.0, 3), "now=nan"),
        (lambda: is_silent(1.0, math.inf, 1.0, 3), "last_heard=inf"),
        (lambda: live_islands(1.0, {"a": math.nan}, 1.0, 3), "last_heard=nan"),
        (lambda: live_islands(1.0, {}, -1.0, 3), "interval_s=-1.0"),
        (lambda: next_backoff(-1, 1.0, 2.0), "attempt=-1"),
        (lambda: next_backoff(1.5, 1.0, 2.0), "attempt=1.5"),
        (lambda: next_backoff(True, 1.0, 2.0), "attempt=True"),
        (lambda: next_backoff(0, 0.0, 2.0), "base_s=0.0"),
        (lambda: next_backoff(0, 2.0, 1.0), "cap_s=1.0 < base_s=2.0"),
    ],
)
def test_validation_names_the_bad_value(call, match):
    with pytest.raises(LivenessError, match=match):
        call()
