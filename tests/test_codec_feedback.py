"""Error feedback and stochastic rounding: what they promise over many rounds."""

import numpy as np
import pytest

import codec


def deltas(rounds: int, n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_t(3, n) * 1e-3).astype(np.float32) for _ in range(rounds)]


def accumulated_error(c, rounds, feedback: bool) -> float:
    """Relative L2 error of the sum of decoded deltas against the true sum."""
    state = c.init({"d": rounds[0]}) if feedback else None
    total = np.zeros_like(rounds[0], dtype=np.float64)
    truth = np.zeros_like(total)
    for d in rounds:
        frames, state = c.encode({"d": d}, state)
        total += codec.decode(frames)["d"]
        truth += d
    return float(np.linalg.norm(total - truth) / np.linalg.norm(truth))


@pytest.mark.parametrize("make", [codec.int8, codec.int4, lambda: codec.raw("bfloat16")])
def test_error_feedback_shrinks_the_accumulated_error(make):
    rounds = deltas(50, 20_000)
    with_ef = accumulated_error(make(), rounds, feedback=True)
    without = accumulated_error(make(), rounds, feedback=False)
    assert with_ef * 4 < without, (with_ef, without)


@pytest.mark.parametrize("make", [codec.int8, codec.int4, lambda: codec.raw("bfloat16")])
def test_residual_is_input_plus_old_residual_minus_decoded_exactly(make):
    c = make()
    x1, x2 = deltas(2, 5000, seed=4)
    state = c.init({"x": x1})
    _, state = c.encode({"x": x1}, state)
    r1 = state.residual_tree()["x"].copy()
    assert np.abs(r1).max() > 0
    frames, state = c.encode({"x": x2}, state)
    decoded = codec.decode(frames)["x"]
    expected = (x2 + r1) - decoded  # float32 arithmetic, as the codec does it
    assert np.array_equal(state.residual_tree()["x"], expected)


def test_raw_float32_has_no_residual():
    c = codec.raw("float32")
    x = deltas(1, 1000)[0]
    _, state = c.encode({"x": x}, c.init({"x": x}))
    assert not state.residual_tree()["x"].any()


@pytest.mark.parametrize("make", [codec.int8, codec.int4])
def test_stochastic_rounding_is_unbiased(make):
    c = make(stochastic=True, seed=7)
    x = np.full(4096, 0.3, np.float32)
    x[::64] = 1.0  # sets every block's absmax, so 0.3 sits between two levels
    mean = np.mean([codec.decode(c.encode({"x": x})[0])["x"] for _ in range(40)], axis=0)
    nearest = codec.decode(make().encode({"x": x})[0])["x"]
    mask = x != 1.0
    assert abs(mean[mask].mean() - 0.3) < abs(nearest[mask].mean() - 0.3) / 5
    assert abs(mean[mask].mean() - 0.3) < 2e-3


@pytest.mark.parametrize("make", [codec.int8, codec.int4])
def test_stochastic_rounding_is_deterministic_under_a_seed(make):
    x = deltas(1, 3000, seed=9)[0]

    def payload(seed):
        c = make(stochastic=True, seed=seed)
        return [bytes(f) for _ in range(3) for f in c.encode({"x": x})[0][1:]]

    assert payload(5) == payload(5)
    assert payload(5) != payload(6)
