"""paramserver.server.storage.wal: record round trip, torn tails at every cut, mid-log corruption, headers."""

import logging
import os
import zlib

import numpy as np
import pytest

import codec
from paramserver.server.storage import wal
from paramserver.server.storage.wal import LogReader, WalError, WriteAheadLog


def write_records(path, count=3, fsync=False):
    log = WriteAheadLog(path, fsync=fsync)
    offsets = []
    for i in range(count):
        payload = np.arange(i * 10, i * 10 + 5 + i, dtype=np.float32)
        offsets.append(log.append({"t": "x", "i": i}, [payload, b"tail"]))
    log.close()
    return offsets


def read_all(path):
    reader = LogReader(path)
    return reader, list(reader)


def test_round_trip_keeps_headers_payloads_and_offsets(tmp_path):
    path = tmp_path / "wal-0.log"
    offsets = write_records(path, fsync=True)
    reader, records = read_all(path)
    assert [r.header for r in records] == [{"t": "x", "i": i} for i in range(3)]
    assert [r.offset for r in records] == offsets
    for i, r in enumerate(records):
        expected = np.arange(i * 10, i * 10 + 5 + i, dtype=np.float32).tobytes() + b"tail"
        assert r.payload == expected
    assert reader.torn_at is None and reader.end_offset == os.path.getsize(path)


def test_reopening_appends_after_the_existing_records(tmp_path):
    path = tmp_path / "wal.log"
    write_records(path, count=2)
    log = WriteAheadLog(path, fsync=False)
    log.append({"t": "late"})
    log.sync()
    log.close()
    _, records = read_all(path)
    assert [r.header.get("i", r.header["t"]) for r in records] == [0, 1, "late"]


def test_a_torn_tail_at_every_cut_is_dropped_with_a_warning_and_can_be_truncated(tmp_path, caplog):
    path = tmp_path / "wal.log"
    offsets = write_records(path)
    full = path.read_bytes()
    last = offsets[-1]
    for cut in range(last + 1, len(full)):
        path.write_bytes(full[:cut])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="paramserver.server.storage.wal"):
            reader, records = read_all(path)
        assert len(records) == 2, cut
        assert reader.torn_at == last and reader.end_offset == last
        assert f"torn tail at byte {last}" in caplog.text
    # reopen cutting the torn tail, append, and everything reads back clean
    log = WriteAheadLog(path, fsync=False, truncate_to=reader.end_offset)
    log.append({"t": "after"})
    log.close()
    reader, records = read_all(path)
    assert reader.torn_at is None
    assert [r.header.get("t") for r in records] == ["x", "x", "after"]


def test_a_garbled_final_record_is_a_torn_tail(tmp_path):
    path = tmp_path / "wal.log"
    offsets = write_records(path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    reader, records = read_all(path)
    assert len(records) == 2 and reader.torn_at == offsets[-1]


def test_corruption_in_the_middle_is_an_error_naming_the_offset(tmp_path):
    path = tmp_path / "wal.log"
    offsets = write_records(path)
    data = bytearray(path.read_bytes())
    data[offsets[1] + 12] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(WalError, match=f"record at byte {offsets[1]} has a bad checksum"):
        read_all(path)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d[:5], "shorter than"),
        (lambda d: b"NOTAWAL!" + d[8:], "not a write-ahead log"),
        (lambda d: d[:8] + (2).to_bytes(4, "little") + d[12:], "not a write-ahead log"),
    ],
)
def test_bad_file_headers_are_refused(tmp_path, mutate, message):
    path = tmp_path / "wal.log"
    write_records(path, count=1)
    path.write_bytes(mutate(path.read_bytes()))
    with pytest.raises(WalError, match=message):
        read_all(path)
    with pytest.raises(WalError, match=message):
        WriteAheadLog(path, fsync=False)


def test_another_format_version_says_so(tmp_path):
    import struct
    import zlib

    path = tmp_path / "wal.log"
    head = struct.pack("<8sI", b"DDWAL\x00\x00\x00", 7)
    path.write_bytes(head + struct.pack("<I", zlib.crc32(head)))
    with pytest.raises(WalError, match="log format 7"):
        read_all(path)


def test_rollback_cuts_off_every_record_since_the_last_sync(tmp_path):
    log = WriteAheadLog(tmp_path / "wal-0.log", fsync=False)
    log.append({"n": 0}, [b"kept"])
    log.sync()
    synced = log.size
    log.append({"n": 1}, [b"a batch"])
    log.append({"n": 2}, [b"that failed"])
    log.rollback()
    assert log.size == synced and (tmp_path / "wal-0.log").stat().st_size == synced
    log.append({"n": 3}, [b"next batch"])
    log.close()
    assert [r.header["n"] for r in LogReader(tmp_path / "wal-0.log")] == [0, 3]


def test_a_record_of_more_buffers_than_iov_max_is_written_in_batches(tmp_path):
    from paramserver.server.storage.wal import IOV_MAX

    pieces = [bytes([i % 251]) * (1 + i % 3) for i in range(IOV_MAX * 2 + 77)]
    log = WriteAheadLog(tmp_path / "wal-0.log", fsync=False)
    log.append({"n": 0}, pieces)
    log.append({"n": 1}, [b"after"])
    log.close()
    records = list(LogReader(tmp_path / "wal-0.log"))
    assert [r.header["n"] for r in records] == [0, 1]
    assert records[0].payload == b"".join(pieces) and records[1].payload == b"after"


def test_crc32_combine_equals_zlib_over_the_joined_bytes():
    rng = np.random.default_rng(3)
    for n1, n2 in [(0, 5), (7, 0), (1, 1), (1000, 1 << 20), (3, 12345)]:
        a, b = rng.bytes(n1), rng.bytes(n2)
        assert wal.crc32_combine(zlib.crc32(a), zlib.crc32(b), n2) == zlib.crc32(a + b)


def test_a_record_with_known_frame_checks_is_the_same_file(tmp_path):
    no_zstd = codec.int8(zstd_level=None)
    frames, _ = no_zstd.encode({"delta": np.linspace(-1, 1, 3_000_000, dtype=np.float32)})
    checks = wal.frame_checks(frames)
    assert checks[0] is None and all(isinstance(c, int) for c in checks[1:]) and len(checks) > 2
    zstd_frames, _ = codec.int8(zstd_level=1).encode({"delta": np.ones(1000, np.float32)})
    assert wal.frame_checks(zstd_frames) == [None] * len(zstd_frames)  # zstd: computed
    header = {"t": "accept", "i": 1}
    with_checks, computed = tmp_path / "a.log", tmp_path / "b.log"
    for path, given in ((with_checks, checks), (computed, None)):
        log = wal.WriteAheadLog(path)
        log.append(header, list(frames), given)
        log.sync()
        log.close()
    assert with_checks.read_bytes() == computed.read_bytes()
    (record,) = list(wal.LogReader(with_checks))  # and it reads back, checksum and all
    assert record.header == header
