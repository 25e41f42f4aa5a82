"""Frame layouts and storage faults on a live shard: any legal cut is stored, or refused by its limit.

docs/protocol.md section 7.3 lets a writer cut a payload into any pieces of
1 .. 2^26 bytes, so a push may have more frames than one `writev` takes
(IOV_MAX = 1024 on Linux): the log writes it in batches. A request of more
than `max_frames_per_message` frames is refused `oversize` before anything is
stored. A record whose append fails (here: the file-size limit, RLIMIT_FSIZE
via prlimit) costs only its own request: the other islands' pushes of the
same batch are acked (pushes queued behind that batch before the writer
reported the failure are refused `storage_error` and stored when re-sent).
The shard runs as a real subprocess.
"""

from __future__ import annotations

import resource
import zlib
from dataclasses import replace
from typing import Any

import msgpack
import numpy as np
import pytest
from conftest import Peer, wait_for
from shard_helpers import delta_frames, init_payload, plan_for, push_header
from shard_process import ShardProcess

import codec
from paramserver.server.config import ShardConfig
from paramserver.server.group_commit import HOLD_LOG_NAME
from paramserver.server.storage.shard_storage import ShardStorage

pytestmark = pytest.mark.timeout(120)

FLAGS = (
    "--mode", "async", "--fsync", "true", "--checkpoint-every-steps", "0",
    "--checkpoint-every-s", "0", "--heartbeat-interval-s", "5", "--liveness", "20",
)  # fmt: skip


def flat_of(elements: int) -> dict[str, np.ndarray]:
    """Parameters of `elements` float32 values in one leaf (two fragments)."""
    return {"w": np.linspace(-1, 1, elements, dtype=np.float32)}


def recut(frames: list[Any], pieces: int) -> list[bytes]:
    """The same raw (no zstd) codec message with its payload cut into `pieces` frames."""
    header = msgpack.unpackb(bytes(frames[0]), raw=False)
    assert not header["zstd"]
    payload = b"".join(bytes(f) for f in frames[1:])
    bounds = np.linspace(0, len(payload), pieces + 1).astype(int)
    cut = [payload[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    assert all(cut), "every piece holds at least one byte"
    header["frames"] = [[len(p), len(p), zlib.crc32(p)] for p in cut]
    return [msgpack.packb(header, use_bin_type=True), *cut]


def joined(shard: ShardProcess, ctx, islands: list[str], flat) -> tuple[list[Peer], Any]:
    """Hello from each island; the first initializes the shard. Returns (peers, plan)."""
    shard.wait_ready(ctx)
    plan = plan_for(flat, 1, 2)
    peers = [Peer(ctx, shard.router, name) for name in islands]
    for p in peers:
        p.hello()
    reply, _ = peers[0].request(
        {"kind": "init", "island": islands[0], "plan": plan.to_wire()}, init_payload(plan, flat)
    )
    assert reply["kind"] == "init_ok", reply
    return peers, plan


def test_a_push_of_1100_frames_is_stored_and_acked_without_a_rebuild(tmp_path, zmq_ctx):
    shard = ShardProcess(tmp_path / "server", *FLAGS)
    peers: list[Peer] = []
    try:
        peers, plan = joined(shard, zmq_ctx, ["a", "b"], flat_of(8192))
        a, b = peers
        size = plan.fragments[0].size
        many = recut(delta_frames(np.full(size, 0.25, np.float32)), 1100)
        assert len(many) == 1101
        # the honest island pushes in the same window: its pushes are queued around a's
        b.send(push_header(plan, "b", 1, 1), delta_frames(np.full(size, 0.5, np.float32)))
        a.send(push_header(plan, "a", 1, 0), many)
        b.send(push_header(plan, "b", 1, 0), delta_frames(np.full(size, 0.5, np.float32)))
        acks = [a.recv()[0], b.recv()[0], b.recv()[0]]
        assert [ack["outcome"] for ack in acks] == ["accepted"] * 3, acks
        status = a.status()
        assert status["accepted"] == 3 and status["rejected"] == {}, status
    finally:
        for p in peers:
            p.close()
        code = shard.stop()
    assert code == 0, shard.output
    assert "rebuilt from disk" not in shard.output and "Invalid argument" not in shard.output
    # the 1100-frame record reads back: a restart has every accepted delta
    cfg = replace(ShardConfig(mode="async"), data_dir=str(tmp_path / "server"))
    state = ShardStorage(cfg, 0).recover()
    assert state.counters.accepted == 3
    assert state.dedup[("a", 0)].rounds == {1}


def test_more_frames_than_the_limit_are_refused_before_anything_is_stored(tmp_path, zmq_ctx):
    shard = ShardProcess(tmp_path / "server", *FLAGS, "--max-frames-per-message", "1024")
    wal = tmp_path / "server" / "shard-0" / "wal-0.log"
    peers: list[Peer] = []
    try:
        peers, plan = joined(shard, zmq_ctx, ["a"], flat_of(8192))
        (a,) = peers
        size = plan.fragments[0].size
        before = wal.stat().st_size
        vec = np.full(size, 0.25, np.float32)
        ack, _ = a.request(push_header(plan, "a", 1, 0), recut(delta_frames(vec), 1100))
        assert (ack["kind"], ack["outcome"], ack["reason"]) == ("ack", "rejected", "oversize")
        assert "1102 frames; max_frames_per_message=1024" in ack["detail"], ack
        assert wal.stat().st_size == before
        # at the limit it is stored (the log writes it in batches of IOV_MAX buffers)
        ack, _ = a.request(push_header(plan, "a", 1, 0), recut(delta_frames(vec), 1022))
        assert ack["outcome"] == "accepted", ack
    finally:
        for p in peers:
            p.close()
        assert shard.stop() == 0, shard.output


def test_a_failed_append_refuses_only_its_own_push(tmp_path, zmq_ctx):
    shard = ShardProcess(tmp_path / "server", *FLAGS)
    wal = tmp_path / "server" / "shard-0" / "wal-0.log"
    peers: list[Peer] = []
    try:
        peers, plan = joined(shard, zmq_ctx, ["a", "b"], flat_of(1 << 18))
        a, b = peers
        size = plan.fragments[0].size
        big = delta_frames(np.linspace(0, 1, size, dtype=np.float32))  # raw: 512 KiB
        small = codec.int8(zstd_level=3).encode({"delta": np.zeros(size, np.float32)})[0]
        assert sum(len(memoryview(f).cast("B")) for f in small) < 8 * 1024
        # room for b's small records, not for a's big one
        _, hard = resource.prlimit(shard.proc.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(
            shard.proc.pid, resource.RLIMIT_FSIZE, (wal.stat().st_size + 64 * 1024, hard)
        )
        b_pushes = {}  # request id -> (round, fragment)
        for rnd in (1, 2):  # a's push between b's, sent at once: they share batches
            b_pushes[b.send(push_header(plan, "b", rnd, 0), small)] = (rnd, 0)
            a.send(push_header(plan, "a", rnd, 1), big)
            b_pushes[b.send(push_header(plan, "b", rnd, 1), small)] = (rnd, 1)
        a_acks = [a.recv()[0] for _ in range(2)]
        b_acks = {ack["id"]: ack for ack in (b.recv()[0] for _ in range(4))}
        assert [x["reason"] for x in a_acks] == ["storage_error"] * 2, a_acks
        first = next(iter(b_pushes))  # sent before a's first push: in its group or before
        assert b_acks[first]["outcome"] == "accepted", b_acks
        # b's pushes of the failed group are acked. One the shard took in after that group,
        # before its writer reported the failure, is refused storage_error too (a loaded
        # machine splits the six into several groups): re-sent while a's pushes still
        # fail, as a client re-sends, each is stored
        refused = [i for i, ack in b_acks.items() if ack["outcome"] != "accepted"]
        assert all(b_acks[i]["reason"] == "storage_error" for i in refused), b_acks
        for i in refused:
            rnd, fragment = b_pushes[i]
            ack, _ = b.request(push_header(plan, "b", rnd, fragment), small)
            assert ack["outcome"] == "accepted", ack
        status = b.status()
        assert status["rejected"] == {"storage_error": 2 + len(refused)}, status
        assert status["accepted"] == 4, status
        resource.prlimit(shard.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, hard))
        ack, _ = a.request(push_header(plan, "a", 1, 1), big)  # sent again, it is stored
        assert ack["outcome"] == "accepted", ack
        wait_for(lambda: b.status()["accepted"] == 5, "a's push counted")
    finally:
        for p in peers:
            p.close()
        code = shard.stop()
    assert code == 0, shard.output
    cfg = replace(ShardConfig(mode="async"), data_dir=str(tmp_path / "server"))
    state = ShardStorage(cfg, 0).recover()
    assert state.counters.accepted == 5
    assert state.dedup[("a", 1)].rounds == {1}
    assert state.dedup[("b", 0)].rounds == {1, 2} == state.dedup[("b", 1)].rounds


def test_a_push_queued_behind_a_failed_group_is_refused_and_stored_when_re_sent(tmp_path, zmq_ctx):
    """The writer holds (`log.hold`) between a failed group's write and its fsync, and b
    pushes meanwhile: that push, admitted into a state about to be rebuilt from disk, is
    refused `storage_error` (none is lost: the re-send is stored)."""
    shard = ShardProcess(tmp_path / "server", *FLAGS)
    shard_dir = tmp_path / "server" / "shard-0"
    wal, hold = shard_dir / "wal-0.log", shard_dir / HOLD_LOG_NAME
    peers: list[Peer] = []
    try:
        peers, plan = joined(shard, zmq_ctx, ["a", "b"], flat_of(1 << 18))
        a, b = peers
        size = plan.fragments[0].size
        big = delta_frames(np.linspace(0, 1, size, dtype=np.float32))
        small = codec.int8(zstd_level=3).encode({"delta": np.zeros(size, np.float32)})[0]
        _, hard = resource.prlimit(shard.proc.pid, resource.RLIMIT_FSIZE)
        limit = wal.stat().st_size + 64 * 1024
        resource.prlimit(shard.proc.pid, resource.RLIMIT_FSIZE, (limit, hard))
        hold.touch()
        a.send(push_header(plan, "a", 1, 1), big)
        # the writer lost a's record and now holds before the group's fsync
        wait_for(lambda: "cannot append to" in shard.output, "a's append failed")
        behind = b.send(push_header(plan, "b", 1, 0), small)
        b.status()  # answered after the loop took b's push in (one connection, FIFO)
        hold.unlink()
        assert a.recv()[0]["reason"] == "storage_error"
        ack = b.recv()[0]
        assert ack["id"] == behind and ack["reason"] == "storage_error", ack
        ack, _ = b.request(push_header(plan, "b", 1, 0), small)
        assert ack["outcome"] == "accepted", ack
        status = b.status()
        assert status["rejected"] == {"storage_error": 2} and status["accepted"] == 1, status
    finally:
        hold.unlink(missing_ok=True)
        for p in peers:
            p.close()
        code = shard.stop()
    assert code == 0, shard.output
