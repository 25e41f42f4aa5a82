"""Checkpoints written off the serving loop, in one process: copy-on-write, deferral, recovery.

A real data directory and shard state; the writer thread is paused by the
data directory's hold file (`checkpoint.hold`) so each test knows where it is.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from conftest import wait_for
from rich.console import Console
from shard_helpers import delta_frames, push_header
from test_shard_durability import PUSHES, T0, assert_same, cfg_for, drive, new_initialized

from paramserver.plumbing.status_view import render_status
from paramserver.server.core import ShardCore
from paramserver.server.storage.checkpoint import read_checkpoint
from paramserver.server.storage.checkpoint_job import HOLD_NAME
from paramserver.server.storage.shard_storage import ShardStorage

pytestmark = pytest.mark.timeout(60)


def _push_and_step(durable, state, plan, island, rnd, fragment, now, step=True):
    """Accept one delta of `fragment` and step it, logging both (as the loop would)."""
    state.hello(island, now)
    size = plan.fragments[fragment].size
    vec = np.random.default_rng([rnd, fragment]).standard_normal(size).astype(np.float32) * 0.01
    header = push_header(plan, island, rnd, fragment, state.versions()[fragment])
    out = state.submit_delta(header, delta_frames(vec), now)
    assert out.status == "accepted", out
    durable.append([out.event])
    if step:
        assert durable.before_step(fragment)
        durable.append([state.step(fragment, now)[0]])
    durable.sync()


def _paused_writer(tmp_path, pushes):
    """A data dir after `pushes`, and a checkpoint job writing, paused by the hold file."""
    cfg = cfg_for(tmp_path, checkpoint_every_steps=0, checkpoint_every_s=0)
    durable, state, plan = new_initialized(cfg)
    drive(durable, state, plan, pushes)
    (durable.dir / HOLD_NAME).touch()
    job = durable.begin_checkpoint(state, T0 + 5)
    job.start()
    wait_for(lambda: list(durable.dir.glob(".checkpoint-*.tmp-*")), "the writer's file")
    return cfg, durable, state, plan, job


def test_a_fragment_changed_in_place_after_the_capture_is_written_as_captured(tmp_path):
    cfg = cfg_for(tmp_path, checkpoint_every_steps=0, checkpoint_every_s=0)
    durable, state, plan = new_initialized(cfg)
    drive(durable, state, plan, PUSHES[:4])
    for frag in state.fragments.values():  # params as numpy buffers changed in place (S2)
        frag.params = np.array(frag.params)
    captured = {i: f.params.copy() for i, f in state.fragments.items()}
    versions = state.versions()
    (durable.dir / HOLD_NAME).touch()
    job = durable.begin_checkpoint(state, T0 + 5)
    job.start()
    tmp = wait_for(lambda: list(durable.dir.glob(".checkpoint-*.tmp-*")), "the writer's file")
    assert durable.before_step(0)  # copies fragment 0 first
    state.fragments[0].params += 1.0  # what an in-place outer step does to the live buffer
    assert not durable.before_step(1)  # fragment 0's copy is still held: step 1 later
    assert durable.before_step(1, urgent=True)  # unless its pending deltas near the limit:
    state.fragments[1].params += 1.0  # then it is copied beside fragment 0's, and steps
    assert not job.done and durable.checkpoint_writing
    (durable.dir / HOLD_NAME).unlink()
    wait_for(lambda: job.done, "the checkpoint write")
    assert durable.before_step(1)
    result = durable.poll_checkpoint()
    assert result.written and not tmp[0].exists()
    meta, arrays = read_checkpoint(durable.dir / "checkpoint-1.ckpt")
    for i, values in captured.items():
        assert arrays[f"params/{i}"].tobytes() == values.tobytes()
    assert {f["index"]: f["version"] for f in meta["fragments"]} == versions
    assert durable.last_checkpoint["generation"] == 1
    assert durable.last_checkpoint["versions"] == {str(k): v for k, v in versions.items()}
    assert durable.last_checkpoint["bytes"] == (durable.dir / "checkpoint-1.ckpt").stat().st_size
    durable.close()


def test_events_during_the_write_are_replayed_after_it_and_after_a_lost_one(tmp_path):
    cfg, durable, state, plan, job = _paused_writer(tmp_path, PUSHES)
    for rnd in range(100, 104):  # served while the checkpoint is being written
        _push_and_step(durable, state, plan, "d", rnd, 0, T0 + rnd)
    _push_and_step(durable, state, plan, "d", 104, 1, T0 + 104, step=False)  # (1 waits)
    # the process dies before the checkpoint is complete (a copy of its directory now):
    # the older state + both log segments
    shutil.copytree(tmp_path / "data", tmp_path / "lost" / "data")
    lost = ShardStorage(cfg_for(tmp_path / "lost"), 0)
    assert_same(state, lost.recover())
    lost.close()
    (durable.dir / HOLD_NAME).unlink()
    wait_for(lambda: job.done, "the checkpoint write")
    assert durable.poll_checkpoint().written
    durable.close()
    again = ShardStorage(cfg, 0)
    assert_same(state, again.recover())
    assert again.replayed == 9  # the five accepts and four steps after the capture
    assert again.last_checkpoint["generation"] == 1 and again.last_checkpoint["seconds"] is None
    again.close()


def test_abandon_stops_a_paused_write_and_leaves_no_file(tmp_path):
    _, durable, state, _, _ = _paused_writer(tmp_path, PUSHES[:3])
    result = durable.abandon_checkpoint()
    assert (result.written, result.error) == (False, "abandoned")
    assert not list(durable.dir.glob("*checkpoint-*"))
    assert not durable.checkpoint_writing
    # the synchronous checkpoint (at stop) does not wait for an operator's hold
    assert durable.checkpoint(state, T0 + 1)
    assert (durable.dir / "checkpoint-2.ckpt").exists() and (durable.dir / HOLD_NAME).exists()
    durable.close()


def test_a_rebuild_from_disk_stops_the_write_and_the_next_poll_reports_it(tmp_path):
    _, durable, state, _, _ = _paused_writer(tmp_path, PUSHES[:3])
    assert_same(state, durable.reload())  # (after a failed append, in the shard)
    assert durable.checkpoint_writing  # not collected yet: the core hears of it next turn
    result = durable.poll_checkpoint()
    assert (result.written, result.error) == (False, "abandoned")
    assert not list(durable.dir.glob("*checkpoint-*")) and not durable.checkpoint_writing
    durable.close()


def test_the_core_begins_one_checkpoint_at_a_time_and_counts_what_it_covered(tmp_path):
    cfg = cfg_for(tmp_path, checkpoint_every_steps=2, checkpoint_every_s=0)
    durable, state, _ = new_initialized(cfg)
    core = ShardCore(cfg, 0, state, [("tcp://x:1", "tcp://x:2")], T0)
    counts = core.checkpoints  # the core's schedule: what settle counted
    counts.steps_since, counts.records_since = 2, 5
    assert core.checkpoint_due(T0)
    core.checkpoint_started(T0)
    assert not core.checkpoint_due(T0) and core.checkpoint_report()["checkpoint_writing"]
    counts.steps_since, counts.records_since = 3, 9  # served meanwhile
    core.checkpoint_done(T0 + 1, False, error="cannot write: File too large")
    report = core.checkpoint_report()
    assert report["checkpoint_failures"] == 1 and "File too large" in report["checkpoint_error"]
    assert not core.checkpoint_due(T0 + 2)  # retried after CHECKPOINT_RETRY_S
    assert core.checkpoint_due(T0 + 12)
    core.checkpoint_started(T0 + 12)
    counts.steps_since, counts.records_since = 4, 12
    summary = {"generation": 2, "step": 3, "versions": {"0": 2}, "time": T0, "bytes": 9}
    core.checkpoint_done(T0 + 13, True, {**summary, "seconds": 0.5})
    assert (counts.steps_since, counts.records_since) == (1, 3)  # what came after the capture
    report = core.checkpoint_report()
    assert report["last_checkpoint"]["generation"] == 2 and report["checkpoint_failures"] == 0
    durable.close()


def test_status_shows_the_last_checkpoint():
    console = Console(width=400, record=True)
    shard = {
        "shard": 0, "endpoint": "tcp://h:1", "versions": {"0": 3},
        "last_checkpoint": {
            "generation": 7, "step": 42, "versions": {"0": 3}, "time": 0.0,
            "bytes": 3 * 1024 * 1024, "seconds": 1.25,
        },
        "checkpoint_writing": True, "checkpoint_failures": 2,
    }  # fmt: skip
    render_status({"connect": "tcp://h:1", "shards": [shard]}, console)
    text = console.export_text()
    assert "#7 step 42 00:00:00Z 3.0 MiB 1.25 s, writing, 2 failed" in text
