"""Outbox records written as pieces with writev (issue 37): same bytes, many frames, torn writes.

A delta record is never joined in memory: its prefix and msgpack head, then
each frame's bin header and the frame, go to the file with `os.writev` (at
most IOV_MAX buffers a call) and a crc32 chained over the pieces. These
tests pin that the bytes are those of the msgpack map the format defines
(so files of either writer read the same), that a record of more frames than
one writev takes round-trips, that a batch with resolved keys is laid out in
order, and that a write cut short or damaged is caught by length or crc and
left out, never loaded.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import zlib
from pathlib import Path

import msgpack
import numpy as np
import pytest

from paramserver.client import PushRequest
from worker import outbox
from worker.outbox import IOV_MAX, Outbox

ROOT = Path(__file__).resolve().parent.parent
MANY_FRAMES = IOV_MAX + 300  # each frame is two buffers (bin header, frame): over two writev calls


def frames_of(round_: int, count: int, size: int = 37) -> list[bytes]:
    return [bytes([(round_ + i) % 256]) * (size + i % 5) for i in range(count)]


def delta(round_: int, fragment: int, frames: list | None = None) -> PushRequest:
    return PushRequest(fragment, round_, 3, 10 * round_ + 1, 2, frames or frames_of(round_, 2))


def by_the_format(d: PushRequest) -> bytes:
    """The record as the format defines it: length, crc32, msgpack map (built independently)."""
    body = msgpack.packb(
        {
            "fragment": d.fragment,
            "round": d.round,
            "base_version": d.base_version,
            "tokens": d.tokens,
            "steps": d.steps,
            "kind": "delta",
            "frames": [bytes(memoryview(f).cast("B")) for f in d.frames],
        },
        use_bin_type=True,
    )
    return len(body).to_bytes(8, "big") + zlib.crc32(body).to_bytes(4, "big") + body


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b""],
        [b"a" * 255, b"b" * 256],  # bin8 / bin16 boundary
        [b"c" * 65535, b"d" * 65536],  # bin16 / bin32 boundary
        [memoryview(b"x" * 1000), bytearray(b"y" * 70_000), np.arange(5000, dtype=np.int8)],
        [np.arange(300, dtype=np.float32)],  # not bytes-sized items: written as its bytes
    ],
    ids=["none", "empty", "bin8-16", "bin16-32", "buffers", "float32"],
)
def test_a_delta_record_is_the_msgpack_map_of_the_format_byte_for_byte(frames):
    d = PushRequest(1, 2**40, 7, 123456, 3, frames)
    rec = outbox.delta_record(d)
    assert bytes(rec) == by_the_format(d) and len(rec) == len(by_the_format(d))
    # the frames are referenced, not copied: each big frame is its own piece
    big = [f for f in frames if memoryview(f).nbytes > 100]
    assert len(rec.pieces) == max(1, 2 * len(frames))
    for f in big:
        base = f.obj if isinstance(f, memoryview) else f
        assert any(p is f or (isinstance(p, memoryview) and p.obj is base) for p in rec.pieces)


@pytest.mark.timeout(60)
def test_write_all_writes_more_buffers_than_one_writev_takes_in_order(tmp_path):
    pieces = [bytes([i % 251]) * (i % 4) for i in range(IOV_MAX * 3 + 11)]  # some empty
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert outbox.write_all(fd, pieces) == sum(len(p) for p in pieces)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"".join(pieces)


@pytest.mark.timeout(60)
def test_a_delta_of_more_frames_than_iov_max_round_trips(tmp_path):
    path = tmp_path / "outbox.bin"
    box = Outbox.open(path, "a", "plan")
    many = delta(1, 0, frames_of(1, MANY_FRAMES))
    box.record([], [many, delta(1, 1)])
    assert path.stat().st_size == box.size
    data = path.read_bytes()
    start = len(outbox.header("a", "plan"))
    assert data[start:] == by_the_format(many) + by_the_format(delta(1, 1))
    saved = outbox.load(path)
    assert saved.torn == 0 and saved.deltas == [many, delta(1, 1)]
    box.close()
    again = Outbox.open(path, "a", "plan")
    assert again.to_resend == [many, delta(1, 1)]
    again.close()


@pytest.mark.timeout(60)
def test_a_batch_with_resolved_keys_is_one_append_in_order(tmp_path):
    path = tmp_path / "outbox.bin"
    box = Outbox.open(path, "a", "plan")
    box.record([], [delta(1, 0), delta(1, 1)])
    before = path.read_bytes()
    new = [delta(2, 0, frames_of(2, MANY_FRAMES)), delta(2, 1)]
    box.record([(1, 0), (8, 8)], new)  # (8, 8): unknown, left out of the record
    expected = outbox.resolved_record([(1, 0)]) + b"".join(by_the_format(d) for d in new)
    assert path.read_bytes() == before + expected
    assert box.live == [(1, 1), (2, 0), (2, 1)]
    assert outbox.load(path).deltas == [delta(1, 1), *new]
    box.close()


@pytest.mark.timeout(60)
def test_a_damaged_last_record_fails_its_crc_and_is_dropped_whatever_piece_is_hit(tmp_path):
    path = tmp_path / "outbox.bin"
    box = Outbox.open(path, "a", "plan")
    box.record([], [delta(1, 0)])
    intact = path.read_bytes()
    box.record([], [delta(2, 0, frames_of(2, MANY_FRAMES))])
    full = path.read_bytes()
    box.close()
    record_at, body_at = len(intact), len(intact) + 12
    frame_bytes = len(full) - body_at
    hits = {
        "the head": body_at + 3,
        "the first frame": body_at + 80,
        "a bin header between frames": len(full) - (37 + (MANY_FRAMES - 1) % 5) - 1,
        "a frame past the first writev": body_at + frame_bytes * 3 // 4,
        "the last byte": len(full) - 1,
    }
    for where, at in hits.items():
        damaged = bytearray(full)
        damaged[at] ^= 0x20
        path.write_bytes(bytes(damaged))
        saved = outbox.load(path)
        assert [d.round for d in saved.deltas] == [1], where
        assert saved.torn == len(full) - record_at, where
    # the pages of the frames never reached the disk (the size did): zeros, same length
    zeroed = full[: body_at + 100] + bytes(len(full) - body_at - 100)
    path.write_bytes(zeroed)
    assert [d.round for d in outbox.load(path).deltas] == [1]
    box = Outbox.open(path, "a", "plan")  # the torn record dropped, the file rewritten
    assert box.to_resend == [delta(1, 0)]
    box.close()
    head = len(outbox.header("a", "plan"))  # (its created_at is new)
    assert path.read_bytes()[head:] == intact[head:]


_CRASHING_WRITER = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from paramserver.client import PushRequest
from worker.outbox import Outbox
box = Outbox.open(Path(sys.argv[1]), "a", "plan")
box.record([], [PushRequest(0, 1, 0, 1, 1, [b"first" * 100])])
calls, writev = [], os.writev
def crash_midway(fd, buffers):  # the kill lands inside the second writev of the record
    calls.append(1)
    if len(calls) == 2:
        writev(fd, buffers[: len(buffers) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    return writev(fd, buffers)
os.writev = crash_midway
frames = [bytes([i % 256]) * 1000 for i in range(int(sys.argv[3]))]
box.record([(1, 0)], [PushRequest(0, 2, 0, 1, 1, frames)])
print("not killed", flush=True)
"""


@pytest.mark.timeout(60)
def test_a_kill_9_in_the_middle_of_a_many_frame_record_leaves_it_out(tmp_path, caplog):
    path = tmp_path / "outbox.bin"
    proc = subprocess.run(
        [sys.executable, "-c", _CRASHING_WRITER, str(path), str(ROOT), str(MANY_FRAMES)],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    saved = outbox.load(path)
    # the resolved record of round 1 went out whole in the first writev: round 1 is done;
    # round 2 is cut short (half of its second writev): left out, its bytes counted as torn
    assert saved.deltas == [] and saved.torn > IOV_MAX * 1000 // 2
    box = Outbox.open(path, "a", "plan")
    assert box.to_resend == []
    assert "bytes after its last intact record ignored" in caplog.text
    box.record([], [delta(3, 0)])
    box.close()
    assert outbox.load(path).deltas == [delta(3, 0)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("copy_file_range", ["kernel", "read-and-write"])
def test_compaction_and_keep_copy_live_records_byte_for_byte(
    tmp_path, monkeypatch, copy_file_range
):
    if copy_file_range == "read-and-write":

        def refused(*_args, **_kw):
            raise OSError(errno.ENOSYS, "copy_file_range not here")

        monkeypatch.setattr(os, "copy_file_range", refused, raising=False)
        monkeypatch.setattr(outbox, "COPY_CHUNK_BYTES", 4096)  # a record in many reads
    path = tmp_path / "outbox.bin"
    box = Outbox.open(path, "a", "plan")
    live = delta(1, 0, frames_of(1, 40, 20_000))  # ~800 KB, kept through every compaction
    box.record([], [live])
    r = 2
    while box.compactions < 3:  # (open's fresh file is one)
        box.record([(r - 1, 0)] if r > 2 else [], [delta(r, 0, frames_of(r, 10, 30_000))])
        r += 1
    head = len(outbox.header("a", "plan"))
    latest = delta(r - 1, 0, frames_of(r - 1, 10, 30_000))
    assert path.read_bytes()[head:] == by_the_format(live) + by_the_format(latest)
    assert box.keep([latest, live, delta(99, 0)])  # two copied from the file, one written
    assert path.read_bytes()[head:] == b"".join(
        by_the_format(d) for d in (latest, live, delta(99, 0))
    )
    assert outbox.load(path).deltas == [latest, live, delta(99, 0)]


@pytest.mark.timeout(30)
def test_a_file_of_the_previous_writer_is_read_resent_and_appended_to(tmp_path):
    # the previous writer joined msgpack.packb of each record's map: the same bytes
    path = tmp_path / "outbox.bin"
    header = msgpack.packb(
        {"kind": "header", "version": 2, "island": "a", "plan_hash": "plan", "created_at": 1.0},
        use_bin_type=True,
    )
    old = [delta(1, 0), delta(1, 1, frames_of(1, MANY_FRAMES))]
    path.write_bytes(
        outbox.MAGIC
        + len(header).to_bytes(8, "big")
        + zlib.crc32(header).to_bytes(4, "big")
        + header
        + b"".join(by_the_format(d) for d in old)
    )
    box = Outbox.open(path, "a", "plan")
    assert box.to_resend == old and box.live == [(1, 0), (1, 1)]
    box.record([(1, 0)], [delta(2, 0)])
    box.close()
    assert outbox.load(path).deltas == [old[1], delta(2, 0)]
