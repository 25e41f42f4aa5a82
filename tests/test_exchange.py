"""The island's delta and folding rules (worker.exchange): numpy and jitted JAX, no sockets."""

import numpy as np
import pytest

from worker.exchange import (
    ExchangeError,
    FragmentSync,
    delta_since,
    fold_update,
    folded,
    take_delta,
)


def test_delta_is_base_minus_local():
    base = np.array([1.0, 2.0, 3.0], np.float32)
    local = np.array([0.5, 2.5, 3.0], np.float32)
    np.testing.assert_array_equal(take_delta(base, local), [0.5, -0.5, 0.0])


def test_keep_progress_adopts_global_and_keeps_unsent_work():
    anchor = np.array([1.0, 1.0], np.float32)  # what was sent
    local = np.array([1.5, 0.0], np.float32)  # + progress since the push
    new_global = np.array([10.0, 20.0], np.float32)
    out = fold_update(local, anchor, new_global, "keep-progress")
    np.testing.assert_allclose(out, [10.5, 19.0])
    np.testing.assert_array_equal(fold_update(local, anchor, new_global, "overwrite"), new_global)


def test_no_work_counted_twice_over_push_then_adopt_then_push():
    rng = np.random.default_rng(0)
    start = rng.normal(size=64).astype(np.float32)
    sync = FragmentSync.start(start, version=3)
    local = start + rng.normal(size=64).astype(np.float32)  # round 1 progress
    first = sync.take(local)
    progress_after_push = rng.normal(size=64).astype(np.float32)
    local = local + progress_after_push
    new_global = start - first  # the server applied exactly our delta (lr 1)
    local = sync.adopt(local, new_global, version=4, rule="keep-progress")
    assert sync.base_version == 4
    second = sync.take(local)
    # the second delta carries exactly the progress made after the first push
    np.testing.assert_allclose(-second, progress_after_push, atol=1e-5)
    # and the sum of both deltas is all the work done
    np.testing.assert_allclose(-(first + second), local - start + 0 * first, atol=1e-5)


def test_overwrite_discards_unsent_work():
    sync = FragmentSync.start(np.zeros(4, np.float32), version=0)
    local = np.ones(4, np.float32)
    sync.take(local)
    local = local + 1
    local = sync.adopt(local, np.full(4, 5.0, np.float32), version=1, rule="overwrite")
    np.testing.assert_array_equal(local, 5.0)
    np.testing.assert_array_equal(take_delta(sync.base, local), 0.0)


def test_two_pushes_without_a_new_version_send_disjoint_work():
    # the shards did not step between two rounds (no adoption): the second delta must
    # not carry the first round's work again, or merging both would count it twice
    start = np.zeros(8, np.float32)
    sync = FragmentSync.start(start, version=5)
    round1 = np.full(8, -1.0, np.float32)
    first = sync.take(round1)
    round2 = round1 - 2.0
    second = sync.take(round2)
    np.testing.assert_array_equal(first, 1.0)
    np.testing.assert_array_equal(second, 2.0)
    np.testing.assert_array_equal(first + second, start - round2)  # all work, once
    assert sync.base_version == 5  # both were computed on top of version 5


def test_bad_rule_and_shapes_are_clear_errors():
    a = np.zeros(3, np.float32)
    with pytest.raises(ExchangeError, match="unknown merge rule 'average'"):
        fold_update(a, a, a, "average")
    with pytest.raises(ExchangeError, match="shapes differ"):
        fold_update(a, a, np.zeros(4, np.float32), "keep-progress")
    with pytest.raises(ExchangeError, match="base shape"):
        take_delta(a, np.zeros(2, np.float32))


def test_the_rule_is_one_definition_for_numpy_and_jitted_jax_arrays():
    import jax  # the device exchange runs delta_since and folded traced, inside its jit

    rng = np.random.default_rng(0)
    anchor, local, new_global = (rng.normal(size=1000).astype(np.float32) for _ in range(3))
    on_device = jax.jit(lambda a, lo, g: (delta_since(a, lo), folded(lo, a, g, "keep-progress")))
    delta, kept = (np.asarray(x) for x in on_device(anchor, local, new_global))
    assert delta.tobytes() == take_delta(anchor, local).tobytes()
    assert kept.tobytes() == fold_update(local, anchor, new_global, "keep-progress").tobytes()
    # by hand: delta = anchor - local; kept = new_global + (local - anchor)
    assert delta.tobytes() == np.subtract(anchor, local, dtype=np.float32).tobytes()
    assert kept.tobytes() == (new_global + (local - anchor)).astype(np.float32).tobytes()
    overwrite = fold_update(local, anchor, new_global, "overwrite")
    assert overwrite.tobytes() == new_global.tobytes() and overwrite is not new_global
