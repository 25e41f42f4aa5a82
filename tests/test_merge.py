"""The merge rules (`--merge mean|rda`): hand-computed expectations, per-slice norms, the shard's step."""

import numpy as np
import pytest
from shard_helpers import delta_frames, init_payload, plan_for, push_header, small_flat

from paramserver.server.config import ConfigError, ShardConfig
from paramserver.server.state import ShardState
from paramserver.server.step.merge import (
    MergeError,
    Segment,
    chunk_merge,
    fragment_segments,
    merge_deltas,
    rda_merge,
)
from paramserver.wire.plan import Fragment, Slice
from paramserver.wire.protocol import ACCEPTED

pytestmark = pytest.mark.timeout(60)
WHOLE = [Segment(0, 4)]


def test_single_island_is_identity():
    v = np.array([3.0, -4.0, 0.5, 2.0], np.float32)
    np.testing.assert_allclose(rda_merge([v], [1.0], WHOLE), v, rtol=1e-6)


def test_two_orthogonal_equal_norm_deltas_keep_their_norm():
    a = np.array([2.0, 0.0, 0.0, 0.0], np.float32)
    b = np.array([0.0, 2.0, 0.0, 0.0], np.float32)
    merged = rda_merge([a, b], [0.5, 0.5], WHOLE)
    # mean direction (1/2, 1/2) normalised to (1/sqrt2, 1/sqrt2), length = mean norm 2
    np.testing.assert_allclose(merged, [np.sqrt(2), np.sqrt(2), 0, 0], rtol=1e-6)
    assert np.linalg.norm(merged) == pytest.approx(2.0)
    # the plain mean would shrink it to 2 / sqrt(2)
    assert np.linalg.norm(0.5 * a + 0.5 * b) == pytest.approx(np.sqrt(2))


def test_weights_set_both_norm_and_direction():
    a = np.array([3.0, 0.0], np.float32)  # norm 3
    b = np.array([0.0, 1.0], np.float32)  # norm 1
    merged = rda_merge([a, b], [0.75, 0.25], [Segment(0, 2)])
    norm = 0.75 * 3 + 0.25 * 1  # 2.5
    direction = np.array([0.75, 0.25]) / np.hypot(0.75, 0.25)
    np.testing.assert_allclose(merged, norm * direction, rtol=1e-6)


def test_staleness_coefficients_scale_the_result_like_the_mean():
    v = np.array([1.0, 2.0, 2.0, 0.0], np.float32)
    # a lone delta with g(s) = 0.5 moves the model half as far, as with the mean rule
    np.testing.assert_allclose(rda_merge([v], [0.5], WHOLE), 0.5 * v, rtol=1e-6)
    # two equal deltas at coefficients 0.3 + 0.2: C = 0.5, same direction and norm
    np.testing.assert_allclose(rda_merge([v, v], [0.3, 0.2], WHOLE), 0.5 * v, rtol=1e-6)


def test_cancelling_directions_and_zero_deltas_fall_back_to_the_mean():
    a = np.array([1.0, 0.0], np.float32)
    np.testing.assert_allclose(rda_merge([a, -a], [0.5, 0.5], [Segment(0, 2)]), [0, 0], atol=0)
    z = np.zeros(2, np.float32)
    np.testing.assert_allclose(rda_merge([z, z], [0.5, 0.5], [Segment(0, 2)]), [0, 0], atol=0)


def test_norms_are_per_segment_and_mean_only_segments_use_the_mean():
    a = np.array([2.0, 0.0, 4.0, 0.0], np.float32)
    b = np.array([0.0, 2.0, 0.0, 4.0], np.float32)
    segments = [Segment(0, 2), Segment(2, 4, mean_only=True)]
    merged = rda_merge([a, b], [0.5, 0.5], segments)
    r = np.sqrt(2)
    np.testing.assert_allclose(merged, [r, r, 2.0, 2.0], rtol=1e-6)


def test_fragment_segments_follow_the_slices_and_mark_embeddings():
    frag = Fragment(
        3, 0, (Slice("blocks/0/w", 10, 16), Slice("embed", 0, 4), Slice("head", 0, 2)), 12
    )
    assert fragment_segments(frag) == [
        Segment(0, 6, False, "blocks/0/w"),
        Segment(6, 10, True, "embed"),
        Segment(10, 12, False, "head"),
    ]


@pytest.mark.parametrize(
    "deltas, coefficients, segments, match",
    [
        ([], [], WHOLE, "0 deltas"),
        ([np.zeros(4)], [0.5, 0.5], WHOLE, "coefficients"),
        ([np.zeros(4), np.zeros(3)], [0.5, 0.5], WHOLE, "1-D of one length"),
        ([np.zeros(4)], [-1.0], WHOLE, "positive sum"),
        ([np.zeros(4)], [float("nan")], WHOLE, "positive sum"),
        ([np.zeros(4)], [1.0], [Segment(0, 3)], "cover 3"),
        ([np.zeros(4)], [1.0], [Segment(1, 4)], "contiguous"),
    ],
)
def test_bad_arguments_are_refused(deltas, coefficients, segments, match):
    with pytest.raises(MergeError, match=match):
        rda_merge(deltas, coefficients, segments)


def test_a_whole_chunk_merge_sums_an_islands_increments_before_averaging():
    frag = Fragment(0, 0, (Slice("w", 0, 2),), 2)
    a1 = np.array([1.0, 0.0], np.float32)
    a2 = np.array([1.0, 0.0], np.float32)  # island a's two increments: (2, 0)
    b = np.array([0.0, 2.0], np.float32)
    deltas = [("a", a1), ("b", b), ("a", a2)]
    merged = chunk_merge("rda", deltas, [0.5, 0.5, 0.5], frag).whole()
    # u_a = 0.5 * (2, 0) = (1, 0), C_a = 1; u_b = 0.5 * (0, 2) = (0, 1), C_b = 0.5:
    # (|u_a| + |u_b|) * phi(1 * (1, 0) + 0.5 * (0, 1)) = 2 * (2, 1) / sqrt(5)
    np.testing.assert_allclose(merged, [4 / np.sqrt(5), 2 / np.sqrt(5)], rtol=1e-6)
    mean = chunk_merge("mean", deltas, [0.5, 0.5, 0.5], frag).whole()
    np.testing.assert_allclose(mean, [1.0, 1.0], rtol=1e-6)
    with pytest.raises(MergeError, match="unknown"):
        chunk_merge("trimmed", [("a", a1)], [1.0], frag).whole()
    with pytest.raises(MergeError, match="3 deltas but 2 coefficients"):
        chunk_merge("mean", deltas, [0.5, 0.5], frag).whole()


def test_config_refuses_an_unknown_merge():
    with pytest.raises(ConfigError, match="merge"):
        ShardConfig(merge="trimmed")


def test_shard_step_with_rda_keeps_the_norm_of_orthogonal_island_deltas():
    cfg = ShardConfig(mode="sync", fsync=False, outer_optimizer="sgd", outer_lr=1.0,
                      weighting="uniform", merge="rda", downlink="float32")  # fmt: skip
    flat = small_flat()
    plan = plan_for(flat, 1, 2)
    state = ShardState(cfg, 0)
    assert state.initialize(plan.to_wire(), init_payload(plan, flat)).status == ACCEPTED
    now = 1_000_000.0
    for island in ("a", "b"):
        state.hello(island, now)
    g0 = state.snapshot(1)[1].astype(np.float64)  # fragment 1: a/w[84:128] + b[0:40]
    size = plan.fragments[1].size
    da = np.zeros(size, np.float32)
    db = np.zeros(size, np.float32)
    da[0], db[1] = 3.0, 3.0  # orthogonal within the a/w slice
    da[50], db[50] = 1.0, 1.0  # equal within the b slice
    for island, d in (("a", da), ("b", db)):
        header = push_header(plan, island, 1, 1, 0, 1000, 10)
        assert state.submit_delta(header, delta_frames(d), now).status == ACCEPTED
    _, update = state.step(1, now)
    expected = g0.copy()
    expected[0] -= 3 / np.sqrt(2)  # norm 3 kept in the first slice (mean: 2.12 -> 1.5 each)
    expected[1] -= 3 / np.sqrt(2)
    expected[50] -= 1.0
    np.testing.assert_allclose(update.values, expected, rtol=0, atol=1e-6)


def _f32(*values):
    return np.array(values, np.float32)


def test_merge_deltas_weighted_sum_into_out():
    deltas = [_f32(1.0, 2.0), _f32(3.0, -4.0), np.array([0.5, 0.5], np.float64)]
    out = np.full(2, 99.0, np.float32)
    got = merge_deltas(deltas, [0.5, 0.25, 0.25], out=out)
    assert got is out
    np.testing.assert_allclose(out, [0.5 + 0.75 + 0.125, 1.0 - 1.0 + 0.125], rtol=1e-6)
    np.testing.assert_array_equal(merge_deltas([_f32(2.0)], [1.0]), [2.0])
    assert merge_deltas([_f32(2.0)], [1.0]).dtype == np.float32


@pytest.mark.parametrize(
    "deltas, weights, out, match",
    [
        ([], [], None, "at least one"),
        ([_f32(1.0)], [0.5, 0.5], None, "1 deltas but 2 weights"),
        ([_f32(1.0), _f32(1.0, 2.0)], [0.5, 0.5], None, "delta 1 has shape"),
        ([_f32(1.0)], [1.0], np.zeros(1, np.float64), "out must be float32"),
    ],
)
def test_merge_deltas_validates(deltas, weights, out, match):
    with pytest.raises(MergeError, match=match):
        merge_deltas(deltas, weights, out=out)
