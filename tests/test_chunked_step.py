"""The in-place outer step: chunked equals the whole-fragment optax step bit for bit, buffers
shared with JAX zero-copy and updated in place, int8 frames as the codec writes them, and a
shard whose params equal an independent numpy decoder of its published frames."""

import jax
import msgpack
import numpy as np
import pytest
import zstandard
from shard_helpers import delta_frames, init_payload, plan_for, push_header

import codec
from paramserver.server.config import ShardConfig
from paramserver.server.state import ShardState
from paramserver.server.step.downlink import Downlink, DownlinkError, new_residual, quantize_chunk
from paramserver.server.step.fragment_step import ChunkedStep, host_vector
from paramserver.server.step.outer import (
    DonatingStep,
    FragmentOptimizer,
    OuterError,
    make_outer_optimizer,
    outer_rule,
)

pytestmark = pytest.mark.timeout(120)

T0 = 1_000_000.0
CONFIGS = [
    ("nesterov", 0.7, 0.9, 1),
    ("sgd", 1.0, 0.0, 1),
    ("delayed-nesterov", 0.7, 0.9, 3),
    ("nesterov", 0.5, 0.8, 2),
]


def rand(n, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def slices_of(vector):
    def fill(lo, hi, out):
        out[...] = vector[lo:hi]

    return fill


@pytest.mark.parametrize(("name", "lr", "momentum", "delay"), CONFIGS)
def test_the_chunked_step_is_the_whole_fragment_step_bit_for_bit(name, lr, momentum, delay):
    tx = make_outer_optimizer(name, lr, momentum, delay)
    n = 5000  # 4 chunks of 1024 and a tail of 904
    whole, chunked = DonatingStep(tx), ChunkedStep(tx, chunk=1024)
    params = host_vector(rand(n, 0))
    state = chunked.init(params)
    ref_p, ref_s = jax.numpy.array(params), tx.init(jax.numpy.array(params))
    for k in range(7):
        delta = host_vector(rand(n, k + 1, 0.1))
        ref_p, ref_s = whole(ref_p, ref_s, delta)
        chunked.step(params, state, slices_of(delta))
        assert params.tobytes() == np.asarray(ref_p).tobytes(), k
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_s), strict=True):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), k


@pytest.mark.parametrize(("name", "lr", "momentum", "delay"), CONFIGS)
def test_settings_given_per_step_are_the_constant_step_bit_for_bit(name, lr, momentum, delay):
    # the shard's step: lr and momentum as arguments of the jit, not constants compiled into it
    tx = make_outer_optimizer(name, lr, momentum, delay)
    n = 5000
    whole, chunked = DonatingStep(tx), ChunkedStep(outer_rule(name, delay), chunk=1024)
    whole_rule = DonatingStep(outer_rule(name, delay))
    params = host_vector(rand(n, 0))
    state = chunked.init(params)
    ref_p, ref_s = jax.numpy.array(params), tx.init(jax.numpy.array(params))
    rule_p, rule_s = jax.numpy.array(params), tx.init(jax.numpy.array(params))
    for k in range(7):
        delta = host_vector(rand(n, k + 1, 0.1))
        ref_p, ref_s = whole(ref_p, ref_s, delta)
        rule_p, rule_s = whole_rule(rule_p, rule_s, delta, (lr, momentum))
        chunked.step(params, state, slices_of(delta), settings=(lr, momentum))
        assert params.tobytes() == np.asarray(ref_p).tobytes() == np.asarray(rule_p).tobytes(), k
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_s), strict=True):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), k


def test_changing_lr_and_momentum_between_steps_compiles_nothing_new():
    # each step equals the constant transformation of its own settings on the same state
    schedule = [(0.7, 0.6), (1.0, 0.3), (1.4, 0.0), (0.7, 0.6), (1.0, 0.8)]
    n = 3000
    chunked = ChunkedStep(outer_rule("nesterov"), chunk=1024)
    params = host_vector(rand(n, 0))
    state = chunked.init(params)
    ref_p, ref_s = jax.numpy.array(params), chunked.tx.init(jax.numpy.array(params))
    compiled = []
    for k, (lr, momentum) in enumerate(schedule):
        delta = host_vector(rand(n, k + 1, 0.1))
        ref_p, ref_s = DonatingStep(make_outer_optimizer("nesterov", lr, momentum))(
            ref_p, ref_s, delta
        )
        chunked.step(params, state, slices_of(delta), settings=(lr, momentum))
        compiled.append(chunked._apply._cache_size())
        assert params.tobytes() == np.asarray(ref_p).tobytes(), k
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_s), strict=True):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), k
    assert compiled == [2] * len(schedule)  # one per chunk length (1024, 952), not per setting
    with pytest.raises(OuterError, match="pass settings"):
        chunked.step(params, state, slices_of(delta))
    with pytest.raises(OuterError, match="momentum"):
        chunked.step(params, state, slices_of(delta), settings=(0.7, 1.0))


def test_the_sink_gets_the_optimizer_update_plus_the_carry():
    tx = make_outer_optimizer("nesterov", 0.7, 0.9)
    n = 3000
    params = host_vector(rand(n, 0))
    chunked = ChunkedStep(tx, chunk=1024)
    carry = new_residual(n)
    carry[...] = rand(n, 5, 1e-3)
    delta = host_vector(rand(n, 1, 0.1))
    got, seen = np.zeros(n, np.float32), []

    def sink(lo, hi, update):
        seen.append((lo, hi))
        got[lo:hi] = np.asarray(update)

    before = params.copy()
    chunked.step(params, chunked.init(params), slices_of(delta), sink, carry)
    assert seen == [(0, 1024), (1024, 2048), (2048, 3000)]
    # first Nesterov step from zero momentum: update = -lr * (beta * g + g)
    want = -0.7 * (0.9 * delta.astype(np.float64) + delta) + carry.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
    assert params.tobytes() == before.tobytes()  # the sink owns the params


def test_buffers_are_shared_with_jax_and_updated_in_place():
    tx = make_outer_optimizer("nesterov", 0.7, 0.9)
    chunked = ChunkedStep(tx, chunk=1024)
    params = host_vector(rand(4096, 0))
    state = chunked.init(params)
    (momentum,) = [leaf for leaf in jax.tree.leaves(state) if leaf.shape == (4096,)]
    assert params.ctypes.data % 64 == 0 and momentum.ctypes.data % 64 == 0
    assert chunked.views.of(params).unsafe_buffer_pointer() == params.ctypes.data
    assert chunked.views.of(momentum).unsafe_buffer_pointer() == momentum.ctypes.data
    addresses = (params.ctypes.data, momentum.ctypes.data)
    before = params.copy()
    chunked.step(params, state, slices_of(rand(4096, 1)))
    (after,) = [leaf for leaf in jax.tree.leaves(state) if leaf.shape == (4096,)]
    assert (params.ctypes.data, after.ctypes.data) == addresses and after is momentum
    assert not np.array_equal(params, before) and np.any(momentum != 0)


@pytest.mark.parametrize("zstd", [None, 1])
@pytest.mark.parametrize("n", [1000, (1 << 20) * 2 + 70_000])
def test_an_int8_publication_writes_the_codecs_frames_and_applies_their_decoding(n, zstd):
    # n > 2 MiB of codes: two full frames and a tail, so a frame that aliased the
    # next one's buffer (no zstd: frames are sent from their own buffers) differs
    params, residual = host_vector(rand(n, 0)), new_residual(n)
    target = rand(n, 1, 1e-2)
    start = params.copy()
    publication = Downlink("int8", zstd_level=zstd).begin(params, residual)
    chunk = 1 << 18
    quantize = jax.jit(quantize_chunk, static_argnums=1)  # jitted, as inside the step
    for lo in range(0, n, chunk):
        publication.apply(lo, min(n, lo + chunk), quantize(target[lo : lo + chunk], 256))
    frames = publication.frames()
    want, _ = codec.int8(zstd_level=zstd).encode({"values": target})
    assert [bytes(memoryview(f)) for f in frames] == [bytes(memoryview(f)) for f in want]
    decoded = codec.decode(frames)["values"]
    assert params.tobytes() == np.add(start, decoded, dtype=np.float32).tobytes()
    # the residual is what the decoding missed, rounded to bfloat16; XLA may fuse the
    # product into the difference (FMA): off by at most a float32 rounding of decoded
    missed = target.astype(np.float64) - decoded
    slack = 2**-8 * np.abs(missed) + 2**-23 * np.abs(decoded)
    assert np.all(np.abs(residual.astype(np.float64) - missed) <= slack)
    assert np.count_nonzero(residual) > n // 2


def test_a_non_finite_update_is_refused():
    params, residual = host_vector(np.zeros(512, np.float32)), new_residual(512)
    publication = Downlink("int8").begin(params, residual)
    bad = np.zeros(512, np.float32)
    bad[3] = np.inf
    with pytest.raises(DownlinkError, match="not finite"):
        publication.apply(0, 512, quantize_chunk(bad, 256))


def numpy_decode(frames):
    """An independent decoder of an int8 message: zstd frames, codes, block scales."""
    header = msgpack.unpackb(bytes(memoryview(frames[0])))
    assert header["scheme"] == "int8"
    unpack = zstandard.ZstdDecompressor().decompress if header["zstd"] else bytes
    payload = b"".join(unpack(bytes(memoryview(f))) for f in frames[1:])
    ((path, shape, dtype, offset),) = header["tensors"]
    n, block = shape[0], header["block"]
    codes = np.frombuffer(payload, np.int8, n, offset)
    blocks = -(-n // block)
    scales = np.frombuffer(payload, np.float32, blocks, offset + -(-n // 4) * 4)
    steps = scales * np.float32(1 / 127)  # float32 product, as the format defines the step
    return codes.astype(np.float32) * np.repeat(steps, block)[:n]


def test_the_shard_equals_an_independent_decoding_of_its_published_frames():
    rng = np.random.default_rng(7)
    flat = {"w": rng.standard_normal(2_600_000).astype(np.float32)}  # 2 fragments, 5 chunks each
    cfg = ShardConfig(mode="async", downlink="int8", fsync=False)
    plan = plan_for(flat, 1, 2)
    state = ShardState(cfg, 0)
    state.initialize(plan.to_wire(), init_payload(plan, flat))
    replica = {f.index: plan.gather(flat, f.index).astype(np.float32) for f in plan.fragments}
    kept_before = {f: state.snapshot(f)[1] for f in replica}
    for island in ("a", "b"):
        state.hello(island, T0)
    for rnd in range(1, 4):
        for fragment in replica:
            for island in ("a", "b"):
                d = rng.standard_normal(plan.fragments[fragment].size).astype(np.float32) * 0.01
                base = state.versions()[fragment]
                header = push_header(plan, island, rnd, fragment, base, tokens=1000 * rnd)
                assert state.submit_delta(header, delta_frames(d), T0).status == "accepted"
            _, update = state.step(fragment, T0)
            assert not update.values.flags.writeable
            assert not msgpack.unpackb(bytes(memoryview(update.frames[0])))["zstd"]  # crc32 only
            replica[fragment] = np.add(replica[fragment], numpy_decode(update.frames))
            assert replica[fragment].dtype == np.float32
            assert replica[fragment].tobytes() == state.snapshot(fragment)[1].tobytes()
    for f, kept in kept_before.items():  # a snapshot taken before the steps kept its values
        assert kept.tobytes() == plan.gather(flat, f).tobytes()


def shard_with(cfg, size, islands=("a", "b")):
    flat = {"w": rand(size, 3)}
    plan = plan_for(flat, 1, 2)
    state = ShardState(cfg, 0)
    state.initialize(plan.to_wire(), init_payload(plan, flat))
    for island in islands:
        state.hello(island, T0)
    return state, plan


def push_and_step(state, plan, deltas, rnd, fragment=0):
    base = state.versions()[fragment]
    for island, d in deltas.items():
        header = push_header(plan, island, rnd, fragment, base)
        assert state.submit_delta(header, delta_frames(d), T0).status == "accepted"
    return state.step(fragment, T0)[1]


def test_a_shard_step_with_delayed_nesterov_is_the_reference_step_bit_for_bit():
    cfg = ShardConfig(
        mode="async", fsync=False, outer_optimizer="delayed-nesterov", nesterov_delay=2,
        outer_lr=0.7, outer_momentum=0.9, downlink="float32",
    )  # fmt: skip
    state, plan = shard_with(cfg, 1_200_000, islands=("a",))  # fragments of 3 chunks and a tail
    size = plan.fragments[0].size
    # the whole-fragment step with the momentum in the shard's dtype (`momentum_dtype`)
    ref = FragmentOptimizer(
        make_outer_optimizer("delayed-nesterov", 0.7, 0.9, 2, cfg.momentum_dtype)
    )
    params = plan.gather({"w": rand(1_200_000, 3)}, 0)
    ref_state = ref.init(params)
    for rnd in range(1, 5):
        d = rand(size, 10 + rnd, 0.01)
        update = push_and_step(state, plan, {"a": d}, rnd)  # one fresh island: merged = d
        params, ref_state = ref.step(params, ref_state, d)
        assert update.values.tobytes() == params.tobytes(), rnd
        got = state.fragments[0].opt_state
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref_state), strict=True):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), rnd


def test_a_step_merging_one_of_two_islands_is_half_a_round_of_the_same_nesterov():
    # float32 momentum (explicit): checked against 0.5 d to rtol 1e-6; bfloat16 keeps 8 bits
    cfg = ShardConfig(mode="sync", fsync=False, downlink="float32", outer_lr=0.7,
                      outer_momentum=0.9, momentum_dtype="float32")  # fmt: skip
    state, plan = shard_with(cfg, 600_000)
    size = plan.fragments[0].size
    start = state.snapshot(0)[1].astype(np.float64)
    d = rand(size, 20, 0.01)
    update = push_and_step(state, plan, {"a": d}, 1)  # b stayed silent: half a round
    # merged = (1/2) d; momentum m = d/2, moved once the round completes: update 0.7 d/2
    np.testing.assert_allclose(update.values, start - 0.7 * 0.5 * d, rtol=1e-5, atol=1e-7)
    (momentum,) = [x for x in jax.tree.leaves(state.fragments[0].opt_state) if x.shape == (size,)]
    np.testing.assert_allclose(momentum, 0.5 * d, rtol=1e-6)  # the one optimizer moved
