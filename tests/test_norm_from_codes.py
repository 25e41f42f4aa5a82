"""The norm of an int8 delta computed from its codes and block scales, against decoding by hand."""

from __future__ import annotations

import numpy as np
import pytest

import codec
from codec.coded import read_coded
from codec.quant import (
    COMPILED_MIN_ELEMENTS,
    sum_squares_float32,
    sum_squares_int8,
    sum_squares_int8_numpy,
)
from codec.quant_rule import step_factor
from paramserver.server.step.merge import ArrayDelta, sum_squares
from paramserver.server.step.weighting import l2_norm

pytestmark = pytest.mark.timeout(120)


def decoded_by_hand(codes: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray:
    """float32 value of each element: code * float32(scale * float32(1/127)), one block at a time."""
    out = np.empty(codes.shape[0], np.float32)
    step = np.float32(1.0 / 127.0)
    for j in range(scales.shape[0]):
        a, b = j * block, min((j + 1) * block, codes.shape[0])
        out[a:b] = codes[a:b].astype(np.float32) * np.float32(scales[j] * step)
    return out


def reference_sum_squares(codes, scales, block, lo, hi) -> float:
    values = decoded_by_hand(codes, scales, block)[lo:hi].astype(np.float64)
    return float(np.linalg.norm(values)) ** 2


def random_coded(n: int, block: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    codes = rng.integers(-128, 128, n, dtype=np.int8)  # -128 too: a client may send it
    scales = (rng.random(-(-n // block)) * 3.0).astype(np.float32)
    scales[::7] = 0.0  # flushed blocks
    return codes, scales


@pytest.mark.parametrize(
    "n, block, lo, hi",
    [
        (1, 256, 0, 1),
        (1000, 256, 0, 1000),  # a short last block
        (1000, 256, 13, 777),  # a range cutting blocks at both ends
        (1000, 256, 300, 300),  # empty
        (4096, 1, 5, 4000),
        (70_000, 70_000, 0, 70_000),  # a block longer than one integer run
        (COMPILED_MIN_ELEMENTS + 999, 256, 0, COMPILED_MIN_ELEMENTS + 999),  # the compiled loop
        (COMPILED_MIN_ELEMENTS + 999, 300, 17, COMPILED_MIN_ELEMENTS + 500),
    ],
)
def test_sum_squares_from_codes_matches_decoding(n, block, lo, hi):
    codes, scales = random_coded(n, block, seed=n + block + lo)
    expected = reference_sum_squares(codes, scales, block, lo, hi)
    got = sum_squares_int8(codes, scales, lo, hi, block)
    assert got == pytest.approx(expected, rel=1e-6, abs=0.0)
    # numpy and compiled formulations: the same bits on any host
    assert sum_squares_int8_numpy(codes, scales, lo, hi, block, step_factor(127)) == got


def test_l2_norm_of_a_coded_push_matches_its_decoded_norm():
    rng = np.random.default_rng(3)
    n = COMPILED_MIN_ELEMENTS * 2 + 123
    vec = (rng.standard_normal(n) * 0.01).astype(np.float32)
    vec[1000:1256] = 0  # a whole block of zeros
    frames, _ = codec.int8(block_size=256, zstd_level=None).encode({"delta": vec})
    (coded,) = read_coded(frames)
    decoded = codec.decode(frames)["delta"]
    expected = float(np.linalg.norm(decoded.astype(np.float64)))
    assert l2_norm(coded) == pytest.approx(expected, rel=1e-6)
    # the pieces' path (a decoded source) agrees
    assert l2_norm(coded) == pytest.approx(np.sqrt(sum_squares(ArrayDelta(decoded))), rel=1e-6)


def test_the_largest_scales_stay_finite_in_float64():
    codes = np.full(512, -128, np.int8)
    scales = np.full(2, np.float32(3e38), np.float32)
    expected = reference_sum_squares(codes, scales, 256, 0, 512)
    assert np.isfinite(expected)
    assert sum_squares_int8(codes, scales, 0, 512, 256) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("n", [0, 7, 1000, COMPILED_MIN_ELEMENTS + 13])
def test_float32_sum_squares_matches_numpy(n):
    values = np.random.default_rng(n).standard_normal(n).astype(np.float32) * 3
    expected = float(np.linalg.norm(values.astype(np.float64))) ** 2
    assert sum_squares_float32(values) == pytest.approx(expected, rel=1e-12)
    assert l2_norm(values) == pytest.approx(np.sqrt(expected), rel=1e-12)
