"""Fuzzing `codec.decode` with one table of codecs (dense and topk) through one set of
checks: a valid message decodes within the codec's error bound; damaged, forged or
random frames are refused with CodecError (nothing else) or decode to a checked tree of
finite arrays; specific damage must raise CodecError."""

import random

import msgpack
import numpy as np
import pytest
import zstandard
from codec_helpers import checked_decode, fuzz_tree, mutate

import codec
from codec import format as fmt

# One row per codec variant; every fuzz test below runs over all of them.
FUZZ_CODECS = {
    "int8-b64": lambda: codec.int8(block_size=64),
    "int8-nozstd": lambda: codec.int8(zstd_level=None),
    "int4-b16": lambda: codec.int4(block_size=16),
    "raw-fp32": lambda: codec.raw("float32"),
    "raw-bf16-zstd3": lambda: codec.raw("bfloat16", zstd_level=3),
    "topk-d0.1-chunk64": lambda: codec.topk(density=0.1, chunk=64),
    "topk-4bit-chunk100-nozstd": lambda: codec.topk(
        density=0.2, bits=4, chunk=100, zstd_level=None
    ),
    "topk-d0.5-chunk16-threads": lambda: codec.topk(density=0.5, chunk=16, zstd_threads=2),
}
MUTATIONS = 500  # per codec
HEADER_MUTATIONS = 300  # per codec
# values a forged header field may take (topk's settings and schemes among them)
HEADER_VALUES = [None, -1, 0, 1, 2, 3, 4, 2**16, 2**16 + 1, 2**40, 2**64 - 1, 3.5, "x", b"x"]
HEADER_VALUES += ["int8", "topk", [], [1, 2], {"a": 1}, True]


@pytest.fixture(params=sorted(FUZZ_CODECS))
def encoded(request, monkeypatch):
    """(codec, tree, frames): the fuzz tree encoded with small frames (several payload frames)."""
    monkeypatch.setattr(fmt, "FRAME_BYTES", 128)
    c = FUZZ_CODECS[request.param]()
    tree = fuzz_tree()
    frames, _ = c.encode(tree, c.init(tree))
    assert len(frames) >= 3
    return c, tree, [bytes(f) for f in frames]


def repack(header: bytes, **changes) -> bytes:
    obj = msgpack.unpackb(header)
    obj.update(changes)
    return msgpack.packb(obj)


def forge_header(rnd: random.Random, header: bytes) -> bytes:
    """The header with one field (or one entry of a tensor or frame record) replaced."""
    obj = msgpack.unpackb(header)
    key = rnd.choice([*obj, "keep", "bits", "block", "scheme", "payload"])
    if key in ("tensors", "frames") and obj[key] and rnd.random() < 0.7:
        entry = rnd.choice(obj[key])
        extra = [[2**40], [-1], ["a", 1]] if key == "tensors" else []
        entry[rnd.randrange(len(entry))] = rnd.choice(HEADER_VALUES + extra)
    else:
        obj[key] = rnd.choice(HEADER_VALUES)
    return msgpack.packb(obj)


def assert_same_tree(got: dict, want: dict) -> None:
    got, want = codec.flatten(got), codec.flatten(want)
    assert sorted(got) == sorted(want)
    for path, x in want.items():
        assert got[path].dtype == x.dtype and np.array_equal(got[path], x), path


def test_valid_messages_decode_within_the_error_bound(encoded):
    c, tree, frames = encoded
    assert checked_decode(frames, c, tree) is not None


@pytest.mark.timeout(60)
def test_mutated_frames_are_refused_or_decode_to_the_clean_message(encoded):
    c, tree, frames = encoded
    clean = checked_decode(frames, c, tree)
    rnd = random.Random(f"mutate {c!r}")
    decoded = 0
    for _ in range(MUTATIONS):
        damaged = mutate(rnd, frames)
        got = checked_decode(damaged)
        if got is not None:
            decoded += 1
            if damaged[0] == frames[0]:  # the payload is checksummed: only itself decodes
                assert_same_tree(got, clean)
    assert decoded < MUTATIONS // 10  # almost all damage is detected


@pytest.mark.timeout(60)
def test_forged_header_fields_are_refused_or_decode_to_finite_arrays(encoded):
    c, _, frames = encoded
    rnd = random.Random(f"header {c!r}")
    for _ in range(HEADER_MUTATIONS):
        checked_decode([forge_header(rnd, frames[0]), *frames[1:]])


@pytest.mark.timeout(60)
def test_random_frames_are_refused_with_codec_error():
    rnd = random.Random(99)
    for _ in range(1000):
        frames = [rnd.randbytes(rnd.randrange(40)) for _ in range(rnd.randrange(4))]
        if rnd.random() < 0.5 and frames:
            frames[0] = msgpack.packb({"magic": "ddcodec", "version": 1, **{"x": rnd.random()}})
        assert checked_decode(frames) is None


def test_specific_damage_is_detected(encoded):
    c, tree, frames = encoded
    header = frames[0]
    for bad in [
        frames[:-1],  # dropped frame
        [frames[0], *frames[1:][::-1]],  # reordered payload
        [*frames[:-1], frames[-1][:-1]],  # truncated frame
        [frames[0], frames[1], *frames[1:]],  # duplicated frame
        [frames[1], frames[0], *frames[2:]],  # header not first
        [],
        "not frames",
    ]:
        assert checked_decode(bad) is None
    with pytest.raises(codec.CodecError, match="version"):
        codec.decode([repack(header, version=2), *frames[1:]])
    # unknown header fields are ignored
    assert checked_decode([repack(header, future_field=[1, 2]), *frames[1:]], c, tree) is not None


def test_huge_declared_sizes_are_refused_before_allocating():
    x = np.ones(1000, np.float32)
    frames, _ = codec.int8().encode({"x": x})
    obj = msgpack.unpackb(frames[0])
    obj["tensors"][0][1] = [2**40, 2**30]
    with pytest.raises(codec.CodecError, match="max_elements"):
        codec.decode([msgpack.packb(obj), *frames[1:]])
    with pytest.raises(codec.CodecError, match="max_elements"):
        codec.decode(frames, max_elements=999)
    assert codec.decode(frames, max_elements=1000)["x"].shape == (1000,)


def test_zstd_bomb_is_refused():
    x = np.ones(1000, np.float32)
    frames, _ = codec.int8().encode({"x": x})
    bomb = zstandard.ZstdCompressor(write_checksum=True).compress(bytes(1 << 24))
    obj = msgpack.unpackb(frames[0])
    obj["frames"][0][1] = len(bomb)
    obj["frames"][0][2] = int.from_bytes(bomb[-4:], "little")
    with pytest.raises(codec.CodecError, match="declares size"):
        codec.decode([msgpack.packb(obj), bomb])
    unsized = zstandard.ZstdCompressor(write_checksum=True, write_content_size=False)
    quiet = unsized.compress(bytes(1 << 24))
    obj["frames"][0][1:] = [len(quiet), int.from_bytes(quiet[-4:], "little")]
    with pytest.raises(codec.CodecError):
        codec.decode([msgpack.packb(obj), quiet])


def test_corrupted_scale_is_refused():
    frames, _ = codec.int8(zstd_level=None).encode({"x": np.ones(256, np.float32)})
    obj = msgpack.unpackb(frames[0])
    payload = bytearray(frames[1])
    payload[256:260] = np.float32(np.nan).tobytes()
    obj["frames"][0][2] = __import__("zlib").crc32(payload)
    with pytest.raises(codec.CodecError, match="scale"):
        codec.decode([msgpack.packb(obj), bytes(payload)])
