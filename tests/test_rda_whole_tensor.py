"""RDA per whole tensor: the merge is the same wherever the plan cuts a tensor (1, 2, 4 fragments).

The expected values come from a float64 numpy reference of the whole-tensor
formula, merged = (sum_i |u_i|) * phi(sum_i C_i * phi(u_i)) per tensor with
u_i = sum_k c_ik * d_ik and C_i = sum_k c_ik, written here from the definition.
"""

import numpy as np
import pytest

from paramserver.server.step.merge import MergeError, TensorPartial, chunk_merge, rda_partials
from paramserver.wire.plan import LeafSpec, make_plan

pytestmark = pytest.mark.timeout(60)


def reference(deltas, coefficients, leaves):
    """Whole-tensor RDA in float64: `deltas` (island, {path: vector}) with one c per delta."""
    out = {}
    for path, size in leaves:
        u, weight = {}, {}
        for (island, d), c in zip(deltas, coefficients, strict=True):
            u[island] = u.get(island, np.zeros(size)) + c * d[path].astype(np.float64)
            weight[island] = weight.get(island, 0.0) + c
        if "embed" in path or len(u) == 1:
            out[path] = sum(u.values())
            continue
        norm = sum(np.linalg.norm(v) for v in u.values())
        direction = sum(weight[i] * v / np.linalg.norm(v) for i, v in u.items())
        out[path] = norm * direction / np.linalg.norm(direction)
    return out


def merged_by_plan(deltas, coefficients, leaves, shards, fragments):
    """Each fragment merged on its own, with the partial sums of the other fragments."""
    plan = make_plan([LeafSpec(p, (n,), "float32") for p, n in leaves], shards, fragments)
    per_fragment = [
        [(island, plan.gather(d, f.index)) for island, d in deltas] for f in plan.fragments
    ]
    partials = [rda_partials(per_fragment[f.index], coefficients, f) for f in plan.fragments]
    flat = {p: np.zeros(n, np.float32) for p, n in leaves}
    for f in plan.fragments:
        others = [partials[g.index] for g in plan.fragments if g.index != f.index]
        merged = chunk_merge("rda", per_fragment[f.index], coefficients, f, others).whole()
        plan.scatter(f.index, merged, flat)
    return plan, flat


LEAVES = [("a/w", 40), ("b/embed", 12), ("c/w", 36)]


def random_deltas(seed):
    rng = np.random.default_rng(seed)
    shared = {p: rng.standard_normal(n) for p, n in LEAVES}
    deltas = []
    for island, scale in [("x", 1.0), ("y", 0.5), ("x", 2.0), ("z", 1.5)]:
        deltas.append(
            (island, {p: (0.6 * shared[p] + scale * rng.standard_normal(n)).astype(np.float32)
                      for p, n in LEAVES})
        )  # fmt: skip
    return deltas


@pytest.mark.parametrize("shards, fragments", [(1, 1), (1, 2), (2, 2), (2, 4), (4, 4)])
def test_one_two_and_four_fragments_give_the_whole_tensor_merge(shards, fragments):
    deltas = random_deltas(7)
    coefficients = [0.4, 0.25, 0.1, 0.3]  # one per delta: island x has two, unequal
    plan, got = merged_by_plan(deltas, coefficients, LEAVES, shards, fragments)
    if fragments == 4:
        assert any(len(f.slices) == 1 and f.size < 40 for f in plan.fragments)  # a cut tensor
    want = reference(deltas, coefficients, LEAVES)
    for path, _ in LEAVES:
        np.testing.assert_allclose(got[path], want[path], rtol=1e-6, atol=1e-6, err_msg=path)


def test_half_agreeing_half_orthogonal_islands_get_one_factor_on_both_halves():
    # two islands agree on the first half of "w" and are orthogonal on the second
    a = np.array([1.0, 0, 0, 0, 1.0, 0, 0, 0], np.float32)
    b = np.array([1.0, 0, 0, 0, 0, 1.0, 0, 0], np.float32)
    deltas = [("p", {"w": a}), ("q", {"w": b})]
    mean = 0.5 * (a + b)
    for fragments in (1, 2):
        _, got = merged_by_plan(deltas, [0.5, 0.5], [("w", 8)], 1, fragments)
        ratio = np.sqrt(4 / 3)  # |merged| / |mean| = sqrt2 / sqrt(3/2)
        np.testing.assert_allclose(got["w"][:4], ratio * mean[:4], rtol=1e-6)
        np.testing.assert_allclose(got["w"][4:], ratio * mean[4:], rtol=1e-6)


def test_without_the_other_pieces_a_cut_tensor_is_normalised_on_its_piece():
    a = np.array([1.0, 0, 0, 0, 1.0, 0, 0, 0], np.float32)
    b = np.array([1.0, 0, 0, 0, 0, 1.0, 0, 0], np.float32)
    plan = make_plan([LeafSpec("w", (8,), "float32")], 1, 2)
    second = plan.fragments[1]
    got = chunk_merge("rda", [("p", a[4:]), ("q", b[4:])], [0.5, 0.5], second).whole()
    np.testing.assert_allclose(got, np.sqrt(2) * 0.5 * (a[4:] + b[4:]), rtol=1e-6)


def test_partials_of_other_islands_are_ignored_and_missing_islands_count_zero():
    plan = make_plan([LeafSpec("w", (8,), "float32")], 1, 2)
    first, second = plan.fragments
    a, b = np.eye(8, dtype=np.float32)[0], np.eye(8, dtype=np.float32)[1]
    # island q sent nothing for the other half: its partial there has only p (and a stranger)
    outside = {"w": TensorPartial(("s", "p"), np.array([[9.0, 0.0], [0.0, 3.0]]))}
    got = chunk_merge("rda", [("p", a[:4]), ("q", b[:4])], [0.5, 0.5], first, [outside]).whole()
    # whole-tensor norms |u_p| = sqrt(0.25 + 3), |u_q| = 0.5, orthogonal
    up, uq = np.sqrt(0.25 + 3.0), 0.5
    length = np.hypot(0.5, 0.5)  # |0.5 * phi(u_p) + 0.5 * phi(u_q)|
    want = (up + uq) / length * (0.5 * 0.5 * a[:4] / up + 0.5 * 0.5 * b[:4] / uq)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert second.index == 1


@pytest.mark.parametrize(
    "partial, match",
    [
        (TensorPartial(("p", "p"), np.eye(2)), "distinct"),
        (TensorPartial(("p", "q"), np.eye(3)), "finite 2x2"),
        (TensorPartial(("p", "q"), np.array([[1.0, np.nan], [0.0, 1.0]])), "finite 2x2"),
        (TensorPartial(("p", "q"), -np.eye(2)), "negative squared norms"),
    ],
)
def test_bad_partial_sums_are_refused_with_the_reason(partial, match):
    plan = make_plan([LeafSpec("w", (8,), "float32")], 1, 2)
    first = plan.fragments[0]
    a, b = np.ones(4, np.float32), np.arange(4, dtype=np.float32)
    with pytest.raises(MergeError, match=match):
        chunk_merge("rda", [("p", a), ("q", b)], [0.5, 0.5], first, [{"w": partial}])


def test_the_mean_ignores_partials_and_keeps_its_float32_arithmetic():
    plan = make_plan([LeafSpec("w", (8,), "float32")], 1, 1)
    frag = plan.fragments[0]
    rng = np.random.default_rng(3)
    d = [rng.standard_normal(8).astype(np.float32) for _ in range(3)]
    got = chunk_merge("mean", [("p", d[0]), ("q", d[1]), ("p", d[2])], [0.3, 0.5, 0.2], frag)
    want = d[0] * np.float32(0.3) + d[1] * np.float32(0.5) + d[2] * np.float32(0.2)
    assert got.whole().tobytes() == want.tobytes()
