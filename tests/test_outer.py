"""Outer optimizer: sign convention, hand-computed Nesterov, delayed Nesterov, the donated step,
state round trip, merge_deltas, and a golden trajectory (regenerate with REGENERATE_GOLDEN=1)."""

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from paramserver.server.step.outer import (
    DonatingStep,
    FragmentOptimizer,
    OuterError,
    aligned_float32,
    delayed_nesterov,
    make_outer_optimizer,
)

GOLDEN = Path(__file__).parent / "golden" / "outer_trajectories.json"
GOLDEN_CONFIGS = [
    ("nesterov", 0.7, 0.9, 1),
    ("sgd", 1.0, 0.0, 1),
    ("delayed-nesterov", 0.7, 0.9, 3),
    ("nesterov", 0.5, 0.8, 2),
]


def f32(*values):
    return np.array(values, dtype=np.float32)


def run(fo, params, deltas):
    state = fo.init(params)
    out = []
    for d in deltas:
        params, state = fo.step(params, state, d)
        out.append(params)
    return out, state


def test_sgd_lr1_single_island_reproduces_local_params():
    rng = np.random.default_rng(1)
    global_params = rng.standard_normal(64).astype(np.float32)
    local_params = global_params - 0.01 * rng.standard_normal(64).astype(np.float32)
    delta = global_params - local_params  # pseudo-gradient: started-from minus local
    fo = FragmentOptimizer(make_outer_optimizer("sgd", lr=1.0))
    new, _ = fo.step(global_params, fo.init(global_params), delta)
    np.testing.assert_array_equal(new, local_params)


def test_nesterov_matches_hand_computed_two_steps():
    fo = FragmentOptimizer(make_outer_optimizer("nesterov", lr=0.5, momentum=0.9))
    (p1, p2), _ = run(fo, f32(1.0, 2.0), [f32(0.1, 0.2), f32(0.3, -0.1)])
    # m1 = g1; p1 = p0 - lr (0.9 m1 + g1); m2 = 0.9 m1 + g2; p2 = p1 - lr (0.9 m2 + g2)
    np.testing.assert_allclose(p1, [0.905, 1.81], rtol=1e-6)
    np.testing.assert_allclose(p2, [0.5795, 1.824], rtol=1e-6)


def test_step_returns_writable_float32_and_keeps_inputs():
    fo = FragmentOptimizer(make_outer_optimizer())
    params = f32(1.0, 2.0, 3.0)
    new, _ = fo.step(params, fo.init(params), f32(1.0, 1.0, 1.0))
    assert new.dtype == np.float32 and new.flags.writeable and new.shape == (3,)
    np.testing.assert_array_equal(params, [1.0, 2.0, 3.0])


def test_delayed_nesterov_with_delay_1_equals_nesterov():
    rng = np.random.default_rng(2)
    params = rng.standard_normal(32).astype(np.float32)
    deltas = [rng.standard_normal(32).astype(np.float32) * 0.1 for _ in range(5)]
    ref, _ = run(FragmentOptimizer(optax.sgd(0.7, momentum=0.9, nesterov=True)), params, deltas)
    got, _ = run(FragmentOptimizer(delayed_nesterov(0.7, 0.9, 1)), params, deltas)
    for a, b in zip(ref, got, strict=True):
        np.testing.assert_array_equal(a, b)  # same float ops as optax's trace(nesterov=True)


def test_delayed_nesterov_with_delay_1_matches_hand_computed_nesterov():
    fo = FragmentOptimizer(delayed_nesterov(0.5, 0.9, 1))
    (p1, p2), _ = run(fo, f32(1.0, 2.0), [f32(0.1, 0.2), f32(0.3, -0.1)])
    # Same numbers as test_nesterov_matches_hand_computed_two_steps.
    np.testing.assert_allclose(p1, [0.905, 1.81], rtol=1e-6)
    np.testing.assert_allclose(p2, [0.5795, 1.824], rtol=1e-6)


def test_delayed_nesterov_group_of_n_is_one_nesterov_step_on_the_mean():
    lr, mu = 0.7, 0.9
    fo = FragmentOptimizer(make_outer_optimizer("delayed-nesterov", lr=lr, momentum=mu, delay=3))
    traj, state = run(fo, f32(0.0), [f32(1.0)] * 6)
    first = -0.7 * (0.9 * 1.0 + 1.0)  # m' = 0.9*0 + 1 = 1: -1.33 in total
    second = -0.7 * (0.9 * 1.9 + 1.0)  # m'' = 0.9*1 + 1 = 1.9
    want = [-0.7 / 3, -1.4 / 3, first, first - 0.7 / 3, first - 1.4 / 3, first + second]
    np.testing.assert_allclose(np.concatenate(traj), want, rtol=1e-6)
    assert abs(first - -1.33) < 1e-12  # not -2.73, the old rule's -0.7*3 - 0.7*(0.9 + 1)
    count, momentum, accumulator = fo.state_to_arrays(state)
    assert int(count) == 0
    np.testing.assert_allclose(momentum, [1.9], rtol=1e-6)
    np.testing.assert_array_equal(accumulator, [0.0])


def test_delayed_nesterov_steps_on_the_mean_not_the_last_contribution():
    fo = FragmentOptimizer(make_outer_optimizer("delayed-nesterov", lr=0.7, momentum=0.9, delay=3))
    traj, _ = run(fo, f32(0.0), [f32(1.0), f32(2.0), f32(6.0)])
    # mean 3: m' = 3, total -0.7*(0.9*3 + 3) = -3.99; in between -0.7*1/3, then -0.7*(1+2)/3.
    np.testing.assert_allclose(np.concatenate(traj), [-0.7 / 3, -0.7, -3.99], rtol=1e-6)


def test_delayed_nesterov_moves_momentum_only_every_n_contributions():
    n, lr, mu = 3, 0.5, 0.9
    fo = FragmentOptimizer(make_outer_optimizer("delayed-nesterov", lr=lr, momentum=mu, delay=n))
    params = f32(0.0, 0.0)
    state = fo.init(params)
    deltas = [f32(1.0, 2.0), f32(3.0, 0.0), f32(-1.0, 1.0), f32(2.0, 2.0)]
    momenta = []
    for d in deltas:
        before = params
        params, state = fo.step(params, state, d)
        count, momentum, _ = fo.state_to_arrays(state)
        momenta.append(momentum)
        if len(momenta) < n:
            # In between: a plain step of 1/n of the contribution, momentum untouched. (This
            # test used to pin `before - lr * d`, a full step per contribution on top of the
            # Nesterov step at the n-th, so a group moved about n+1 steps instead of one.)
            np.testing.assert_allclose(params, before - lr * d / n, rtol=1e-6)
            np.testing.assert_array_equal(momentum, [0.0, 0.0])
    avg = (deltas[0] + deltas[1] + deltas[2]) / n
    np.testing.assert_allclose(momenta[2], avg, rtol=1e-6)
    np.testing.assert_array_equal(momenta[3], momenta[2])
    assert int(count) == 1


def test_nesterov_with_delay_above_1_is_delayed_nesterov():
    rng = np.random.default_rng(3)
    params = rng.standard_normal(8).astype(np.float32)
    deltas = [rng.standard_normal(8).astype(np.float32) for _ in range(4)]
    a, _ = run(FragmentOptimizer(make_outer_optimizer("nesterov", delay=2)), params, deltas)
    b, _ = run(FragmentOptimizer(delayed_nesterov(0.7, 0.9, 2)), params, deltas)
    np.testing.assert_array_equal(a[-1], b[-1])


@pytest.mark.parametrize("name, delay", [("nesterov", 1), ("sgd", 1), ("delayed-nesterov", 3)])
def test_state_arrays_round_trip_continues_identically(name, delay):
    fo = FragmentOptimizer(make_outer_optimizer(name, delay=delay))
    rng = np.random.default_rng(4)
    params = rng.standard_normal(16).astype(np.float32)
    deltas = [rng.standard_normal(16).astype(np.float32) for _ in range(6)]
    state = fo.init(params)
    for d in deltas[:2]:
        params, state = fo.step(params, state, d)
    saved = [a.copy() for a in fo.state_to_arrays(state)]
    restored = fo.state_from_arrays(saved, params)
    p_a, p_b, s_a, s_b = params, params.copy(), state, restored
    for d in deltas[2:]:
        p_a, s_a = fo.step(p_a, s_a, d)
        p_b, s_b = fo.step(p_b, s_b, d)
    np.testing.assert_array_equal(p_a, p_b)


def test_state_from_arrays_rejects_mismatch():
    fo = FragmentOptimizer(make_outer_optimizer("nesterov"))
    params = np.zeros(4, np.float32)
    with pytest.raises(OuterError, match="2 state arrays given"):
        fo.state_from_arrays([np.zeros(4), np.zeros(4)], params)
    with pytest.raises(OuterError, match="shape"):  # share, phase, momentum
        fo.state_from_arrays([np.ones(()), np.zeros(()), np.zeros(5)], params)


def test_step_rejects_bad_arrays():
    fo = FragmentOptimizer(make_outer_optimizer())
    params = np.zeros(4, np.float32)
    state = fo.init(params)
    with pytest.raises(OuterError, match="merged_delta has shape"):
        fo.step(params, state, np.zeros(5, np.float32))
    with pytest.raises(OuterError, match="1-D float32"):
        fo.step(params.astype(np.float64), state, np.zeros(4, np.float32))
    with pytest.raises(OuterError, match="1-D float32"):
        fo.init(np.zeros((2, 2), np.float32))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"name": "adam"}, "unknown outer optimizer 'adam'"),
        ({"lr": 0.0}, "lr=0.0"),
        ({"lr": float("nan")}, "lr=nan"),
        ({"momentum": 1.0}, "momentum=1.0"),
        ({"momentum": -0.1}, "momentum=-0.1"),
        ({"delay": 0}, "delay=0"),
        ({"delay": 1.5}, "delay=1.5"),
        ({"name": "sgd", "delay": 2}, "delayed-nesterov"),
    ],
)
def test_make_outer_optimizer_validates(kwargs, match):
    with pytest.raises(OuterError, match=match):
        make_outer_optimizer(**kwargs)


def misaligned_copy(values):
    """A C-contiguous, writable float32 copy whose data is 4 bytes off a 64-byte boundary."""
    raw = aligned_float32(len(values) + 16)
    out = raw[1 : 1 + len(values)]
    out[...] = values
    assert out.ctypes.data % 64 == 4 and out.flags.c_contiguous and out.flags.writeable
    return out


def test_aligned_float32_is_aligned_and_writable():
    for size, align in [(1, 64), (1000, 64), (7, 128)]:
        buf = aligned_float32(size, align)
        assert buf.ctypes.data % align == 0 and buf.shape == (size,) and buf.dtype == np.float32
        assert buf.flags.writeable and buf.flags.c_contiguous


@pytest.mark.parametrize("name, lr, momentum, delay", GOLDEN_CONFIGS)
def test_fragment_step_is_the_donating_step_bit_for_bit(name, lr, momentum, delay):
    tx = make_outer_optimizer(name, lr=lr, momentum=momentum, delay=delay)
    fo = FragmentOptimizer(tx)
    assert isinstance(fo.donating, DonatingStep)
    direct = DonatingStep(tx)
    rng = np.random.default_rng(5)
    params = rng.standard_normal(40).astype(np.float32)
    p_fo, s_fo = params, fo.init(params)
    p_d, s_d = jnp.array(params), tx.init(jnp.array(params))
    for _ in range(7):
        merged = aligned_float32(40)
        merged[...] = 0.1 * rng.standard_normal(40)
        p_fo, s_fo = fo.step(p_fo, s_fo, merged)
        p_d, s_d = direct(p_d, s_d, merged)
        np.testing.assert_array_equal(p_fo, np.asarray(p_d))
    for a, b in zip(jax.tree.leaves(s_fo), jax.tree.leaves(s_d), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_donating_step_donates_and_fragment_step_does_not_consume():
    tx = make_outer_optimizer("delayed-nesterov", delay=2)
    params = np.arange(8, dtype=np.float32)
    merged = aligned_float32(8)
    merged[...] = 1.0
    direct = DonatingStep(tx)
    p, s = jnp.array(params), tx.init(jnp.array(params))
    new_p, _ = direct(p, s, merged)
    assert p.is_deleted()  # donated: updated in place
    fo = FragmentOptimizer(tx)
    state = fo.init(params)
    once, _ = fo.step(params, state, merged)
    again, _ = fo.step(params, state, merged)  # same inputs still usable
    np.testing.assert_array_equal(once, again)
    np.testing.assert_array_equal(once, np.asarray(new_p))
    np.testing.assert_array_equal(params, np.arange(8, dtype=np.float32))


def test_donated_step_with_non_aligned_merged_buffer():
    tx = make_outer_optimizer("nesterov", lr=0.5, momentum=0.9)
    fo = FragmentOptimizer(tx)
    params = f32(1.0, 2.0)
    # Hand-computed as in test_nesterov_matches_hand_computed_two_steps.
    p1, s1 = fo.step(params, fo.init(params), misaligned_copy([0.1, 0.2]))
    np.testing.assert_allclose(p1, [0.905, 1.81], rtol=1e-6)
    read_only = f32(0.3, -0.1)
    read_only.flags.writeable = False
    strided = f32(0.3, 0.0, -0.1)[::2]
    for merged in (misaligned_copy([0.3, -0.1]), read_only, strided):
        p2, _ = fo.step(p1, s1, merged)
        np.testing.assert_allclose(p2, [0.5795, 1.824], rtol=1e-6)
    # DonatingStep itself takes an unaligned buffer too (JAX copies it instead of aliasing).
    direct = DonatingStep(tx)
    q1, t1 = direct(jnp.array(params), tx.init(jnp.array(params)), misaligned_copy([0.1, 0.2]))
    q2, _ = direct(q1, t1, misaligned_copy([0.3, -0.1]))
    np.testing.assert_allclose(np.asarray(q2), [0.5795, 1.824], rtol=1e-6)


def golden_run(name, lr, momentum, delay, params, deltas):
    fo = FragmentOptimizer(make_outer_optimizer(name, lr=lr, momentum=momentum, delay=delay))
    trajectory, state = run(
        fo, np.array(params, np.float32), [np.array(d, np.float32) for d in deltas]
    )
    return {
        "params": [p.tolist() for p in trajectory],
        "state": [a.tolist() for a in fo.state_to_arrays(state)],
    }


def regenerate_golden():
    rng = np.random.default_rng(20260101)
    params = rng.standard_normal(12).astype(np.float32)
    deltas = [(0.05 * rng.standard_normal(12)).astype(np.float32) for _ in range(7)]
    cases = []
    for name, lr, momentum, delay in GOLDEN_CONFIGS:
        case = {"name": name, "lr": lr, "momentum": momentum, "delay": delay}
        case.update(
            golden_run(name, lr, momentum, delay, params.tolist(), [d.tolist() for d in deltas])
        )
        cases.append(case)
    blob = {"params": params.tolist(), "deltas": [d.tolist() for d in deltas], "cases": cases}
    GOLDEN.write_text(json.dumps(blob, indent=1) + "\n")


def test_golden_trajectories():
    if os.environ.get("REGENERATE_GOLDEN") == "1":
        regenerate_golden()
    golden = json.loads(GOLDEN.read_text())
    assert [[c["name"], c["lr"], c["momentum"], c["delay"]] for c in golden["cases"]] == [
        list(c) for c in GOLDEN_CONFIGS
    ], "GOLDEN_CONFIGS changed: regenerate with REGENERATE_GOLDEN=1 and review the diff"
    for case in golden["cases"]:
        got = golden_run(
            case["name"],
            case["lr"],
            case["momentum"],
            case["delay"],
            golden["params"],
            golden["deltas"],
        )
        for step, (want, have) in enumerate(zip(case["params"], got["params"], strict=True)):
            np.testing.assert_array_equal(
                np.array(have, np.float32),
                np.array(want, np.float32),
                err_msg=f"{case['name']} step {step}: outer trajectory drifted from the golden file",
            )
        for want, have in zip(case["state"], got["state"], strict=True):
            np.testing.assert_array_equal(np.array(have), np.array(want))


def test_golden_delayed_nesterov_groups_are_nesterov_steps_on_the_mean():
    """Pins the golden file itself (written by the code) to the rule, in float64 numpy."""
    golden = json.loads(GOLDEN.read_text())
    deltas = np.array(golden["deltas"], np.float64)
    for case in golden["cases"]:
        if case["delay"] == 1:
            continue
        lr, mu, n = case["lr"], case["momentum"], case["delay"]
        p, m = np.array(golden["params"], np.float64), np.zeros(deltas.shape[1])
        for end in range(n, len(deltas) + 1, n):
            mean = deltas[end - n : end].mean(axis=0)
            m = mu * m + mean
            p = p - lr * (mu * m + mean)
            np.testing.assert_allclose(case["params"][end - 1], p, rtol=1e-5, atol=1e-6)
