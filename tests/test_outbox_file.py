"""The island's outbox file: records, torn tails, the old format, compaction (no sockets)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import zlib
from pathlib import Path

import msgpack
import pytest
from conftest import wait_for

from paramserver.client import PushRequest
from worker import outbox
from worker.outbox import Outbox

ROOT = Path(__file__).resolve().parent.parent


def delta(round_: int, fragment: int, size: int = 64) -> PushRequest:
    body = bytes((round_ * 7 + fragment + i) % 256 for i in range(size))
    return PushRequest(fragment, round_, 3, 10 * round_ + 1, 2, [b"head", body])


def keys(deltas) -> list[tuple[int, int]]:
    return [(d.round, d.fragment) for d in deltas]


def v1_file(path: Path, island: str, plan_hash: str, deltas: list[PushRequest]) -> None:
    """A format-1 file as the previous version wrote it at a graceful stop (by its layout)."""
    body = msgpack.packb(
        {
            "version": 1,
            "island": island,
            "plan_hash": plan_hash,
            "saved_at": 1.0,
            "deltas": [
                {"fragment": d.fragment, "round": d.round, "base_version": d.base_version,
                 "tokens": d.tokens, "steps": d.steps, "frames": d.frames}
                for d in deltas
            ],
        },
        use_bin_type=True,
    )  # fmt: skip
    path.write_bytes(b"DILOCO-OUTBOX\n" + zlib.crc32(body).to_bytes(4, "big") + body)


@pytest.mark.timeout(30)
def test_resolved_deltas_are_dropped_and_the_live_ones_come_back_in_push_order(tmp_path):
    path = tmp_path / "outbox.bin"
    box = Outbox.open(path, "a", "plan")
    assert box.to_resend == [] and path.exists()
    box.record([], [delta(1, 0), delta(1, 1)])
    box.record([(1, 0), (9, 9)], [delta(2, 0), delta(2, 1)])  # (9, 9): unknown, ignored
    box.record([(2, 1)], [])
    assert box.live == [(1, 1), (2, 0)]
    # kill -9 now: nothing closed, the file is what it is
    saved = outbox.load(path)
    assert saved.island == "a" and saved.plan_hash == "plan" and saved.torn == 0
    assert saved.deltas == [delta(1, 1), delta(2, 0)]  # every field and frame
    again = Outbox.open(path, "a", "plan")
    assert again.to_resend == [delta(1, 1), delta(2, 0)] and again.newest_round == 2
    assert again.live == [(1, 1), (2, 0)]
    box.close()
    again.close()


@pytest.mark.timeout(30)
def test_a_torn_or_corrupt_last_record_is_ignored_and_the_earlier_ones_kept(tmp_path):
    path = tmp_path / "outbox.bin"
    box = Outbox.open(path, "a", "plan")
    box.record([], [delta(1, 0), delta(1, 1)])
    intact = path.read_bytes()
    box.record([(1, 0)], [delta(2, 0)])
    full = path.read_bytes()
    box.close()
    assert outbox.load(path).deltas == [delta(1, 1), delta(2, 0)]
    resolved = len(intact) + len(outbox.resolved_record([(1, 0)]))
    for cut in range(len(intact) + 1, len(full)):  # a kill -9 mid-append, at every byte
        path.write_bytes(full[:cut])
        saved = outbox.load(path)
        if cut < resolved:  # the resolved record torn: it and the new delta are ignored
            assert keys(saved.deltas) == [(1, 0), (1, 1)] and saved.torn == cut - len(intact)
        else:  # the resolved record whole, the new delta torn
            assert keys(saved.deltas) == [(1, 1)] and saved.torn == cut - resolved
    flipped = bytearray(full)
    flipped[-3] ^= 0x40  # a bit flip in the last record: its crc fails
    path.write_bytes(bytes(flipped))
    saved = outbox.load(path)
    assert keys(saved.deltas) == [(1, 1)] and saved.torn == len(full) - resolved  # the last record


@pytest.mark.timeout(30)
def test_the_next_run_rewrites_a_torn_file_so_that_its_own_records_are_read(tmp_path, caplog):
    path = tmp_path / "outbox.bin"
    box = Outbox.open(path, "a", "plan")
    box.record([], [delta(1, 0), delta(1, 1)])
    box.close()
    path.write_bytes(path.read_bytes()[:-5])  # the second delta torn
    again = Outbox.open(path, "a", "plan")
    assert again.to_resend == [delta(1, 0)]
    assert "bytes after its last intact record ignored" in caplog.text
    again.record([], [delta(5, 1)])  # appended after the intact records, not after the tear
    again.close()
    assert keys(outbox.load(path).deltas) == [(1, 0), (5, 1)]


@pytest.mark.timeout(30)
def test_an_old_format_file_is_read_and_rewritten_in_the_new_one(tmp_path):
    path = tmp_path / "outbox.bin"
    v1_file(path, "a", "plan", [delta(4, 0), delta(4, 1)])
    assert outbox.load(path).version == 1
    box = Outbox.open(path, "a", "plan")
    assert box.to_resend == [delta(4, 0), delta(4, 1)]
    box.close()
    assert path.read_bytes().startswith(outbox.MAGIC)
    assert outbox.load(path).deltas == [delta(4, 0), delta(4, 1)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("v1-corrupt", "checksum mismatch"),
        ("other-island", "holds deltas of island 'b'"),
        ("other-plan", "for plan other"),
        ("garbage", "bad magic"),
        ("v2-no-header", "no readable header record"),
        ("v2-corrupt-middle", "is corrupt at byte"),  # not a tear: bytes follow it
    ],
)
def test_a_file_this_island_cannot_use_is_set_aside_never_deleted(tmp_path, caplog, content, why):
    path = tmp_path / "outbox.bin"
    if content == "v1-corrupt":
        v1_file(path, "a", "plan", [delta(1, 0)])
        data = bytearray(path.read_bytes())
        data[-2] ^= 1
        path.write_bytes(bytes(data))
    elif content == "other-island":
        other = Outbox.open(path, "b", "plan")
        other.record([], [delta(1, 0)])
        other.close()
    elif content == "other-plan":
        v1_file(path, "a", "other", [delta(1, 0)])
    elif content == "v2-corrupt-middle":
        other = Outbox.open(path, "a", "plan")
        other.record([], [delta(1, 0), delta(1, 1)])
        other.close()
        data = bytearray(path.read_bytes())
        data[len(outbox.header("a", "plan")) + 40] ^= 1  # inside the first delta record
        path.write_bytes(bytes(data))
    elif content == "garbage":
        path.write_bytes(b"not an outbox")
    else:
        path.write_bytes(outbox.MAGIC + b"\x00\x00")
    before = path.read_bytes()
    box = Outbox.open(path, "a", "plan")
    box.close()
    assert box.to_resend == []
    (aside,) = tmp_path.glob("outbox.bin.unused-*")
    assert aside.read_bytes() == before
    assert why in caplog.text
    assert outbox.load(path).deltas == []  # a fresh file of this island


@pytest.mark.timeout(60)
def test_the_file_stays_bounded_over_many_rounds(tmp_path):
    path = tmp_path / "outbox.bin"
    box = Outbox.open(path, "a", "plan")
    size = 20_000  # ~80 KB per round of 4 fragments: 1 MiB is passed every ~13 rounds
    sizes = []
    for r in range(1, 301):
        done = [(r - 2, f) for f in range(4)] if r > 2 else []  # acked a round later
        box.record(done, [delta(r, f, size) for f in range(4)])
        sizes.append(path.stat().st_size)
        assert path.stat().st_size == box.size
    assert box.live == [(r, f) for r in (299, 300) for f in range(4)]
    record_bytes = len(outbox.delta_record(delta(1, 0, size)))
    bound = max(outbox.COMPACT_FACTOR * 8 * record_bytes, outbox.COMPACT_MIN_BYTES)
    assert max(sizes) <= bound + 4 * record_bytes + 1024  # + one batch and its resolved record
    assert sum(sizes) / len(sizes) < bound
    assert box.compactions > 10
    box.close()
    assert keys(outbox.load(path).deltas) == box.live


@pytest.mark.parametrize(
    ("size", "live", "compact"),
    [
        (100, 0, False),  # small: never rewritten
        (outbox.COMPACT_MIN_BYTES + 1, 0, True),
        (outbox.COMPACT_MIN_BYTES + 1, outbox.COMPACT_MIN_BYTES // 2 + 1, False),
        (3 * outbox.COMPACT_MIN_BYTES, outbox.COMPACT_MIN_BYTES, True),
        (4 * outbox.COMPACT_MIN_BYTES, 2 * outbox.COMPACT_MIN_BYTES, False),
    ],
)
def test_should_compact(size, live, compact):
    assert outbox.should_compact(size, live) is compact


@pytest.mark.timeout(30)
def test_keep_leaves_exactly_the_unacked_deltas_and_removes_the_file_when_none(tmp_path):
    path = tmp_path / "outbox.bin"
    box = Outbox.open(path, "a", "plan")
    box.record([], [delta(1, 0), delta(1, 1), delta(2, 0)])
    assert box.keep([delta(1, 1), delta(3, 0)])  # (3, 0): never recorded, written from memory
    assert outbox.load(path).deltas == [delta(1, 1), delta(3, 0)]
    box.record([], [delta(9, 9)])  # after close: nothing
    assert outbox.load(path).deltas == [delta(1, 1), delta(3, 0)]
    again = Outbox.open(path, "a", "plan")
    assert again.keep([])
    assert not path.exists()


_WRITER = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from paramserver.client import PushRequest
from worker.outbox import Outbox
box = Outbox.open(Path(sys.argv[1]), "a", "plan")
r = 0
while True:
    r += 1
    body = bytes([r % 256]) * 300_000
    box.record([(r - 3, 0)] if r > 3 else [], [PushRequest(0, r, 0, 1, 1, [body])])
    if r == 5:
        print("ready", flush=True)
"""


@pytest.mark.timeout(60)
def test_kill_9_in_the_middle_of_appends_leaves_a_readable_file(tmp_path):
    path = tmp_path / "outbox.bin"
    for _ in range(3):  # three kills at other moments
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(path), str(ROOT)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout.readline() == "ready\n"
        wait_for(lambda: path.stat().st_size > 0, "appends", timeout_s=10)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        saved = outbox.load(path)
        rounds = [d.round for d in saved.deltas]
        assert rounds and rounds == list(range(rounds[0], rounds[0] + len(rounds))), rounds
        assert 1 <= len(rounds) <= 4
        assert all(d.frames == [bytes([d.round % 256]) * 300_000] for d in saved.deltas)
        path.unlink()
        for aside in tmp_path.glob("outbox.bin*"):
            aside.unlink()
