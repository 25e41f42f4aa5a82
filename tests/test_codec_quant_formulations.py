"""The int8/int4 block rule's three formulations give the same bits: numpy, numba, JAX.

`codec.quant` defines the rule; its numpy kernels, the compiled numba loops
(`codec.quant.compiled_loops`, when numba is installed) and the traceable JAX
functions (`codec.quant.jax_rule`, used by the island's device exchange and the
shard's downlink) must agree on codes and scales, bit for bit, on awkward inputs (all
zeros, one huge value, subnormals, values around the flush threshold, ties,
short last blocks, odd int4 lengths), with and without an error-feedback
residual. Residuals agree too, but for subnormals, which XLA flushes to zero.
The decoded values the downlink applies are what `codec.decode` gives for the
frames its codes make (what `Codec.encode_decoded` used to promise).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import codec
from codec import quant
from codec.coded import frame_codes
from codec.quant import jax_rule, workspace

pytestmark = pytest.mark.timeout(300)

F32 = np.float32
SMALLEST_NORMAL = np.finfo(F32).tiny
CONFIGS = [(127, 256), (7, 64), (127, 100), (7, 6)]  # (levels, block)


def _inputs(block: int) -> dict[str, np.ndarray]:
    """Named awkward inputs (float32) for one block size."""
    rng = np.random.default_rng(block)
    n = 5 * block + 3  # a short last block (an odd count: int4's padded last nibble)
    huge = (rng.normal(size=n) * 1e-3).astype(F32)
    huge[block + 1] = F32(3.0e38)  # one huge value: the other codes of its block are 0
    huge[3 * block] = -np.finfo(F32).max
    subnormal = (rng.normal(size=n) * 1e-3).astype(F32)
    subnormal[:block] = rng.uniform(-1e-39, 1e-39, block).astype(F32)  # a block of subnormals
    subnormal[block : block + 8] = [1e-40, -3e-41, 1e-45, 0, 1e-39, -1e-39, 5e-42, 0]
    threshold = np.full(n, F32(2.0**-118), F32)  # blocks right at and around TINY
    threshold[block : 2 * block] = np.nextafter(F32(2.0**-118), F32(0))
    threshold[2 * block : 3 * block] = F32(2.0**-118) * rng.uniform(-1, 1, block).astype(F32)
    threshold[3 * block] = F32(2.0**-110)  # absmax well above TINY, the rest near it
    ties = np.zeros(n, F32)
    levels_tie = np.arange(n, dtype=F32) % 15 - F32(7)
    ties[:] = levels_tie + F32(0.5)  # x.5: round half to even
    ties[::block] = F32(127.0)  # absmax 127 (int8 scale 1)
    return {
        "zeros": np.zeros(n, F32),
        "random": (rng.normal(size=n) * 10.0 ** rng.integers(-4, 2)).astype(F32),
        "huge": huge,
        "subnormal": subnormal,
        "threshold": threshold,
        "ties": ties,
        "one": np.array([F32(-0.75)]),
        "three": np.array([F32(0.5), F32(-2.0), F32(1e-30)]),
        "block_plus_one": rng.normal(size=block + 1).astype(F32),
    }


def _flush_subnormals(x: np.ndarray) -> np.ndarray:
    return np.where(np.abs(x) < SMALLEST_NORMAL, F32(0), x).astype(F32)


def _outputs(n: int, levels: int, block: int) -> tuple[np.ndarray, ...]:
    codes = np.empty(n if levels == 127 else (n + 1) // 2, np.int8 if levels == 127 else np.uint8)
    return codes, np.empty(-(-n // block), F32), np.empty(n, F32)


def _numpy(x, res, levels, block):
    codes, scales, new_res = _outputs(x.shape[0], levels, block)
    quant.encode_numpy(x, res, new_res, codes, scales, levels, workspace(block))
    return codes, scales, new_res


def _numba(x, res, levels, block):
    pytest.importorskip("numba")  # numba is optional
    kernels = quant.compiled_loops
    codes, scales, new_res = _outputs(x.shape[0], levels, block)
    quant.encode_compiled(kernels, x, res, new_res, codes, scales, levels, workspace(block))
    return codes, scales, new_res


_JITTED: dict = {}


def _jax(x, res, levels, block):
    fn = _JITTED.get((levels, block))
    if fn is None:
        fn = _JITTED[levels, block] = jax.jit(lambda v, r: jax_rule.quantize(v + r, levels, block))
    r = np.zeros_like(x) if res is None else res
    return tuple(np.asarray(a) for a in fn(x, r))


def _same(name, got, want, levels, block):
    (gc, gs, gr), (wc, ws, wr) = got, want
    assert gc.dtype == wc.dtype and gc.tobytes() == wc.tobytes(), f"{name}: codes differ"
    assert gs.tobytes() == ws.tobytes(), f"{name}: scales differ"
    assert _flush_subnormals(gr).tobytes() == _flush_subnormals(wr).tobytes(), (
        f"{name}: residuals differ"
    )


@pytest.mark.parametrize(("levels", "block"), CONFIGS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_numpy_numba_and_jax_give_the_same_codes_scales_and_residuals(levels, block, with_residual):
    rng = np.random.default_rng(levels * block)
    for name, x in _inputs(block).items():
        res = None
        if with_residual:
            res = (rng.normal(size=x.shape[0]) * 1e-3).astype(F32)
        want = _numpy(x, res, levels, block)
        _same(f"numba {name}", _numba(x, res, levels, block), want, levels, block)
        _same(f"jax {name}", _jax(x, res, levels, block), want, levels, block)
        if with_residual:  # numpy and numba keep subnormals alike
            assert _numba(x, res, levels, block)[2].tobytes() == want[2].tobytes(), name


def _expected_by_hand(x: np.ndarray, levels: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Integer codes and block absmax of the rule, computed per block in float64 where exact."""
    codes, scales = [], []
    for a in range(0, x.shape[0], block):
        v = x[a : a + block]
        m = F32(np.max(np.abs(v)))
        m = F32(0) if m < F32(2.0**-118) else m
        inv = min(F32(levels) / m if m else F32(np.inf), F32(levels / 2.0**-118))
        codes.append(np.rint(v * F32(inv)))
        scales.append(m)
    return np.concatenate(codes), np.array(scales, F32)


@pytest.mark.parametrize(("levels", "block"), CONFIGS)
def test_the_codes_are_the_rule_computed_by_hand_int4_packed_low_nibble_first(levels, block):
    x = _inputs(block)["ties"]
    q, m = _expected_by_hand(x, levels, block)
    codes, scales, _ = _jax(x, None, levels, block)
    assert scales.tobytes() == m.tobytes()
    if levels == 127:
        assert np.array_equal(codes, q.astype(np.int8))
    else:
        nibbles = np.append(q, 0).astype(np.int64)[: 2 * codes.shape[0]] + 8
        assert np.array_equal(codes, (nibbles[0::2] | nibbles[1::2] << 4).astype(np.uint8))
        assert codes[-1] >> 4 == 8  # an odd count pads the last high nibble with q = 0


@pytest.mark.parametrize(("levels", "block"), CONFIGS)
def test_a_non_finite_block_gets_a_non_finite_scale_in_every_formulation(levels, block):
    x = np.ones(3 * block, F32)
    x[block + 2] = np.nan
    x[2 * block] = np.inf
    for fn in (_numpy, _numba, _jax):
        with np.errstate(invalid="ignore"):  # NaN codes, as the codec's encode computes them
            _, scales, _ = fn(x, None, levels, block)
        assert scales[0] == 1 and not np.isfinite(scales[1:]).any(), fn.__name__


@pytest.mark.parametrize(("levels", "block"), CONFIGS)
@pytest.mark.parametrize("zstd_level", [1, None])
def test_jax_decoded_values_are_codec_decode_of_the_frames_its_codes_make(
    levels, block, zstd_level
):
    # the downlink applies `decoded` to the shard's parameters and publishes the frames
    scheme = "int8" if levels == 127 else "int4"
    encode = jax.jit(lambda v: jax_rule.encode(v, levels, block))
    for name, x in _inputs(block).items():
        codes, scales, decoded, residual = (np.asarray(a) for a in encode(x))
        frames = frame_codes(scheme, block, zstd_level, codes, scales, x.shape[0], "values")
        want, _ = getattr(codec, scheme)(block_size=block, zstd_level=zstd_level).encode(
            {"values": x}
        )
        assert [bytes(f) for f in frames] == [bytes(f) for f in want], name
        values = codec.decode(frames)["values"]
        assert decoded.tobytes() == values.tobytes(), name
        dequantize = functools.partial(
            jax_rule.dequantize, n=x.shape[0], levels=levels, block=block
        )
        dequantized = jax.jit(dequantize)(codes, scales)
        assert np.asarray(dequantized).tobytes() == values.tobytes(), name
        expected = _flush_subnormals(np.subtract(x, values, dtype=F32))
        assert _flush_subnormals(residual).tobytes() == expected.tobytes(), name


@pytest.mark.parametrize(("levels", "block"), CONFIGS)
def test_an_all_zero_block_quantizes_without_a_numpy_warning(levels, block):
    """Frozen parameters give all-zero delta blocks: scale 0, codes 0, and no
    "divide by zero" RuntimeWarning in the island's own process."""
    x = np.zeros(3 * block, F32)
    x[block : 2 * block] = 0.5  # one block of values between two zero blocks
    with np.errstate(all="raise"):  # a warning numpy would print becomes an error here
        codes, scales, _ = _numpy(x, None, levels, block)
    assert scales[0] == 0 and scales[2] == 0 and scales[1] == F32(0.5)
    per_byte, zero = (1, 0) if levels == 127 else (2, 0x88)  # int4: two codes a byte, +8 each
    edge = block // per_byte  # both CONFIGS blocks are even: no byte spans two blocks
    assert np.all(codes[:edge] == zero) and np.all(codes[2 * edge :] == zero)
