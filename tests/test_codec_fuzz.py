"""Fuzzing `codec.decode`: random and mutated frames may decode or raise
CodecError, nothing else; specific damage must raise CodecError."""

import random

import msgpack
import numpy as np
import pytest
import zstandard
from codec_helpers import decode_or_codec_error, fuzz_tree, mutate

import codec
from codec import format as fmt


@pytest.fixture
def small_frames(monkeypatch):
    """Small frame size, so small messages already span several payload frames."""
    monkeypatch.setattr(fmt, "FRAME_BYTES", 256)


def messages() -> list[list[bytes]]:
    tree = fuzz_tree()
    out = []
    for c in [
        codec.int8(block_size=64),
        codec.int8(zstd_level=None),
        codec.int4(block_size=16),
        codec.raw("float32"),
        codec.raw("bfloat16", zstd_level=3),
    ]:
        frames, _ = c.encode(tree)
        assert len(frames) >= 3
        out.append([bytes(f) for f in frames])
    return out


def repack(header: bytes, **changes) -> bytes:
    obj = msgpack.unpackb(header)
    obj.update(changes)
    return msgpack.packb(obj)


def test_valid_messages_decode(small_frames):
    for frames in messages():
        assert decode_or_codec_error(frames)


@pytest.mark.timeout(120)
def test_mutated_frames_never_raise_anything_but_codec_error(small_frames):
    rnd = random.Random(1234)
    msgs = messages()
    decoded = 0
    for _ in range(2500):
        frames = mutate(rnd, rnd.choice(msgs))
        decoded += decode_or_codec_error(frames)
    assert decoded < 250  # almost all damage is detected


@pytest.mark.timeout(60)
def test_random_frames_never_raise_anything_but_codec_error():
    rnd = random.Random(99)
    for _ in range(1000):
        frames = [rnd.randbytes(rnd.randrange(40)) for _ in range(rnd.randrange(4))]
        if rnd.random() < 0.5 and frames:
            frames[0] = msgpack.packb({"magic": "ddcodec", "version": 1, **{"x": rnd.random()}})
        assert not decode_or_codec_error(frames)


@pytest.mark.timeout(60)
def test_header_field_mutations_never_raise_anything_but_codec_error(small_frames):
    rnd = random.Random(5)
    values = [None, -1, 0, 1, 2**40, 2**64 - 1, 3.5, "x", b"x", [], [1, 2], {"a": 1}, True]
    msgs = messages()[:3]
    for _ in range(800):
        frames = list(rnd.choice(msgs))
        obj = msgpack.unpackb(frames[0])
        key = rnd.choice(list(obj))
        if key == "tensors" and obj[key] and rnd.random() < 0.7:
            entry = rnd.choice(obj[key])
            entry[rnd.randrange(4)] = rnd.choice(values + [[2**40], [-1], ["a", 1]])
        elif key == "frames" and obj[key] and rnd.random() < 0.7:
            entry = rnd.choice(obj[key])
            entry[rnd.randrange(3)] = rnd.choice(values)
        else:
            obj[key] = rnd.choice(values)
        frames[0] = msgpack.packb(obj)
        decode_or_codec_error(frames)


def test_specific_damage_is_detected(small_frames):
    for frames in messages():
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
            assert not decode_or_codec_error(bad)
        with pytest.raises(codec.CodecError, match="version"):
            codec.decode([repack(header, version=2), *frames[1:]])
        # unknown header fields are ignored
        assert decode_or_codec_error([repack(header, future_field=[1, 2]), *frames[1:]])


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
