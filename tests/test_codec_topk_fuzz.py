"""Specific damage to topk frames must raise CodecError: offsets outside their chunk, bad
settings or scales, undeclared sizes. (Random damage to topk messages is fuzzed with the
other codecs in test_codec_fuzz.py.)"""

import zlib

import msgpack
import numpy as np
import pytest

import codec
from codec import format as fmt


def _plain(x, **kw):
    frames, _ = codec.topk(zstd_level=None, **kw).encode({"x": x})
    return msgpack.unpackb(frames[0]), bytearray(frames[1])


def _send(obj, payload):
    obj["frames"][0][2] = zlib.crc32(payload)
    return codec.decode([msgpack.packb(obj), bytes(payload)])


def test_offset_outside_its_chunk_is_refused():
    x = np.arange(1, 21, dtype=np.float32)  # chunk 8 keeps 2 (last chunk of 4 keeps 1)
    obj, payload = _plain(x, density=0.25, chunk=8)
    assert _send(obj, payload)["x"].shape == (20,)
    kept = obj["tensors"][0][3] + fmt.topk_kept(20, 8, 2)
    bad = bytearray(payload)
    bad[0] = 7  # first gap of chunk 0 is 7: the second entry lands at offset 8
    with pytest.raises(codec.CodecError, match="outside its chunk"):
        _send(obj, bad)
    bad = bytearray(payload)
    bad[kept] = 255  # high byte of the first gap
    with pytest.raises(codec.CodecError, match="outside its chunk"):
        _send(obj, bad)
    bad = bytearray(payload)
    bad[4] = 4  # the short last chunk (4 elements) lists offset 4
    with pytest.raises(codec.CodecError, match="outside its chunk"):
        _send(obj, bad)


def test_bad_scale_and_settings_are_refused():
    x = np.ones(64, np.float32)
    obj, payload = _plain(x, density=0.25, chunk=32)
    scales_at = len(payload) - 8
    bad = bytearray(payload)
    bad[scales_at : scales_at + 4] = np.float32(np.inf).tobytes()
    with pytest.raises(codec.CodecError, match="scale"):
        _send(obj, bad)
    bad[scales_at : scales_at + 4] = np.float32(-1).tobytes()
    with pytest.raises(codec.CodecError, match="scale"):
        _send(obj, bad)
    for key, value in [("bits", 3), ("keep", 0), ("keep", 33), ("block", 1 << 17), ("bits", None)]:
        with pytest.raises(codec.CodecError, match="bad header"):
            _send({**obj, key: value}, payload)
    # a different keep changes the layout: the declared payload size no longer fits
    with pytest.raises(codec.CodecError, match="payload size"):
        _send({**obj, "keep": 9}, payload)


def test_declared_elements_are_bounded_before_allocating():
    frames, _ = codec.topk().encode({"x": np.ones(5000, np.float32)})
    with pytest.raises(codec.CodecError, match="max_elements"):
        codec.decode(frames, max_elements=4999)
    obj = msgpack.unpackb(frames[0])
    obj["tensors"][0][1] = [2**40]
    with pytest.raises(codec.CodecError, match="max_elements"):
        codec.decode([msgpack.packb(obj), *frames[1:]])
