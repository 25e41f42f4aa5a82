"""The sparse top-k scheme: what it keeps, how it quantizes, error feedback, and
its settings. Expected values come from a per-chunk reference written here
with plain Python loops, never from the codec."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import codec

FAST = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
F32 = np.float32
TINY = 2.0**-118


def reference(x: np.ndarray, density: float, bits: int, chunk: int) -> np.ndarray:
    """Decoded values of one topk round, chunk by chunk in float32 scalar arithmetic."""
    x = np.asarray(x, F32).ravel()
    keep = min(chunk, max(1, math.ceil(density * chunk)))
    levels = 2 ** (bits - 1)
    out = np.zeros(x.size, F32)
    for start in range(0, x.size, chunk):
        part = x[start : start + chunk]
        k = -(-keep * part.size // chunk)
        # largest magnitude first; ties broken by position (stable sort)
        order = sorted(range(part.size), key=lambda i: (-abs(float(part[i])), i))
        m = F32(max(abs(float(v)) for v in part))
        if m < TINY:
            m = F32(0)
        for i in order[:k]:
            v = part[i]
            inv = F32(levels) / m if m > 0 else F32(levels / TINY)
            j = min(math.floor(F32(abs(v)) * inv), levels - 1)
            value = F32(2 * j + 1) * (m * F32(1 / (2 * levels)))
            out[start + i] = -value if np.signbit(v) else value
    return out


vectors = hnp.arrays(
    F32,
    st.integers(0, 300),
    elements=st.one_of(
        st.floats(-1, 1, width=32),
        st.sampled_from([0.0, 0.5, -0.5, 1e-39, 3e30]),  # ties, zeros, tiny and huge values
    ),
)


@pytest.mark.timeout(120)
@FAST
@given(
    x=vectors,
    density=st.sampled_from([0.02, 0.1, 0.25, 0.5, 1.0]),
    bits=st.sampled_from([2, 4]),
    chunk=st.sampled_from([2, 7, 16, 64, 4096]),
)
def test_decoded_values_are_the_quantized_kept_entries(x, density, bits, chunk):
    c = codec.topk(density=density, bits=bits, chunk=chunk)
    frames, _ = c.encode({"x": x})
    y = codec.decode(frames)["x"]
    assert y.dtype == np.float32 and y.shape == x.shape
    expected = reference(x, density, bits, chunk)
    assert np.array_equal(y, expected), np.flatnonzero(y != expected)[:10]


def test_hand_computed_chunk():
    # chunk 8, density 0.25 -> 2 kept; 2 bits: levels (2j+1)/4 * absmax
    x = np.array([0.1, -4.0, 0.3, 0.2, 1.0, -0.1, 0.0, 0.05], F32)
    frames, _ = codec.topk(density=0.25, bits=2, chunk=8).encode({"x": x})
    y = codec.decode(frames)["x"]
    # kept: -4.0 (j = 1 -> -3) and 1.0 (|1| * 2/4 = 0.5 -> j = 0 -> 1)
    assert y.tolist() == [0, -3.0, 0, 0, 1.0, 0, 0, 0]
    frames, _ = codec.topk(density=0.25, bits=4, chunk=8).encode({"x": x})
    # 4 bits: levels (2j+1)/16 * 4; 1.0 * 8/4 = 2 -> j = 2 -> 5/4; -4 -> j = 7 -> -15/4
    assert codec.decode(frames)["x"].tolist() == [0, -3.75, 0, 0, 1.25, 0, 0, 0]


def test_short_last_chunk_keeps_its_share():
    x = np.arange(1, 11, dtype=F32)  # chunk 8 keeps 2; last chunk of 2 keeps ceil(2*2/8) = 1
    y = codec.decode(codec.topk(density=0.25, chunk=8).encode({"x": x})[0])["x"]
    assert np.flatnonzero(y).tolist() == [6, 7, 9]


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("zstd_level", [1, None])
def test_error_feedback_invariant_over_rounds(bits, zstd_level):
    rng = np.random.default_rng(3)
    rounds = [
        {"w": (rng.standard_t(3, (70, 130)) * 1e-3).astype(F32), "b": rng.standard_normal(9, F32)}
        for _ in range(20)
    ]
    c = codec.topk(density=0.05, bits=bits, chunk=512, zstd_level=zstd_level)
    state = c.init(rounds[0])
    decoded = {k: np.zeros(v.shape) for k, v in rounds[0].items()}
    truth = {k: np.zeros(v.shape) for k, v in rounds[0].items()}
    for tree in rounds:
        frames, state = c.encode(tree, state)
        out = codec.decode(codec.split(codec.join(frames)))
        for k in tree:
            decoded[k] += out[k]
            truth[k] += tree[k]
    residual = state.residual_tree()
    for k in truth:
        scale = np.abs(truth[k]).max()
        assert np.allclose(decoded[k] + residual[k], truth[k], rtol=0, atol=1e-5 * scale), k


def test_residual_is_input_plus_old_residual_minus_decoded_exactly():
    rng = np.random.default_rng(4)
    x1, x2 = (rng.standard_normal(5000).astype(F32) for _ in range(2))
    c = codec.topk(density=0.03, chunk=256)
    _, state = c.encode({"x": x1}, c.init({"x": x1}))
    r1 = state.residual_tree()["x"].copy()
    frames, state = c.encode({"x": x2}, state)
    expected = (x2 + r1) - codec.decode(frames)["x"]
    assert np.array_equal(state.residual_tree()["x"], expected)


def test_ef_decay_scales_the_old_residual_by_hand():
    # chunk 4, density 0.25 -> 1 kept; 2 bits: decoded (2j+1)/4 * absmax
    c = codec.topk(density=0.25, bits=2, chunk=4, ef_decay=0.5)
    x1 = np.array([1.0, 0.5, -0.25, 0.0], F32)
    frames, state = c.encode({"x": x1}, c.init({"x": x1}))
    # keeps 1.0 (m 1, j = min(floor(1 * 2/1), 1) = 1 -> 3/4); nothing old to decay yet
    assert codec.decode(frames)["x"].tolist() == [0.75, 0, 0, 0]
    assert state.residual_tree()["x"].tolist() == [0.25, 0.5, -0.25, 0.0]
    x2 = np.array([0.0, 0.0, 0.0, 0.5], F32)
    frames, state = c.encode({"x": x2}, state)
    # selects from x2 + 0.5 * [0.25, 0.5, -0.25, 0] = [0.125, 0.25, -0.125, 0.5]:
    # keeps 0.5 (m 0.5, j = 1 -> 3/4 * 0.5 = 0.375), the rest stays decayed
    assert codec.decode(frames)["x"].tolist() == [0, 0, 0, 0.375]
    assert state.residual_tree()["x"].tolist() == [0.125, 0.25, -0.125, 0.125]


def test_ef_decay_one_is_the_plain_error_feedback_bit_for_bit():
    rng = np.random.default_rng(8)
    rounds = [(rng.standard_t(3, 3000) * 1e-3).astype(F32) for _ in range(3)]
    plain, one = (
        codec.topk(density=0.05, chunk=256),
        codec.topk(density=0.05, chunk=256, ef_decay=1),
    )
    s_plain, s_one = plain.init({"d": rounds[0]}), one.init({"d": rounds[0]})
    for d in rounds:
        f_plain, s_plain = plain.encode({"d": d}, s_plain)
        f_one, s_one = one.encode({"d": d}, s_one)
        assert [bytes(f) for f in f_plain] == [bytes(f) for f in f_one]
        assert np.array_equal(s_plain.residuals[0], s_one.residuals[0])
    assert one.ef_decay == 1.0 and "ef_decay=1.0" in repr(one)


def test_error_feedback_beats_no_feedback_and_ratio():
    rng = np.random.default_rng(5)
    rounds = [(rng.standard_t(3, 1 << 16) * 1e-3).astype(F32) for _ in range(30)]
    truth = np.sum(rounds, axis=0, dtype=np.float64)

    def accumulated(feedback):
        c = codec.topk()
        state = c.init({"d": rounds[0]}) if feedback else None
        total, nbytes = np.zeros_like(truth), 0
        for d in rounds:
            frames, state = c.encode({"d": d}, state)
            nbytes += sum(len(f) for f in frames)
            total += codec.decode(frames)["d"]
        return np.linalg.norm(total - truth) / np.linalg.norm(truth), nbytes

    with_ef, nbytes = accumulated(True)
    without, _ = accumulated(False)
    assert with_ef < 0.75 * without, (with_ef, without)
    ratio = 4 * truth.size * len(rounds) / nbytes
    assert ratio > 60, ratio


def test_large_tensor_over_several_frames_and_threads(monkeypatch):
    monkeypatch.setattr(codec.format, "FRAME_BYTES", 1 << 12)
    x = np.random.default_rng(6).standard_normal(300_000).astype(F32)
    one = codec.topk(density=0.05, chunk=1024).encode({"x": x})[0]
    two = codec.topk(density=0.05, chunk=1024, zstd_threads=2).encode({"x": x})[0]
    assert len(one) > 3 and [bytes(f) for f in one] == [bytes(f) for f in two]
    assert np.array_equal(codec.decode(one, threads=2)["x"], reference(x, 0.05, 2, 1024))


@pytest.mark.parametrize(
    "kwargs, text",
    [
        ({"density": 0}, "density.*0"),
        ({"density": 1.5}, "density.*1.5"),
        ({"density": -0.1}, "density.*-0.1"),
        ({"density": float("nan")}, "density.*nan"),
        ({"density": "0.1"}, "density.*'0.1'"),
        ({"bits": 3}, "bits must be 2 or 4, got 3"),
        ({"bits": 2.0}, "bits.*2.0"),
        ({"chunk": 1 << 17}, "chunk.*131072"),
        ({"chunk": 0}, "chunk.*0"),
        ({"zstd_threads": -1}, "zstd_threads.*-1"),
        ({"ef_decay": 0}, "ef_decay.*0"),
        ({"ef_decay": -0.5}, "ef_decay.*-0.5"),
        ({"ef_decay": 1.01}, "ef_decay.*1.01"),
        ({"ef_decay": float("nan")}, "ef_decay.*nan"),
        ({"ef_decay": "0.95"}, "ef_decay.*'0.95'"),
        ({"ef_decay": True}, "ef_decay.*True"),
    ],
)
def test_bad_settings_name_the_value(kwargs, text):
    with pytest.raises(codec.CodecError, match=text):
        codec.topk(**kwargs)
    assert issubclass(codec.CodecError, ValueError)


def test_density_one_sends_everything_and_repr():
    x = np.random.default_rng(7).standard_normal(100).astype(F32)
    y = codec.decode(codec.topk(density=1.0, bits=4).encode({"x": x})[0])["x"]
    assert np.count_nonzero(y) == 100 and (np.sign(y) == np.sign(x)).all()
    assert "density=0.02, bits=2, chunk=4096" in repr(codec.topk())
