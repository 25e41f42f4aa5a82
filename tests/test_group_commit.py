"""The shard's log writer thread (group commit) on a live shard process.

The writer waits between a group's write and its fsync while `log.hold`
exists in the shard's directory (`paramserver.server.group_commit`), so the
tests catch a push's record written and not yet durable: a heartbeat sent
then is answered before the push's ack, and a kill -9 then loses no acked
delta and applies none twice. A storage fault in the writer (a log that
cannot grow) is `tests/test_shard_storage.py`'s.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import Peer, wait_for
from shard_helpers import delta_frames, init_payload, plan_for, push_header, small_flat
from shard_process import ShardProcess

from paramserver.server.group_commit import HOLD_LOG_NAME

pytestmark = pytest.mark.timeout(120)

FLAGS = (
    "--mode", "async", "--fsync", "true",
    "--checkpoint-every-steps", "0", "--checkpoint-every-s", "0",
    "--heartbeat-interval-s", "5", "--liveness", "20",
)  # fmt: skip


def _start(data_dir: Path, ctx) -> ShardProcess:
    shard = ShardProcess(data_dir, *FLAGS)
    shard.wait_ready(ctx)
    return shard


def _init(p: Peer):
    flat = small_flat()
    plan = plan_for(flat, 1, 2)
    p.hello()
    reply, _ = p.request(
        {"kind": "init", "island": "a", "plan": plan.to_wire()}, init_payload(plan, flat)
    )
    assert reply["kind"] == "init_ok", reply
    return plan


def _push(plan, rnd: int) -> tuple[dict, list]:
    vec = np.full(plan.fragments[0].size, 0.01 * rnd, np.float32)
    return push_header(plan, "a", rnd, 0, base_version=0), delta_frames(vec)


def _held_push(p: Peer, plan, rnd: int, wal: Path, hold: Path) -> int:
    """Send a push with the writer held; return its id once its record is written (not synced)."""
    written = wal.stat().st_size
    hold.touch()
    rid = p.send(*_push(plan, rnd))
    wait_for(lambda: wal.stat().st_size > written, "the push's record written")
    return rid


def test_a_heartbeat_is_answered_while_a_push_waits_for_its_fsync(tmp_path, zmq_ctx):
    shard = _start(tmp_path / "server", zmq_ctx)
    hold = tmp_path / "server" / "shard-0" / HOLD_LOG_NAME
    wal = hold.parent / "wal-0.log"
    p = Peer(zmq_ctx, shard.router, "a")
    try:
        plan = _init(p)
        rid = _held_push(p, plan, 1, wal, hold)
        hid = p.send({"kind": "heartbeat", "island": "a"})
        first, _ = p.recv(timeout_s=30)
        assert (first["id"], first["kind"]) == (hid, "heartbeat"), first
        sid = p.send({"kind": "status"})
        second, _ = p.recv(timeout_s=30)
        assert (second["id"], second["kind"]) == (sid, "status_reply"), second
        assert not p.sock.poll(200), "the ack came before its record's fsync"
        hold.unlink()
        ack, _ = p.recv(timeout_s=30)
        assert (ack["id"], ack["kind"], ack["outcome"]) == (rid, "ack", "accepted"), ack
    finally:
        hold.unlink(missing_ok=True)
        p.close()
        code = shard.stop()
    assert code == 0, shard.output


def test_kill_9_between_write_and_fsync_loses_no_acked_delta_and_applies_none_twice(
    tmp_path, zmq_ctx
):
    data = tmp_path / "server"
    shard = _start(data, zmq_ctx)
    hold = data / "shard-0" / HOLD_LOG_NAME
    wal = hold.parent / "wal-0.log"
    p = Peer(zmq_ctx, shard.router, "a")
    try:
        plan = _init(p)
        ack, _ = p.request(*_push(plan, 1))
        assert ack["outcome"] == "accepted", ack
        # a snapshot waits for the step's record: the log holds round 1's step
        wait_for(lambda: p.snapshot(0)[0]["version"] == 1, "the step of round 1 on disk")
        _held_push(p, plan, 2, wal, hold)
        shard.proc.kill()
        shard.proc.wait(30)
    finally:
        hold.unlink(missing_ok=True)
        p.close()
        shard.stop()
    shard = _start(data, zmq_ctx)
    p = Peer(zmq_ctx, shard.router, "a")
    try:
        p.hello()
        ack, _ = p.request(*_push(plan, 2))  # never acked: sent again
        assert ack["outcome"] in ("accepted", "duplicate"), ack
        ack, _ = p.request(*_push(plan, 1))  # acked before the kill: on disk
        assert ack["outcome"] == "duplicate", ack
        wait_for(lambda: p.status()["versions"]["0"] == 2, "the step of round 2")
        status = p.status()
        assert status["accepted"] == 2, status  # each round once
        assert status["pending"]["0"] == 0, status
    finally:
        p.close()
        code = shard.stop()
    assert code == 0, shard.output
