"""The fused outer step (numba): a numpy reference computed by hand, the jitted step bit for bit,
and the compiled mean merge of int8 pending deltas equal to its numpy pieces."""

import numpy as np
import pytest

import codec
from codec.coded import read_coded as read
from paramserver.server.step.downlink import Downlink, DownlinkError, new_residual
from paramserver.server.step.fragment_step import ChunkedStep, FusedNesterov, _kernels, host_vector
from paramserver.server.step.merge import _MeanMerge, scaled
from paramserver.server.step.outer import outer_rule, round_nesterov, set_round_share

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(_kernels() is None, reason="numba is not installed"),
]

F32 = np.float32


def rand(n, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(F32)


def fma(a, b, c):
    """a * b + c rounded once to float32: the product is exact in float64, and rounding the sum
    to float64 first changes its float32 rounding only when that lands on an exact float32 tie
    (about 2**-29 of values; none in these seeded ones)."""
    wide = a.astype(np.float64) * np.float64(b) + c.astype(np.float64)
    return wide.astype(F32)


def bf16_bits(x):
    """float32 -> bfloat16 bits, round to nearest even (finite values)."""
    bits = x.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def reference_step(params, mom, res_bits, g, lr, beta, fresh, due, block):
    """The step of docs/design.md in plain numpy, element by element: round Nesterov,
    the update plus the residual, the codec's int8 rule, the decoded update applied."""
    neg_lr, beta = F32(-lr), F32(beta)
    mom = fma(mom, beta, g) if fresh else mom + g
    y = fma(mom, beta, g) if due else g
    carry = (res_bits.astype(np.uint32) << 16).view(F32)
    v = fma(y, neg_lr, carry)
    codes, scales = np.empty(len(v), np.int8), []
    new_params, new_res = params.copy(), np.empty(len(v), np.uint16)
    step = F32(1.0 / 127)
    for a in range(0, len(v), block):
        blk = v[a : a + block]
        s = F32(np.abs(blk).max())
        s = F32(0) if s < F32(2.0**-118) else s
        inv = min(F32(127) / s if s else F32(np.inf), F32(127) / F32(2.0**-118))
        q = np.rint(blk * inv)
        st = F32(s * step)
        codes[a : a + block] = q.astype(np.int8)
        new_params[a : a + block] += q.astype(np.int8).astype(F32) * st
        new_res[a : a + block] = bf16_bits((blk - q * st).astype(F32))
        scales.append(s)
    return new_params, mom, new_res, codes, np.array(scales, F32)


@pytest.mark.parametrize(("fresh", "due", "share", "phase"), [
    (True, True, 1.0, 0.0),
    (True, False, 0.5, 0.0),
    (False, True, 0.5, 0.5),
    (False, False, 0.25, 0.5),
])  # fmt: skip
def test_the_fused_step_is_the_numpy_reference(fresh, due, share, phase):
    n, block, lr, beta = 3 * 256 + 40, 256, 0.7, 0.8
    params = host_vector(rand(n, 0))
    state = ChunkedStep(round_nesterov(lr, beta)).init(params)
    state.momentum[...] = rand(n, 1, 0.01)
    state.phase[...] = F32(phase)
    set_round_share(state, share)
    residual = new_residual(n)
    residual[...] = rand(n, 2, 1e-4)
    g = rand(n, 3, 0.01)
    expected = reference_step(
        params.copy(), state.momentum.copy(), residual.view(np.uint16).copy(), g, lr, beta,
        fresh, due, block,
    )  # fmt: skip
    publication = Downlink("int8").begin(params, residual)
    FusedNesterov.for_config("nesterov", lr, beta, 1, chunk=512).step(
        params, state, lambda lo, hi, out: np.copyto(out, g[lo:hi]), publication
    )
    frames = publication.frames()
    assert params.tobytes() == expected[0].tobytes()
    assert state.momentum.tobytes() == expected[1].tobytes()
    assert residual.view(np.uint16).tobytes() == expected[2].tobytes()
    # the frames decode (an independent decoder: the codec's) to exactly the applied update
    decoded = codec.decode(frames)["values"]
    step = F32(1.0 / 127)
    by_hand = expected[3].astype(F32) * np.repeat(expected[4] * step, block)[:n]
    assert decoded.tobytes() == by_hand.tobytes()
    assert float(state.phase) == (0.0 if due else float(F32(phase) + F32(share)))


@pytest.mark.parametrize("downlink", ["int8", "float32"])
@pytest.mark.parametrize("shares", [[1.0], [0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]])
def test_the_fused_step_is_the_jitted_step_bit_for_bit(downlink, shares):
    n, lr, beta = 5 * 1024 + 256 + 7, 0.7, 0.8
    link = Downlink(downlink)
    jitted = ChunkedStep(round_nesterov(lr, beta), chunk=1024, finish=link.finish)
    fused = FusedNesterov.for_config("nesterov", lr, beta, 1, chunk=2048)
    runs = []
    for kind in ("jit", "fused"):
        params = host_vector(rand(n, 0))
        state, residual, frames = jitted.init(params), new_residual(n), []
        for k in range(3 * len(shares)):
            g = rand(n, 10 + k, 0.01)
            set_round_share(state, shares[k % len(shares)])

            def fill(lo, hi, out, g=g):
                np.copyto(out, g[lo:hi])

            publication = link.begin(params, residual) if link.compressed else None
            if kind == "jit":
                sink = publication.apply if publication else None
                jitted.step(params, state, fill, sink, residual if publication else None)
            else:
                fused.step(params, state, fill, publication)
            if publication:
                frames.append(b"".join(bytes(f) for f in publication.frames()))
        runs.append((params.tobytes(), state.momentum.tobytes(), residual.tobytes(), frames))
    assert runs[0] == runs[1]


def test_the_compiled_mean_merge_is_its_numpy_pieces():
    n = 70_000 + 13
    deltas = []
    for k, block in enumerate((256, 128, 256)):
        frames, _ = codec.int8(block_size=block, zstd_level=None).encode({"v": rand(n, k)})
        deltas.append(read(frames)[0])
    sources = [deltas[0], scaled(deltas[1], 0.37), deltas[2]]
    weights = [0.5, 0.3, 0.2]
    compiled, plain = _MeanMerge(sources, weights), _MeanMerge(sources, weights)
    assert compiled._kernels is not None
    plain._kernels = None  # the numpy pieces
    for lo, hi in [(0, n), (1000, 66_000), (5, 7)]:
        a, b = np.empty(hi - lo, F32), np.empty(hi - lo, F32)
        compiled.fill(lo, hi, a)
        plain.fill(lo, hi, b)
        assert a.tobytes() == b.tobytes()
    # and by hand: each decoded value, times its clip factor, times its weight, summed in order
    full = [codec.decode(codec.int8(block_size=b, zstd_level=None).encode({"v": rand(n, k)})[0])
            ["v"] for k, b in enumerate((256, 128, 256))]  # fmt: skip
    by_hand = full[0] * F32(0.5) + (full[1] * F32(0.37)) * F32(0.3) + full[2] * F32(0.2)
    assert compiled.whole().tobytes() == by_hand.tobytes()


def test_a_non_finite_update_is_refused():
    n = 4096
    params = host_vector(rand(n, 0))
    state = ChunkedStep(round_nesterov(0.7, 0.8)).init(params)
    g = rand(n, 1)
    g[3000] = np.inf
    publication = Downlink("int8").begin(params, new_residual(n))
    fused = FusedNesterov.for_config("nesterov", 0.7, 0.8, 1, chunk=1024)
    with pytest.raises(DownlinkError, match=r"\[2048, 3072\)"):
        fused.step(params, state, lambda lo, hi, out: np.copyto(out, g[lo:hi]), publication)


@pytest.mark.parametrize("downlink", ["int8", "float32"])
def test_settings_per_step_are_the_jitted_rule_bit_for_bit(downlink):
    # lr and momentum change between steps (the quorum column of a new island count):
    # the fused loops take them as arguments, as the jitted rule does
    n = 5 * 1024 + 256 + 7
    schedule = [
        (0.7, 0.6, 1.0),
        (1.0, 0.3, 0.5),
        (1.0, 0.3, 0.5),
        (1.4, 0.0, 0.25),
        (0.7, 0.6, 1.0),
    ]
    link = Downlink(downlink)
    jitted = ChunkedStep(outer_rule("nesterov"), chunk=1024, finish=link.finish)
    fused = FusedNesterov.for_config("nesterov", 0.5, 0.9, 1, chunk=2048)  # built with others
    runs = []
    for kind in ("jit", "fused"):
        params = host_vector(rand(n, 0))
        state, residual, frames = jitted.init(params), new_residual(n), []
        for k, (lr, beta, share) in enumerate(schedule):
            g = rand(n, 10 + k, 0.01)
            set_round_share(state, share)

            def fill(lo, hi, out, g=g):
                np.copyto(out, g[lo:hi])

            publication = link.begin(params, residual) if link.compressed else None
            if kind == "jit":
                sink = publication.apply if publication else None
                carry = residual if publication else None
                jitted.step(params, state, fill, sink, carry, settings=(lr, beta))
            else:
                fused.step(params, state, fill, publication, settings=(lr, beta))
            if publication:
                frames.append(b"".join(bytes(f) for f in publication.frames()))
        runs.append((params.tobytes(), state.momentum.tobytes(), residual.tobytes(), frames))
    assert runs[0] == runs[1]
    # one compile per chunk length (1024 and the tail of 263), not per setting
    assert jitted._apply._cache_size() + jitted._updates._cache_size() == 2
