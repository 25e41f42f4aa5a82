"""codec.Codec.encode_decoded: the decoded values it returns are codec.decode's, bit for bit."""

import numpy as np
import pytest

import codec

pytestmark = pytest.mark.timeout(60)


def _tree(seed: int, dtype) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w": (rng.standard_normal((7, 37)) * 3).astype(dtype),  # 259: a partial last block
        "nested": {"b": rng.standard_normal(1).astype(dtype), "z": np.zeros(5, dtype)},
    }


def _leaves(tree, prefix=()):
    for key in sorted(tree):
        value = tree[key]
        if isinstance(value, dict):
            yield from _leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


@pytest.mark.parametrize("make", [codec.int8, codec.int4])
@pytest.mark.parametrize("zstd_level", [1, None])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_decoded_values_equal_decode_of_the_frames_bit_for_bit(make, zstd_level, dtype):
    c, reference = make(zstd_level=zstd_level), make(zstd_level=zstd_level)
    state, ref_state = c.init(_tree(0, dtype)), reference.init(_tree(0, dtype))
    for seed in range(3):  # error feedback carries residuals between encodes
        frames, state, decoded = c.encode_decoded(_tree(seed, dtype), state)
        ref_frames, ref_state = reference.encode(_tree(seed, dtype), ref_state)
        assert [bytes(f) for f in frames] == [bytes(f) for f in ref_frames]
        expected = dict(_leaves(codec.decode(frames)))
        got = dict(_leaves(decoded))
        assert got.keys() == expected.keys()
        for path, value in expected.items():
            assert got[path].dtype == value.dtype and got[path].shape == value.shape, path
            assert got[path].tobytes() == value.tobytes(), path


@pytest.mark.parametrize("c", [codec.raw("float32"), codec.topk()])
def test_schemes_without_blocks_are_refused_by_name(c):
    with pytest.raises(codec.CodecError, match="int8 or int4"):
        c.encode_decoded({"x": np.ones(8, np.float32)})
