"""decode(frames, out=tree): every scheme decodes into the caller's arrays, checked first."""

import numpy as np
import pytest
from codec_helpers import SCHEMES, fuzz_tree

import codec


def empty_like(tree: dict) -> dict:
    return codec.unflatten({k: np.full_like(v, np.nan) for k, v in codec.flatten(tree).items()})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", SCHEMES)
def test_decode_into_out_equals_decode_and_returns_the_callers_arrays(name):
    c = SCHEMES[name]()
    tree = fuzz_tree()
    state = c.init(tree)
    out = empty_like(tree)
    for _ in range(2):  # the second round reuses the arrays
        frames, state = c.encode(tree, state)
        want = codec.flatten(codec.decode(frames))
        got = codec.flatten(codec.decode(frames, out=out, threads=2))
        for path, arr in codec.flatten(out).items():
            assert got[path] is arr, path
            assert arr.tobytes() == want[path].tobytes(), path


@pytest.mark.timeout(60)
def test_out_that_does_not_fit_the_message_is_refused_before_decoding():
    c = codec.int8()
    tree = fuzz_tree()
    frames, _ = c.encode(tree)
    good = empty_like(tree)
    flat = codec.flatten(good)
    cases = {
        "differs at b/bias": {k: v for k, v in flat.items() if k != "b/bias"},
        "'w' is (30, 40) float32": {**flat, "w": np.zeros((30, 40), np.float32)},
        "'w' is (40, 30) float64": {**flat, "w": np.zeros((40, 30), np.float64)},
        "'w' must be a writable": {**flat, "w": np.zeros((30, 40), np.float32).T},
        "differs at zz": {**flat, "zz": np.zeros(3, np.float32)},
    }
    readonly = np.zeros((40, 30), np.float32)
    readonly.flags.writeable = False
    cases["'w' must be a writable C-contiguous"] = {**flat, "w": readonly}
    for message, bad in cases.items():
        with pytest.raises(codec.CodecError, match=message.replace("(", r"\(").replace(")", r"\)")):
            codec.decode(frames, out=codec.unflatten(bad))
    assert np.isnan(flat["w"]).all()  # nothing was written into the refused trees' arrays


@pytest.mark.timeout(60)
def test_a_second_zstd_frame_behind_the_first_is_refused():
    # a frame that is a valid zstd frame followed by another one (same checksum at the end,
    # header adjusted to the longer wire length) must not decode as if the tail were absent
    c = codec.int8()
    frames, _ = c.encode({"x": np.linspace(-1, 1, 1000, dtype=np.float32)})
    header = codec.format.parse_header(memoryview(frames[0]), 1, 1 << 20)
    ((raw_len, wire_len, check),) = header.frames
    forged = codec.format.pack_header(
        "int8", header.block, None, True, header.tensors, header.total,
        [[raw_len, 2 * wire_len, check]],
    )  # fmt: skip
    assert len(codec.decode([frames[0], frames[1]])["x"]) == 1000
    with pytest.raises(codec.CodecError, match="frame 1 does not decompress: data after"):
        codec.decode([forged, bytes(frames[1]) * 2])
