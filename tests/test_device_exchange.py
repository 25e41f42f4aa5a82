"""The island exchange on the device is bit-equal to the numpy codec and to the host fold.

References are independent of the code under test: the numpy codec
(`codec.int8()` / `codec.int4()` with error feedback) for the frames, and
the fold rule written out in numpy (global = base + decoded increment, local
= global + (local - anchor)) for the parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import codec
from codec.coded import frame_codes, read_codes
from paramserver.client import Update
from paramserver.wire.plan import leaf_specs, make_plan
from worker import device_quant
from worker.device_exchange import DeviceExchange
from worker.exchange import UnfoldableUpdate
from worker.param_tree import TreeLayout

pytestmark = pytest.mark.timeout(120)
SCHEMES = [("int8", 127, 256), ("int4", 7, 64), ("int8", 127, 100), ("int4", 7, 6)]


def _same_frames(a: list, b: list) -> bool:
    return len(a) == len(b) and all(bytes(x) == bytes(y) for x, y in zip(a, b, strict=True))


def _delta(rng: np.random.Generator, n: int) -> np.ndarray:
    """A delta with what the codec treats specially: zero blocks, flushed tiny blocks, ties."""
    x = (rng.normal(size=n) * 10.0 ** rng.integers(-4, 2)).astype(np.float32)
    x[:70] = 0.0
    # below 2**-118 (a block of them is flushed: the residual keeps them) and positive, so
    # their sums over rounds stay normal: XLA flushes subnormals to zero, numpy does not
    # (the one place the two may differ)
    x[70:140] = rng.uniform(1e-37, 2e-37, 70).astype(np.float32)
    x[150:152] = np.float32(63.5), np.float32(127.0)  # absmax 127: scale 1, 63.5 a tie
    return x


@pytest.mark.parametrize(("scheme", "levels", "block"), SCHEMES)
@pytest.mark.parametrize("zstd_level", [1, None])
def test_jitted_quantize_frames_equal_the_numpy_codecs_over_rounds_of_error_feedback(
    scheme, levels, block, zstd_level
):
    rng = np.random.default_rng(levels + block)
    n = max(5 * block, 200) + 3  # a short last block (odd for int4: a padded last nibble)
    reference = getattr(codec, scheme)(block_size=block, zstd_level=zstd_level)
    state = reference.init({"delta": np.zeros(n, np.float32)})
    residual = jnp.zeros(n, jnp.float32)
    step = jax.jit(lambda x, r: device_quant.quantize(x + r, levels, block))
    for _ in range(5):
        x = _delta(rng, n)
        want, state = reference.encode({"delta": x}, state)
        codes, scales, residual = step(jnp.asarray(x), residual)
        got = frame_codes(scheme, block, zstd_level, np.asarray(codes), np.asarray(scales), n)
        assert _same_frames(got, want)
        assert np.array_equal(np.asarray(residual), state.residuals[0])


@pytest.mark.parametrize(("scheme", "levels", "block"), SCHEMES)
def test_codes_read_back_decode_as_codec_decode_on_the_host_and_on_the_device(
    scheme, levels, block
):
    n = max(7 * block, 200) + 1
    x = _delta(np.random.default_rng(3), n)
    frames, _ = getattr(codec, scheme)(block_size=block).encode({"values": x})
    want = codec.decode(frames)["values"]
    coded = read_codes(frames, "values")
    assert coded is not None and (coded.scheme, coded.block, coded.size) == (scheme, block, n)
    assert np.array_equal(coded.values(), want)
    on_device = jax.jit(lambda c, s: device_quant.dequantize(c, s, n, levels, block))
    assert np.array_equal(np.asarray(on_device(coded.codes, coded.scales)), want)
    assert read_codes(frames, "delta") is None  # another tensor name
    assert read_codes(codec.raw().encode({"values": x})[0], "values") is None


def test_framing_refuses_non_finite_scales_and_wrong_code_lengths():
    with pytest.raises(codec.CodecError, match="NaN or Inf"):
        frame_codes("int8", 4, 1, np.zeros(8, np.int8), np.array([1, np.nan], np.float32), 8)
    with pytest.raises(codec.CodecError, match="int4 codes of 8 elements must be uint8"):
        frame_codes("int4", 4, 1, np.zeros(8, np.uint8), np.ones(2, np.float32), 8)


def _tree(rng: np.random.Generator) -> dict:
    """Leaves that fragments cut across, one of them bfloat16."""
    return {
        "a": rng.normal(size=(37, 5)).astype(np.float32),
        "b": rng.normal(size=(300,)).astype(np.float32),
        "c": rng.normal(size=(9, 4)).astype(ml_dtypes.bfloat16),
    }


class Reference:
    """The exchange rule in numpy, per fragment (what the host path computes)."""

    def __init__(self, plan, flat, delta_codec):
        self.plan, self.codec = plan, delta_codec
        self.base = {f.index: plan.gather(flat, f.index) for f in plan.fragments}
        self.anchor = {i: v.copy() for i, v in self.base.items()}
        self.state = {
            i: delta_codec.init({"delta": np.zeros(v.size, np.float32)})
            for i, v in self.base.items()
        }

    def push(self, local: dict, fragments=None) -> dict:
        out = {}
        for i in self.base if fragments is None else fragments:
            now = self.plan.gather(local, i)
            delta = (self.anchor[i] - now).astype(np.float32)
            self.anchor[i] = now
            out[i], self.state[i] = self.codec.encode({"delta": delta}, self.state[i])
        return out

    def fold(self, local: dict, index: int, new_global: np.ndarray) -> dict:
        now = self.plan.gather(local, index)
        new_local = new_global + (now - self.anchor[index])
        self.base[index] = self.anchor[index] = new_global
        flat = {k: np.asarray(v, np.float32).copy() for k, v in local.items()}
        self.plan.scatter(index, new_local, flat)
        return {k: flat[k].astype(local[k].dtype) for k in local}


def _both(rng: np.random.Generator, shards: int, scheme: str, block: int):
    """A tree cut into 3 fragments, its device exchange and the numpy reference."""
    start = _tree(rng)
    flat32 = {k: np.asarray(v, np.float32) for k, v in start.items()}
    plan = make_plan(leaf_specs(start), shards, 3)
    layout = TreeLayout.of({k: jnp.asarray(v) for k, v in start.items()})
    dev = DeviceExchange(
        layout, plan, flat32, dict.fromkeys(range(3), 0),
        scheme=scheme, block=block, zstd_level=1, rule="keep-progress",
    )  # fmt: skip
    return (
        start,
        plan,
        layout,
        dev,
        Reference(plan, flat32, getattr(codec, scheme)(block_size=block)),
    )


@pytest.mark.parametrize(("scheme", "block"), [("int8", 64), ("int4", 16)])
def test_device_exchange_pushes_the_codecs_frames_and_folds_like_the_host(scheme, block):
    rng = np.random.default_rng(7)
    start, plan, layout, dev, ref = _both(rng, 2, scheme, block)
    local = {k: np.asarray(v) for k, v in start.items()}
    downlink = codec.int8(block_size=block)  # blocks that fit the island's: the one-pass fold
    versions = dict.fromkeys(range(3), 0)
    for version in range(1, 5):
        local = {k: (v + rng.normal(size=v.shape) * 0.01).astype(v.dtype) for k, v in local.items()}
        leaves = layout.leaves({k: jnp.asarray(v) for k, v in local.items()})
        got = dev.encode(leaves, [0, 1, 2], leader=True)
        want = ref.push(local)
        assert all(_same_frames(got[i], want[i]) for i in range(3))
        local = {k: (v + rng.normal(size=v.shape) * 0.01).astype(v.dtype) for k, v in local.items()}
        # odd versions: fragment 1 gets a published int8 increment (codes cross), fragment 2
        # full values; even ones: every fragment an increment (one pass over the flat state)
        updates, targets = [], {}
        for f in (0, 1, 2) if version % 2 == 0 else (1,):
            step = rng.normal(size=plan.fragments[f].size).astype(np.float32) * 0.1
            frames, _ = downlink.encode({"values": step})
            targets[f] = ref.base[f] + codec.decode(frames)["values"]
            updates.append(Update(f, versions[f] + 1, targets[f], read_codes(frames, "values")))
        if version % 2:
            targets[2] = (ref.base[2] + 0.5).astype(np.float32)
            updates.append(Update(2, versions[2] + 1, targets[2]))
        versions.update((f, versions[f] + 1) for f in targets)
        leaves = layout.leaves({k: jnp.asarray(v) for k, v in local.items()})
        folded = dev.fold(leaves, updates)
        for f, target in targets.items():
            local = ref.fold(local, f, target)
        for name, leaf in zip(layout.names, folded, strict=True):
            assert np.asarray(leaf).dtype == local[name].dtype
            assert np.array_equal(np.asarray(leaf), local[name]), name
        assert dev.versions == versions
    base = dev.base_values()
    for i in range(3):
        assert np.array_equal(plan.gather(base, i), ref.base[i])


def test_an_increment_that_skips_a_version_folds_from_the_full_values():
    rng = np.random.default_rng(1)
    start = {"w": rng.normal(size=(64,)).astype(np.float32)}
    plan = make_plan(leaf_specs(start), 1, 1)
    layout = TreeLayout.of({"w": jnp.asarray(start["w"])})
    dev = DeviceExchange(
        layout, plan, start, {0: 3}, scheme="int8", block=16, zstd_level=None, rule="overwrite"
    )
    frames, _ = codec.int8().encode({"values": np.ones(64, np.float32)})
    target = (start["w"] * 2).astype(np.float32)
    skipped = Update(0, 5, target, read_codes(frames, "values"))  # codes of 4 -> 5; we hold 3
    assert dev.usable_increment(skipped) is None
    (out,) = dev.fold(layout.leaves({"w": jnp.asarray(start["w"])}), [skipped])
    assert np.array_equal(np.asarray(out), target)  # overwrite: local = the full values
    assert dev.versions == {0: 5}


def test_an_update_with_neither_usable_codes_nor_values_is_refused_by_type_and_folds_nothing():
    rng = np.random.default_rng(2)
    start = {"w": rng.normal(size=(64,)).astype(np.float32)}
    plan = make_plan(leaf_specs(start), 1, 1)
    layout = TreeLayout.of({"w": jnp.asarray(start["w"])})
    dev = DeviceExchange(
        layout, plan, start, {0: 3}, scheme="int8", block=16, zstd_level=None, rule="overwrite"
    )
    leaves = layout.leaves({"w": jnp.asarray(start["w"])})
    frames, _ = codec.int8().encode({"values": np.ones(64, np.float32)})
    cases = [  # (update, has_increment, values_size)
        (Update(0, 5, None, read_codes(frames, "values")), True, None),  # codes of 4 -> 5
        (Update(0, 4, None), False, None),  # a version alone (keep="versions")
        (Update(0, 4, np.zeros(63, np.float32)), False, 63),  # values of another size
    ]
    for update, has_increment, values_size in cases:
        with pytest.raises(UnfoldableUpdate) as caught:
            dev.fold(leaves, [update])
        err = caught.value
        assert (err.fragment, err.version, err.held_version) == (0, update.version, 3)
        assert (err.has_increment, err.values_size, err.fragment_size) == (
            has_increment,
            values_size,
            64,
        )
        assert dev.versions == {0: 3}  # nothing adopted
    assert np.array_equal(dev.base_values()["w"], start["w"])
    # two versions of one fragment in one call: the second's codes follow the first
    steps = [np.full(64, 0.5, np.float32), np.linspace(-1, 1, 64, dtype=np.float32)]
    coded = [codec.int8(block_size=16).encode({"values": x})[0] for x in steps]
    (out,) = dev.fold(
        leaves, [Update(0, 4 + i, None, read_codes(c, "values")) for i, c in enumerate(coded)]
    )
    want = start["w"] + codec.decode(coded[0])["values"] + codec.decode(coded[1])["values"]
    assert dev.versions == {0: 5}
    assert np.array_equal(np.asarray(out), want)  # overwrite: local = the new global values


def test_streamed_pushes_of_some_fragments_equal_the_codecs_and_leave_the_others_alone():
    rng = np.random.default_rng(11)
    start, _, layout, dev, ref = _both(rng, 1, "int4", 16)
    local = {k: np.asarray(v) for k, v in start.items()}
    for due in ([1], [0, 2], [2], [0, 1, 2]):
        local = {k: (v + rng.normal(size=v.shape) * 0.01).astype(v.dtype) for k, v in local.items()}
        got = dev.encode(layout.leaves({k: jnp.asarray(v) for k, v in local.items()}), due, True)
        want = ref.push(local, due)
        assert sorted(got) == due and all(_same_frames(got[i], want[i]) for i in due)


def test_any_set_of_fragments_runs_on_one_of_few_compiled_functions():
    # 3 fragments: every set of them pushed and folded (as skipped pushes and updates that
    # arrive apart make them under faults) needs the push of all or of one (4 functions,
    # not 7), the whole fold and per fragment its codes and its values fold (7, not 26+);
    # each new one compiles in the middle of a round
    rng = np.random.default_rng(5)
    start, plan, layout, dev, ref = _both(rng, 1, "int8", 64)
    local = {k: np.asarray(v) for k, v in start.items()}
    downlink = codec.int8(block_size=64)
    sets = [[0], [1], [2], [0, 1], [0, 2], [1, 2], [0, 1, 2]]
    for due in sets:
        local = {k: (v + rng.normal(size=v.shape) * 0.01).astype(v.dtype) for k, v in local.items()}
        got = dev.encode(layout.leaves({k: jnp.asarray(v) for k, v in local.items()}), due, True)
        want = ref.push(local, due)
        assert all(_same_frames(got[i], want[i]) for i in due)
    for due in sets:
        updates = []
        for f in due:
            if f == 2:  # full values for fragment 2, codes for the others
                updates.append(
                    Update(f, dev.versions[f] + 1, (ref.base[f] + 0.5).astype(np.float32))
                )
                continue
            frames, _ = downlink.encode(
                {"values": np.full(plan.fragments[f].size, 0.1, np.float32)}
            )
            target = ref.base[f] + codec.decode(frames)["values"]
            updates.append(Update(f, dev.versions[f] + 1, target, read_codes(frames, "values")))
        folded = dev.fold(layout.leaves({k: jnp.asarray(v) for k, v in local.items()}), updates)
        for u in updates:
            local = ref.fold(local, u.fragment, u.values)
        for name, leaf in zip(layout.names, folded, strict=True):
            assert np.array_equal(np.asarray(leaf), local[name]), name
    assert len(dev._pushes) == 3 + 1
    assert len(dev._folds) <= 2 * 3 + 1


@pytest.mark.parametrize(("scheme", "block"), [("int8", 64), ("int4", 16)])
def test_a_refused_pushs_mass_returns_into_the_residual_as_the_codecs_refund(scheme, block):
    # fragment 1's first push is finally refused: its decoded values go back into the
    # residual, so the next push of fragment 1 carries them again, bit for bit as the
    # numpy codec's error feedback does with `codec.refund` (a refund that were lost would
    # leave the device's next frames different from the reference's, which refunds)
    rng = np.random.default_rng(5)
    start, _, layout, dev, ref = _both(rng, 2, scheme, block)
    local = {k: np.asarray(v) for k, v in start.items()}
    for round_ in range(3):
        local = {k: (v + rng.normal(size=v.shape) * 0.01).astype(v.dtype) for k, v in local.items()}
        got = dev.encode(
            layout.leaves({k: jnp.asarray(v) for k, v in local.items()}), [0, 1, 2], True
        )
        want = ref.push(local)
        assert all(_same_frames(got[i], want[i]) for i in range(3))
        if round_ == 0:
            refused = codec.decode(got[1])["delta"]
            assert np.abs(refused).sum() > 0  # there is mass to lose
            dev.refund(1, refused)
            ref.state[1] = codec.refund(ref.state[1], {"delta": refused})


def test_after_warm_up_no_round_compiles_a_function_and_warming_changes_nothing():
    """What faults call for (a push of some fragments, a fold of full values, a refund)
    is compiled by `warm(rare=True)`: the compiled functions kept per exchange stay as
    many over the rounds (each one holds memory: islands grew in steps mid-run)."""
    rng = np.random.default_rng(11)
    start, plan, layout, dev, ref = _both(rng, 2, "int8", 64)
    downlink = codec.int8(block_size=64)
    every = [0, 1, 2]
    dev.warm(layout.leaves({k: jnp.asarray(v) for k, v in start.items()}),
             [every, [0], [1], [2]], [("int8", 64)], rare=True)  # fmt: skip
    compiled = (len(dev._pushes), len(dev._folds), len(dev._refunds))
    assert compiled == (4, 1 + 3 + 3, 3)  # folds: whole, codes per fragment, values per fragment
    local = {k: np.asarray(v) for k, v in start.items()}
    versions = dict.fromkeys(every, 0)
    for r in range(6):
        local = {k: (v + rng.normal(size=v.shape) * 0.01).astype(v.dtype) for k, v in local.items()}
        due = every if r % 2 == 0 else [0, 2]  # a skipped push: some fragments, one call each
        leaves = layout.leaves({k: jnp.asarray(v) for k, v in local.items()})
        got = dev.encode(leaves, due, leader=True)
        want = ref.push(local, due)
        assert all(_same_frames(got[i], want[i]) for i in due)  # warming changed nothing
        if r == 3:  # the shards refused fragment 2's push: its mass goes back
            values = codec.decode(list(got[2]))["delta"]
            dev.refund(2, values)
            ref.state[2] = codec.refund(ref.state[2], {"delta": values})
        updates, targets = [], {}
        for f in every if r % 2 else [1]:  # increments: whole or one; fragment 0 full values
            step = rng.normal(size=plan.fragments[f].size).astype(np.float32) * 0.1
            frames, _ = downlink.encode({"values": step})
            targets[f] = ref.base[f] + codec.decode(frames)["values"]
            updates.append(Update(f, versions[f] + 1, targets[f], read_codes(frames, "values")))
        if r % 2 == 0:
            targets[0] = (ref.base[0] + 0.25).astype(np.float32)
            updates.append(Update(0, versions[0] + 1, targets[0]))
        versions.update((f, versions[f] + 1) for f in targets)
        folded = dev.fold(leaves, updates)
        for f, target in targets.items():
            local = ref.fold(local, f, target)
        for name, leaf in zip(layout.names, folded, strict=True):
            assert np.array_equal(np.asarray(leaf), local[name]), name
        assert (len(dev._pushes), len(dev._folds), len(dev._refunds)) == compiled, r


def _primitives(jaxpr) -> list:
    """Every equation of a jaxpr, nested calls (jit) included."""
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn)
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", None)
            if inner is not None:
                out += _primitives(inner)
    return out


def test_a_fragments_fold_moves_its_own_state_in_place_not_the_whole_vector():
    # one fragment's version folds in: its anchor and base regions are written into the
    # donated state (work in the fragment's size), not both full vectors concatenated anew
    # (work in the model's size per fragment, in `step`, P times a round with P fragments)
    rng = np.random.default_rng(3)
    start, plan, layout, dev, ref = _both(rng, 2, "int8", 64)
    downlink = codec.int8(block_size=64)
    leaves = layout.leaves({k: jnp.asarray(v) for k, v in start.items()})
    frames, _ = downlink.encode({"values": np.full(plan.fragments[1].size, 0.1, np.float32)})
    update = Update(1, 1, None, read_codes(frames, "values"))
    out = dev.fold(leaves, [update])
    local = ref.fold(
        {k: np.asarray(v) for k, v in start.items()},
        1,
        ref.base[1] + codec.decode(frames)["values"],
    )
    for name, leaf in zip(layout.names, out, strict=True):
        assert np.array_equal(np.asarray(leaf), local[name]), name
    ((key, fn),) = [(k, f) for k, f in dev._folds.items() if k == ((1, "int8", 64),)]
    used = dev.flat.leaves_of([1])
    inc = (jnp.asarray(update.increment.codes), jnp.asarray(update.increment.scales))
    jaxpr = jax.make_jaxpr(fn)([leaves[i] for i in used], dev.anchor, dev.base, [inc])
    whole = [
        e
        for e in _primitives(jaxpr.jaxpr)
        if e.primitive.name == "concatenate" and e.outvars[0].aval.shape == (dev.flat.total,)
    ]
    assert whole == []
    names = {e.primitive.name for e in _primitives(jaxpr.jaxpr)}
    assert "dynamic_update_slice" in names


def test_a_folds_codes_go_into_the_call_without_a_device_put_of_their_own(monkeypatch):
    # a separate device_put of the codes and scales cost a third of a single fragment's
    # fold on the step's thread (0.37 ms of CPU of ~1.2 for `tiny`): the call places them
    rng = np.random.default_rng(5)
    start, plan, layout, dev, ref = _both(rng, 2, "int8", 64)
    leaves = layout.leaves({k: jnp.asarray(v) for k, v in start.items()})
    frames, _ = codec.int8(block_size=64).encode(
        {"values": np.full(plan.fragments[0].size, 0.1, np.float32)}
    )
    update = Update(0, 1, None, read_codes(frames, "values"))
    puts = []
    real_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: puts.append(a) or real_put(*a, **k))
    before = dev.host_device_bytes
    out = dev.fold(leaves, [update])
    assert puts == []
    # still counted: the codes and scales, once per device
    inc = update.increment
    devices = len(layout.shardings[0].device_set)
    assert dev.host_device_bytes - before == (inc.codes.nbytes + inc.scales.nbytes) * devices
    local = ref.fold(
        {k: np.asarray(v) for k, v in start.items()},
        0,
        ref.base[0] + codec.decode(frames)["values"],
    )
    for name, leaf in zip(layout.names, out, strict=True):
        assert np.array_equal(np.asarray(leaf), local[name]), name
