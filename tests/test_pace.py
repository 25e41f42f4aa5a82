"""worker.pace: padding arithmetic, seeded jitter and argument checks (no real sleeping)."""

import math

import pytest

from worker import pace


@pytest.mark.parametrize(
    ("step", "speed", "draw", "expected"),
    [
        (0.2, 1.0, 1.0, 0.0),
        (0.2, 0.5, 1.0, 0.2),
        (0.2, 0.25, 1.0, 0.6),
        (0.2, 2.0, 1.0, 0.0),  # cannot make a step faster
        (1.0, 0.5, 1.1, 1.2),
        (1.0, 1.0, 0.9, 0.0),
        (1.0, 1.0, 1.1, 0.1),
        (0.0, 0.5, 1.0, 0.0),
    ],
)
def test_padding_math(step, speed, draw, expected):
    assert math.isclose(pace.padding_s(step, speed, draw), expected, abs_tol=1e-12)


def test_pacer_sleeps_the_padding_and_skips_zero():
    slept = []
    pacer = pace.Pacer(0.5, sleep=slept.append)
    assert pacer.pad(0.3) == pytest.approx(0.3)
    pace.Pacer(1.0, sleep=slept.append).pad(0.3)
    assert slept == [pytest.approx(0.3)]


def test_jitter_is_bounded_seeded_and_varies():
    draws = [pace.Pacer(1.0, jitter=0.1, seed=3).draw() for _ in range(2)]
    assert draws[0] == draws[1]
    pacer = pace.Pacer(1.0, jitter=0.1, seed=3)
    sequence = [pacer.draw() for _ in range(200)]
    assert sequence[0] == draws[0]
    assert all(0.9 <= x <= 1.1 for x in sequence)
    assert min(sequence) < 0.95 and max(sequence) > 1.05
    assert sequence != [pace.Pacer(1.0, jitter=0.1, seed=4).draw() for _ in range(200)]
    assert pace.Pacer(0.5).draw() == 1.0


def test_jittered_padding_averages_to_the_target():
    slept = []
    pacer = pace.Pacer(0.5, jitter=0.2, seed=0, sleep=slept.append)
    for _ in range(2000):
        pacer.pad(1.0)
    # Target 2.0 s per step on average, so the mean padding is about 1.0 s.
    assert sum(slept) / len(slept) == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize("speed", [0, -1.0, float("nan"), float("inf"), "fast"])
def test_bad_speed_is_rejected(speed):
    with pytest.raises(pace.PaceError, match="speed"):
        pace.Pacer(speed)
    with pytest.raises(pace.PaceError, match="speed"):
        pace.padding_s(0.1, speed)


@pytest.mark.parametrize("jitter", [-0.1, 1.0, 2.0, None])
def test_bad_jitter_is_rejected(jitter):
    with pytest.raises(pace.PaceError, match="jitter"):
        pace.Pacer(1.0, jitter=jitter)


def test_bad_step_time_and_draw_are_rejected():
    with pytest.raises(pace.PaceError, match="step_time_s"):
        pace.padding_s(-0.1, 1.0)
    with pytest.raises(pace.PaceError, match="step_time_s"):
        pace.padding_s(float("nan"), 1.0)
    with pytest.raises(pace.PaceError, match="jitter_draw"):
        pace.padding_s(0.1, 1.0, 0.0)
