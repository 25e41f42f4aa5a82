"""paramserver.server.storage.checkpoint: round trip, atomic replace, corruption and version checks."""

import numpy as np
import pytest

from paramserver.server.storage.checkpoint import (
    CheckpointError,
    read_checkpoint,
    write_checkpoint,
)

ARRAYS = {
    "params/0": np.linspace(-1, 1, 1001, dtype=np.float32),
    "opt/0/0": np.array(3, dtype=np.int32),
    "empty": np.zeros(0, dtype=np.float32),
    "grid": np.arange(12, dtype=np.float64).reshape(3, 4),
}
META = {"shard": 0, "plan": None, "nested": {"a": [1, 2.5, "x", None]}}


def test_round_trip(tmp_path):
    path = tmp_path / "c.ckpt"
    size = write_checkpoint(path, META, ARRAYS, fsync=True)
    assert size == path.stat().st_size
    meta, arrays = read_checkpoint(path)
    assert meta == META
    assert set(arrays) == set(ARRAYS)
    for name, arr in ARRAYS.items():
        assert arrays[name].dtype == arr.dtype and arrays[name].shape == arr.shape
        assert arrays[name].tobytes() == arr.tobytes()
        assert arrays[name].flags.writeable


def test_rewrite_replaces_atomically_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "c.ckpt"
    write_checkpoint(path, {"n": 1}, ARRAYS, fsync=False)
    write_checkpoint(path, {"n": 2}, {"x": np.ones(3, np.float32)}, fsync=False)
    assert read_checkpoint(path)[0] == {"n": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["c.ckpt"]


@pytest.mark.parametrize("where", [0, 20, 200, -6, -1])
def test_a_flipped_byte_anywhere_is_detected(tmp_path, where):
    path = tmp_path / "c.ckpt"
    write_checkpoint(path, META, ARRAYS, fsync=False)
    data = bytearray(path.read_bytes())
    data[where] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError):
        read_checkpoint(path)


def test_truncated_and_missing_files(tmp_path):
    path = tmp_path / "c.ckpt"
    write_checkpoint(path, META, ARRAYS, fsync=False)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="checksum"):
        read_checkpoint(path)
    with pytest.raises(CheckpointError, match="cannot read"):
        read_checkpoint(tmp_path / "missing.ckpt")
