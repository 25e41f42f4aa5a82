"""Checkpoints off the serving path, on a real shard process.

The writer is caught in the middle of its file by the data directory's hold
file (`checkpoint.hold`: background writes pause before each piece while it
exists), so "a push is acked while a checkpoint is being written" is shown by
order, not by timing: the ack arrives while the checkpoint's temporary file
exists, incomplete, and no checkpoint file is there. kill -9 in that state,
and a write that fails under a file-size limit, lose no acked delta and apply
none twice.
"""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import Peer, wait_for
from shard_helpers import delta_frames, init_payload, push_header
from shard_process import ShardProcess

import codec
from paramserver.server.step.outer import FragmentOptimizer, make_outer_optimizer
from paramserver.server.storage.checkpoint import read_checkpoint
from paramserver.server.storage.checkpoint_job import HOLD_NAME
from paramserver.wire.plan import leaf_specs, make_plan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parent.parent
EXACT = (
    # exact fp32 state and an explicit Nesterov, so a plain optimizer replay is the reference
    *("--downlink", "float32", "--outer-optimizer", "nesterov"),
    *("--outer-lr", "0.7", "--outer-momentum", "0.9"),
    *("--heartbeat-interval-s", "5", "--liveness", "100", "--checkpoint-every-s", "0"),
)


def _flat(elements: int) -> dict[str, np.ndarray]:
    return {"w": np.random.default_rng(0).standard_normal(elements).astype(np.float32) * 0.1}


def _delta(size: int, rnd: int) -> np.ndarray:
    return np.random.default_rng(rnd).standard_normal(size).astype(np.float32) * 0.05


class Run:
    """A shard process, its directory and one island `a` (reconnected after each restart)."""

    def __init__(self, ctx, tmp_path: Path, elements: int, *flags: str, fragments: int = 2) -> None:
        self.ctx, self.flags = ctx, flags
        self.data = tmp_path / "server"
        self.dir = self.data / "shard-0"
        self.dir.mkdir(parents=True)
        self.flat = _flat(elements)
        self.plan = make_plan(leaf_specs(self.flat), 1, fragments)
        self.shard: ShardProcess | None = None
        self.peer: Peer | None = None
        self.start()
        reply, _ = self.peer.request(
            {"kind": "init", "island": "a", "plan": self.plan.to_wire()},
            init_payload(self.plan, self.flat),
        )
        assert reply["kind"] == "init_ok", reply

    def start(self) -> None:
        self.shard = ShardProcess(self.data, *self.flags)
        self.shard.wait_ready(self.ctx)
        self.peer = Peer(self.ctx, self.shard.router, "a")
        self.peer.hello()

    def kill_and_restart(self) -> None:
        self.peer.close()
        self.shard.proc.send_signal(signal.SIGKILL)
        self.shard.proc.wait(30)
        self.start()

    def push(self, rnd: int, fragment: int = 0, scheme: str = "raw") -> dict:
        vec = _delta(self.plan.fragments[fragment].size, rnd)
        header = push_header(self.plan, "a", rnd, fragment, base_version=0)
        ack, _ = self.peer.request(header, delta_frames(vec, scheme))
        assert ack["kind"] == "ack", ack
        return ack

    def status(self) -> dict:
        return self.peer.status()

    def temporary(self) -> list[Path]:
        return list(self.dir.glob(".checkpoint-*.tmp-*"))

    def stop(self) -> int:
        if self.peer is not None:
            self.peer.close()
        return self.shard.stop()


def _held(run: Run) -> None:
    """Wait until a checkpoint is being written and its writer is paused in its file."""
    wait_for(lambda: run.status()["checkpoint_writing"], "a checkpoint being written")
    wait_for(run.temporary, "the checkpoint's temporary file")


def _reference(run: Run, rounds: int) -> np.ndarray:
    """Fragment 0 after Nesterov steps of rounds 1..rounds, each merged alone in order."""
    opt = FragmentOptimizer(make_outer_optimizer("nesterov", 0.7, 0.9))
    params = run.plan.gather(run.flat, 0)
    state = opt.init(params)
    size = run.plan.fragments[0].size
    for r in range(1, rounds + 1):
        # based on version 0, merged at version r - 1: staleness factor (1 + (r - 1))^-0.5
        factor = np.float32((1.0 + (r - 1)) ** -0.5)
        params, state = opt.step(params, state, _delta(size, r) * factor)
    return params


def test_a_push_is_acked_while_a_large_checkpoint_is_being_written(tmp_path, zmq_ctx):
    # two fragments of 4M parameters: a 64 MiB checkpoint (params + momentum)
    flags = ("--mode", "async", "--checkpoint-every-steps", "1", "--fsync", "true", *EXACT)
    run = Run(zmq_ctx, tmp_path, 8 << 20, *flags)
    try:
        (run.dir / HOLD_NAME).touch()
        assert run.push(1)["outcome"] == "accepted"  # its step makes a checkpoint due
        _held(run)
        ack = run.push(2)
        assert ack["outcome"] == "accepted"
        # the ack came while the checkpoint is incomplete: its file exists, unfinished
        (tmp,) = run.temporary()
        assert tmp.stat().st_size < 64 << 20
        assert not list(run.dir.glob("checkpoint-*.ckpt"))
        # fragment 0 steps on (its state was copied first); fragment 1 waits for the
        # writer to be done with that copy (one fragment's copy at a time)
        wait_for(lambda: run.status()["versions"]["0"] == 2, "fragment 0's second step")
        assert run.push(1, fragment=1)["outcome"] == "accepted"
        status = run.status()
        assert status["versions"]["1"] == 0 and status["pending"]["1"] == 1, status
        assert status["checkpoint_writing"] and status["last_checkpoint"] is None
        (run.dir / HOLD_NAME).unlink()
        last = wait_for(lambda: run.status()["last_checkpoint"], "the checkpoint to be written")
        wait_for(lambda: run.status()["versions"]["1"] == 1, "fragment 1's deferred step")
        path = run.dir / "checkpoint-1.ckpt"
        meta, _ = read_checkpoint(path)
        captured = {str(f["index"]): f["version"] for f in meta["fragments"]}
        assert captured == {"0": 1, "1": 0}  # the state after round 1's step, not later
        assert (last["generation"], last["step"], last["versions"]) == (1, 1, captured)
        assert last["bytes"] == path.stat().st_size and last["seconds"] > 0
        shown = subprocess.run(
            [sys.executable, "-m", "paramserver.ops.cli", "status", "--connect",
             run.shard.router, "--json"],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        (shard,) = json.loads(shown.stdout)["shards"]
        assert shard["last_checkpoint"]["generation"] >= 1 and "checkpoint_writing" in shard
    finally:
        code = run.stop()
    assert code == 0, run.shard.output


def test_steps_waiting_behind_another_fragments_copy_never_make_pushes_fail(tmp_path, zmq_ctx):
    # the bench's case: 31 fragments, async pushes each stepping its fragment while a
    # checkpoint is held; more pushes per fragment than max_pending_per_island (8)
    fragments, rounds = 31, 10
    # pushes and status polls back to back from one island, as the bench does: no request limit
    flags = ("--mode", "async", "--checkpoint-every-steps", "1", "--fragments", str(fragments),
             "--max-requests-per-s", "0")  # fmt: skip
    run = Run(zmq_ctx, tmp_path, fragments << 14, *flags, *EXACT, fragments=fragments)
    try:
        (run.dir / HOLD_NAME).touch()
        assert run.push(1)["outcome"] == "accepted"  # its step makes a checkpoint due
        _held(run)
        assert run.push(2)["outcome"] == "accepted"  # fragment 0 is copied and steps
        outcomes = [run.push(r, f)["outcome"] for r in range(1, rounds + 1) for f in range(1, 8)]
        assert outcomes == ["accepted"] * len(outcomes)
        status = run.status()
        assert status["checkpoint_writing"] and run.temporary(), status  # still held
        # each fragment stepped once its pending deltas neared the limit (a second copy)
        assert all(status["versions"][str(f)] >= 1 for f in range(1, 8)), status
        assert all(status["pending"][str(f)] < 8 for f in range(1, 8)), status
        (run.dir / HOLD_NAME).unlink()
        wait_for(lambda: run.status()["last_checkpoint"], "the checkpoint to be written")
        final = wait_for(
            lambda: (s := run.status())["pending"]["7"] == 0 and s, "the deferred steps"
        )
        assert sum(final["versions"][str(f)] for f in range(1, 8)) >= 7
    finally:
        code = run.stop()
    assert code == 0, run.shard.output


def test_kill_9_during_checkpoints_loses_no_acked_delta_and_applies_none_twice(tmp_path, zmq_ctx):
    flags = ("--mode", "sync", "--checkpoint-every-steps", "2", "--fsync", "true", *EXACT)
    run = Run(zmq_ctx, tmp_path, 1 << 20, *flags)
    try:
        (run.dir / HOLD_NAME).touch()
        for rnd in range(1, 5):  # the checkpoint after round 2 is held; 3 and 4 are acked meanwhile
            assert run.push(rnd)["outcome"] == "accepted"
            if rnd == 2:
                _held(run)
        assert run.temporary() and not list(run.dir.glob("checkpoint-*.ckpt"))
        run.kill_and_restart()  # no checkpoint on disk: the log from the empty state
        (run.dir / HOLD_NAME).unlink()
        assert not run.temporary()
        assert run.push(4)["outcome"] == "duplicate"
        for rnd in (5, 6):
            assert run.push(rnd)["outcome"] == "accepted"
        first = wait_for(lambda: run.status()["last_checkpoint"], "a written checkpoint")
        (run.dir / HOLD_NAME).touch()
        for rnd in (7, 8):
            assert run.push(rnd)["outcome"] == "accepted"
        _held(run)
        assert run.push(9)["outcome"] == "accepted"
        run.kill_and_restart()  # a checkpoint and the log after it, the next one unfinished
        (run.dir / HOLD_NAME).unlink()
        loaded = run.status()["last_checkpoint"]
        assert loaded["generation"] == first["generation"] and loaded["seconds"] is None
        assert run.push(9)["outcome"] == "duplicate"
        assert run.push(10)["outcome"] == "accepted"
        # its step runs off the serving loop: a sync island waits for it
        status = wait_for(lambda: (s := run.status())["steps"] >= 10 and s, "the last step")
        reply, body = run.peer.request({"kind": "snapshot", "island": "a", "fragment": 0})
    finally:
        code = run.stop()
    assert code == 0, run.shard.output
    assert status["accepted"] == 10 and status["steps"] == 10, status
    assert status["versions"] == {"0": 10, "1": 0} and status["pending"]["0"] == 0
    assert reply["version"] == 10
    assert codec.decode(body)["values"].tobytes() == _reference(run, 10).tobytes()


def _limit_file_size(pid: int, size: int) -> None:
    _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (size, hard))


def test_a_checkpoint_that_cannot_be_written_is_retried_and_loses_nothing(tmp_path, zmq_ctx):
    flags = ("--mode", "async", "--checkpoint-every-steps", "1", "--fsync", "true", *EXACT)
    run = Run(zmq_ctx, tmp_path, 1 << 19, *flags)  # a 4 MiB checkpoint, 2 MiB of init log
    try:
        # the log may grow by 1 MiB more, a checkpoint file cannot be written
        _limit_file_size(run.shard.proc.pid, (run.dir / "wal-0.log").stat().st_size + (1 << 20))
        assert run.push(1, scheme="int8")["outcome"] == "accepted"
        failed = wait_for(lambda: run.status()["checkpoint_failures"] and run.status())
        assert "File too large" in failed["checkpoint_error"], failed
        assert failed["last_checkpoint"] is None and not run.temporary()
        for rnd in (2, 3):  # still acked: the log has room
            assert run.push(rnd, scheme="int8")["outcome"] == "accepted"
        _limit_file_size(run.shard.proc.pid, resource.RLIM_INFINITY)
        done = wait_for(
            lambda: run.status()["last_checkpoint"], "the retried checkpoint", timeout_s=60
        )
        assert run.status()["checkpoint_failures"] == 0 and done["generation"] >= 2
        run.kill_and_restart()
        assert run.push(3, scheme="int8")["outcome"] == "duplicate"
        status = run.status()
    finally:
        code = run.stop()
    assert code == 0, run.shard.output
    assert status["accepted"] == 3 and status["steps"] == 3, status
    assert status["versions"] == {"0": 3, "1": 0}
