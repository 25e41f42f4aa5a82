"""Frames and error-feedback residuals pinned bit for bit.

Two independent pins: (1) sha256 digests of the frames and residuals that the
codec wrote before its kernels were compiled (numpy, 2026-12-01), for every
scheme over inputs that reach each corner (partial blocks, odd int4 tails,
all-zero and sub-TINY blocks, huge values, float16 and bfloat16 inputs, three
rounds of error feedback); (2) a plain numpy reference of the block-absmax
rule, one whole-array float32 operation at a time, against the payload and
the residuals of int8 and int4. Both run on the compiled kernels and on the
numpy ones the codec falls back to without numba. zstd frames are checked to
hold exactly the uncompressed payload (their bytes depend on the zstd
library's version).
"""

import hashlib

import ml_dtypes
import numpy as np
import pytest
import zstandard

import codec
from codec import format as fmt
from codec import quant

F32 = np.float32
TINY = F32(2.0**-118)


def inputs(round_: int) -> dict:
    """A tree reaching the corners of the block kernels; different values each round."""
    rng = np.random.default_rng(100 + round_)
    big = (rng.standard_t(3, 300_001) * 1e-3).astype(F32)  # several pieces and frames
    big[1000:1512] = 0  # all-zero blocks
    big[4096:4352] *= F32(1e-37)  # blocks below TINY
    big[9000] = F32(1e36)  # a huge value in one block
    return {
        "big": big,
        "odd": (rng.standard_normal(777) * 0.1).astype(F32),  # partial block, odd int4 tail
        "half": (rng.standard_normal((33, 7)) * 2).astype(np.float16),
        "bf": {"w": (rng.standard_normal(515) * 1e-2).astype(ml_dtypes.bfloat16)},
        "one": F32(-0.5).reshape(()),
    }


CODECS = {
    "int8": lambda z: codec.int8(zstd_level=z),
    "int8-b64": lambda z: codec.int8(block_size=64, zstd_level=z),
    "int8-b1000": lambda z: codec.int8(block_size=1000, zstd_level=z),
    "int8-stochastic": lambda z: codec.int8(stochastic=True, seed=3, zstd_level=z),
    "int8-threads": lambda z: codec.int8(zstd_level=z, zstd_threads=2),
    "int4": lambda z: codec.int4(zstd_level=z),
    "int4-b2": lambda z: codec.int4(block_size=2, zstd_level=z),
    "int4-stochastic": lambda z: codec.int4(stochastic=True, seed=3, zstd_level=z),
    "topk": lambda z: codec.topk(zstd_level=z),
    "topk-4bit": lambda z: codec.topk(density=0.1, bits=4, chunk=64, zstd_level=z),
    "raw-fp32": lambda z: codec.raw("float32", zstd_level=z),
    "raw-bf16": lambda z: codec.raw("bfloat16", zstd_level=z),
}

# sha256 of digest_rounds(CODECS[name](None)) as written by the numpy kernels
PINNED = {
    "int8": "6ad6c4aa409699faa2ad6c6354494fc8a948b0d6eea22be6366dcf092b3e2449",
    "int8-b64": "c635e94882ce3aa5f8acd7b6fbeadce99b653f2cf8cf6134a9fbf8b3a274527d",
    "int8-b1000": "7684f1c9398fcfe6626c609be98285ea35416b0720efcf8bd7379a8c781b5237",
    "int8-stochastic": "1395f712a326f724ee8b8c9faf45fd917a96a427da968cdcd81501b59cf18911",
    "int8-threads": "6ad6c4aa409699faa2ad6c6354494fc8a948b0d6eea22be6366dcf092b3e2449",
    "int4": "a5fa09391fce9d4b5e5bf78bf7cf62af495b6826d8fcb07073509705d0239fe3",
    "int4-b2": "403082c0ad95f750c40f1c6fce0f48848c563f44f43c5ea9bbe6ee8c15672371",
    "int4-stochastic": "7d6f5e7933ed15fd584aa2bd0045ce86655df7d8990dccf33723b09108aa5b84",
    "topk": "8e5972d72404ac65fad4571e5215aef821f55853cc7f12f4abb5ea8992bd1da6",
    "topk-4bit": "f2fbf0f2748cb55619f77f566495583a7292ad5fcaae1719eb811e29bf18bdd1",
    "raw-fp32": "f3f8e0777ff653c961b4d8488024d28ececfbd9118a27a212506053e67d911fd",
    "raw-bf16": "41a06dfb2a537d11d0acc052a058c727da9f6739bce69569dab33744bb590fe2",
}


@pytest.fixture(params=["compiled", "numpy"])
def backend(request, monkeypatch):
    """Run a test on the compiled kernels (for every size), then on the numpy ones."""
    if request.param == "numpy":
        monkeypatch.setattr(quant, "_loops", lambda: None)
    else:
        assert quant._loops() is not None, "numba (the fast extra, installed by ./dev) must import"
        monkeypatch.setattr(quant, "COMPILED_MIN_ELEMENTS", 1)
    return request.param


def digest_rounds(c) -> str:
    """sha256 over three rounds with error feedback and one without: frames, residuals, decode."""
    h = hashlib.sha256()
    state = c.init(inputs(0))
    for r in range(4):
        frames, state = c.encode(inputs(r), state if r < 3 else None)
        for f in frames:
            h.update(bytes(f))
        for res in state.residuals if r < 3 else ():
            h.update(res.tobytes())
        for path, out in sorted(codec.flatten(codec.decode(frames)).items()):
            h.update(path.encode() + out.tobytes())
    return h.hexdigest()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", CODECS)
def test_frames_and_residuals_match_the_pinned_digest(name, backend):
    assert digest_rounds(CODECS[name](None)) == PINNED[name]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["int8", "int4-stochastic", "topk", "raw-bf16", "int8-threads"])
def test_zstd_frames_hold_exactly_the_uncompressed_payload(name):
    plain, zstd = CODECS[name](None), CODECS[name](1)
    s_plain, s_zstd = plain.init(inputs(0)), zstd.init(inputs(0))
    for r in range(2):
        f_plain, s_plain = plain.encode(inputs(r), s_plain)
        f_zstd, s_zstd = zstd.encode(inputs(r), s_zstd)
        assert len(f_plain) == len(f_zstd)
        for a, b in zip(f_plain[1:], f_zstd[1:], strict=True):
            assert zstandard.ZstdDecompressor().decompress(bytes(b)) == bytes(a)
        for a, b in zip(s_plain.residuals, s_zstd.residuals, strict=True):
            assert a.tobytes() == b.tobytes()


def reference_blocks(v: np.ndarray, levels: int, block: int):
    """Block-absmax quantize of float32 `v`, whole array at a time: (q, scales, residual)."""
    n = v.shape[0]
    nbk = -(-n // block)
    pad = np.zeros(nbk * block, F32)
    pad[:n] = v
    rows = pad.reshape(nbk, block)
    m = np.abs(rows).max(axis=1)
    m = np.where(m < TINY, F32(0), m).astype(F32)
    with np.errstate(divide="ignore"):
        inv = np.minimum(F32(levels) / m, F32(levels / float(TINY)))
    q = np.rint(rows * inv[:, None])
    step = (m * F32(1.0 / levels))[:, None]
    residual = (rows - q * step).reshape(-1)[:n]
    return q.reshape(-1), m, residual


def reference_message(c, tree, header, residuals):
    """Payload, new residuals and decoded values of a block codec, from reference_blocks."""
    levels = fmt.LEVELS[c.scheme]
    leaves = codec.flatten(tree)
    payload = np.zeros(header.total, np.uint8)
    new, decoded = [], {}
    for t, res in zip(header.tensors, residuals, strict=True):
        x = np.asarray(leaves["/".join(t.path)])
        q, m, r = reference_blocks(x.reshape(-1).astype(F32) + res, levels, c.block_size)
        if levels == 7:  # low nibble first, codes offset by 8; block sizes are even
            u = (q.astype(np.int64) + 8).astype(np.uint8)
            codes = (u[0::2] | (u[1::2] << 4))[: t.codes_bytes]
        else:
            codes = q.astype(np.int8).view(np.uint8)[: t.size]
        payload[t.offset : t.offset + t.codes_bytes] = codes
        payload[t.scales_offset : t.end] = m.view(np.uint8)
        new.append(r)
        step = np.repeat(m * F32(1.0 / levels), c.block_size)
        value = q.astype(np.int8).astype(F32) * step  # from the integer codes: no -0.0
        decoded["/".join(t.path)] = value[: t.size].astype(x.dtype).reshape(x.shape)
    return payload, new, decoded


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["int8", "int8-b64", "int8-b1000", "int4", "int4-b2"])
def test_block_payload_residual_and_decode_equal_a_plain_numpy_reference(name, backend):
    c = CODECS[name](None)
    state = c.init(inputs(0))
    for r in range(3):
        tree = inputs(r)
        old = [res.copy() for res in state.residuals]
        frames, state = c.encode(tree, state)
        header = fmt.parse_header(memoryview(frames[0]), len(frames) - 1, 1 << 30)
        want, want_res, want_out = reference_message(c, tree, header, old)
        got = np.frombuffer(b"".join(bytes(f) for f in frames[1:]), np.uint8)
        assert np.array_equal(got, want), f"round {r}: payload differs"
        for a, b in zip(state.residuals, want_res, strict=True):
            assert a.tobytes() == b.tobytes(), f"round {r}: residual differs"
        out = codec.flatten(codec.decode(frames))
        for path, v in want_out.items():
            assert out[path].dtype == v.dtype and out[path].tobytes() == v.tobytes(), path


@pytest.mark.timeout(120)
def test_large_block_tensors_run_the_compiled_kernels_and_small_ones_numpy(monkeypatch):
    kernels = quant.compiled_loops

    calls = {"quantize": 0, "dequantize": 0}

    class Counting:
        def __getattr__(self, name):
            def call(*args):
                calls[name] += 1
                return getattr(kernels, name)(*args)

            return call

    monkeypatch.setattr(quant, "_loops", lambda: Counting())
    c = codec.int8()
    small = {"x": np.ones(quant.COMPILED_MIN_ELEMENTS - 1, F32)}
    codec.decode(c.encode(small)[0])
    assert calls == {"quantize": 0, "dequantize": 0}
    big = {"x": np.linspace(-1, 1, quant.COMPILED_MIN_ELEMENTS, dtype=F32)}
    frames, _ = c.encode(big)
    assert np.abs(codec.decode(frames)["x"] - big["x"]).max() < 1 / 127
    assert calls == {"quantize": 1, "dequantize": 1}
