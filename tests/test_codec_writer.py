"""codec.payload.FrameWriter: the one frame writer, whole or frame by frame, same bytes."""

import numpy as np
import pytest

import codec
from codec import format as fmt
from codec.payload import FrameWriter, block_codes, block_scales

pytestmark = pytest.mark.timeout(60)


def _payload_of(x: np.ndarray, block: int) -> tuple[FrameWriter, np.ndarray]:
    """An int8 message of x laid out by hand: codes q = 0 but for q = 1 at 1, scales 127."""
    writer = FrameWriter("int8", block, [(("values",), x.shape, "float32")], 1)
    (t,) = writer.tensors
    payload = np.zeros(writer.total, np.uint8)
    block_codes(payload, t, "int8")[1] = 1
    block_scales(payload, t)[...] = 127
    return writer, payload


@pytest.mark.parametrize("zstd_level", [None, 1])
def test_frames_closed_one_at_a_time_are_the_frames_closed_at_once(zstd_level):
    n = 2 * fmt.FRAME_BYTES + 1000  # two full payload frames of codes and a tail
    specs = [(("values",), (n,), "float32")]
    payload = np.random.default_rng(0).integers(0, 255, n + 4 * 4, dtype=np.uint8)
    whole = FrameWriter("int8", n, specs, zstd_level)
    assert whole.total == n + 4  # n codes (4-aligned: n is), then one float32 scale
    payload = payload[: whole.total]
    whole.close(memoryview(payload))
    parts = FrameWriter("int8", n, specs, zstd_level)
    for a in range(0, whole.total, fmt.FRAME_BYTES):
        parts.close(memoryview(payload[a : a + fmt.FRAME_BYTES]))
    assert [bytes(f) for f in parts.frames()] == [bytes(f) for f in whole.frames()]
    assert len(whole.frames()) == 1 + 3


def test_a_hand_laid_message_decodes_by_the_format():
    x = np.zeros(10, np.float32)
    writer, payload = _payload_of(x, 4)
    writer.close(memoryview(payload))
    # value = q * (m * float32(1/127)) with m = 127: element 1 is 1.0, every other 0
    want = np.zeros(10, np.float32)
    want[1] = np.float32(127) * np.float32(1 / 127)
    assert codec.decode(writer.frames())["values"].tobytes() == want.tobytes()


def test_a_short_frame_before_the_end_and_unclosed_bytes_are_refused():
    n = fmt.FRAME_BYTES + 10
    writer = FrameWriter("int8", 256, [(("values",), (n,), "float32")], None)
    payload = np.zeros(writer.total, np.uint8)
    with pytest.raises(codec.CodecError, match="whole frames"):
        writer.close(memoryview(payload[:100]))
    with pytest.raises(codec.CodecError, match="whole frames"):
        writer.close(memoryview(np.zeros(writer.total + 1, np.uint8)))
    writer.close(memoryview(payload[: fmt.FRAME_BYTES]))
    with pytest.raises(codec.CodecError, match="payload bytes were closed"):
        writer.frames()
    writer.close(memoryview(payload[fmt.FRAME_BYTES :]))
    assert len(writer.frames()) == 3
