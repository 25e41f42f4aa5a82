"""Durable shards: recovery from checkpoint + log, corrupted checkpoints, torn logs, kill -9."""

import logging
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import Peer, free_port, wait_for
from shard_helpers import delta_frames, init_payload, plan_for, push_header, small_flat
from shard_process import shard_argv

import codec
from paramserver.server.config import ShardConfig
from paramserver.server.state import ShardState
from paramserver.server.step.outer import FragmentOptimizer, make_outer_optimizer
from paramserver.server.storage.recovery import DurabilityError
from paramserver.server.storage.shard_storage import ShardStorage

ROOT = Path(__file__).resolve().parent.parent
T0 = 1_000_000.0


def cfg_for(tmp_path, **kw):
    base = ShardConfig(data_dir=str(tmp_path / "data"), mode="async", fsync=False)
    return replace(base, **kw)


def drive(durable, state, plan, pushes, start=1):
    """Accept pushes (island, fragment) in order, stepping after each; log every event.

    Checkpoints after every `checkpoint_every_steps` steps of the storage's config.
    """
    flat = small_flat()
    now = T0
    steps = 0
    for k, (island, fragment) in enumerate(pushes, start=start):
        now += 0.01
        state.hello(island, now)
        v = np.random.default_rng(k).standard_normal(plan.fragments[fragment].size)
        h = push_header(plan, island, k, fragment, state.versions()[fragment])
        out = state.submit_delta(h, delta_frames(v.astype(np.float32) * 0.01), now)
        assert out.status == "accepted", out
        durable.append([out.event])
        if k % 3:  # leave some deltas pending across the checkpoint / restart
            for f in state.due_fragments(now)[0]:
                durable.append([state.step(f, now)[0]])
                steps += 1
        durable.sync()
        every = durable.cfg.checkpoint_every_steps
        if every and steps >= every and durable.checkpoint(state, now):
            steps = 0
    del flat


def new_initialized(cfg):
    durable = ShardStorage(cfg, 0)
    state = durable.recover()
    flat = small_flat()
    plan = plan_for(flat, cfg.shards, cfg.num_fragments)
    out = state.initialize(plan.to_wire(), init_payload(plan, flat))
    durable.append([out.event])
    return durable, state, plan


def coded_form(c):
    """What a pending delta keeps: its scheme, codes, scales and clip factor."""
    d = c.delta
    return (d.scheme, d.block, d.codes.dtype.str, d.codes.tobytes(), d.scales.tobytes(), c.clip)


def assert_same(a: ShardState, b: ShardState):
    assert a.versions() == b.versions()
    for f in a.fragments:
        assert a.snapshot(f)[1].tobytes() == b.snapshot(f)[1].tobytes()
        pa, pb = a.fragments[f].pending, b.fragments[f].pending
        assert [c.key for c in pa] == [c.key for c in pb]
        assert [coded_form(x) for x in pa] == [coded_form(y) for y in pb]  # the same coded set
        sa = a.optimizer.state_to_arrays(a.fragments[f].opt_state)
        sb = b.optimizer.state_to_arrays(b.fragments[f].opt_state)
        assert all(x.tobytes() == y.tobytes() for x, y in zip(sa, sb, strict=True))
    assert {k: (e.newest, e.rounds) for k, e in a.dedup.items()} == {
        k: (e.newest, e.rounds) for k, e in b.dedup.items()
    }
    assert a.counters.accepted == b.counters.accepted
    assert a.counters.steps == b.counters.steps


PUSHES = [("a", 0), ("b", 1), ("a", 1), ("b", 0), ("c", 0), ("a", 0), ("b", 1), ("c", 1)]


def test_recovery_from_the_log_alone(tmp_path):
    cfg = cfg_for(tmp_path, checkpoint_every_steps=0, checkpoint_every_s=0)
    durable, state, plan = new_initialized(cfg)
    drive(durable, state, plan, PUSHES)
    durable.close()
    stale = durable.dir / ".checkpoint-1.ckpt.tmp-99999"  # a checkpoint write cut short
    stale.write_bytes(b"half")
    again = ShardStorage(cfg, 0)
    assert_same(state, again.recover())
    assert again.replayed > len(PUSHES)
    assert not stale.exists()
    again.close()


KILLED_IN_CREATION = """
import os, signal, sys
from paramserver.server.storage import wal

real_write = os.write

def write(fd, data):  # kill -9 the moment a segment's header is written
    if bytes(data) == wal._file_header():
        os.kill(os.getpid(), signal.SIGKILL)
    return real_write(fd, data)

os.write = write
wal.WriteAheadLog(sys.argv[1], fsync=True)
"""


def test_a_kill_9_while_a_log_segment_is_created_leaves_nothing_recovery_refuses(tmp_path):
    cfg = cfg_for(tmp_path, checkpoint_every_steps=0, checkpoint_every_s=0)
    durable, state, plan = new_initialized(cfg)
    drive(durable, state, plan, PUSHES)
    durable.close()
    # the next segment, as a checkpoint starts it, killed in the middle of its creation
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    segment = durable.dir / "wal-1.log"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_IN_CREATION, str(segment)], env=env, timeout=60
    )
    assert killed.returncode == -signal.SIGKILL
    assert not segment.exists()  # never a segment without its whole header
    again = ShardStorage(cfg, 0)
    assert_same(state, again.recover())
    assert not list(durable.dir.glob(".wal-*"))  # the unfinished one is removed
    again.close()


def test_recovery_from_checkpoint_plus_log_and_pruning(tmp_path):
    cfg = cfg_for(tmp_path, checkpoint_every_steps=2)
    durable, state, plan = new_initialized(cfg)
    drive(durable, state, plan, PUSHES * 2)
    durable.close()
    files = sorted(p.name for p in durable.dir.iterdir())
    assert len([f for f in files if f.endswith(".ckpt")]) == 2, files
    again = ShardStorage(cfg, 0)
    recovered = again.recover()
    assert_same(state, recovered)
    assert again.replayed < 2 * len(PUSHES)  # most of it came from the checkpoint
    # a resend of an acked delta is a duplicate after the restart
    recovered.hello("a", T0)
    key = next(iter(recovered.dedup))
    h = push_header(plan, key[0], max(recovered.dedup[key].rounds), key[1])
    out = recovered.submit_delta(
        h, delta_frames(np.zeros(plan.fragments[key[1]].size, np.float32)), T0
    )
    assert out.status == "duplicate"
    again.close()


def test_a_corrupted_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    cfg = cfg_for(tmp_path, checkpoint_every_steps=2)
    durable, state, plan = new_initialized(cfg)
    drive(durable, state, plan, PUSHES * 2)
    durable.close()
    newest = max(durable.dir.glob("checkpoint-*.ckpt"), key=lambda p: int(p.stem.split("-")[1]))
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    again = ShardStorage(cfg, 0)
    with caplog.at_level(logging.ERROR, logger="paramserver.server.storage.recovery"):
        recovered = again.recover()
    assert f"checkpoint {newest.name} is unusable" in caplog.text
    assert_same(state, recovered)
    assert (newest.parent / (newest.name + ".corrupt")).exists()
    again.close()
    # the fresh checkpoint written after the fallback is good on its own
    third = ShardStorage(cfg, 0)
    assert_same(state, third.recover())
    assert third.replayed == 0
    third.close()


def test_a_torn_log_tail_is_reported_and_dropped(tmp_path, caplog):
    cfg = cfg_for(tmp_path, checkpoint_every_steps=0, checkpoint_every_s=0)
    durable, state, plan = new_initialized(cfg)
    drive(durable, state, plan, PUSHES[:3])
    durable.close()
    log = durable.dir / "wal-0.log"
    complete = log.stat().st_size
    with open(log, "ab") as f:
        f.write(b"\x40\x00\x00\x00partial")  # a record whose body never made it
    again = ShardStorage(cfg, 0)
    with caplog.at_level(logging.WARNING, logger="paramserver.server.storage.wal"):
        recovered = again.recover()
    assert f"torn tail at byte {complete}" in caplog.text
    assert_same(state, recovered)
    again.close()
    assert log.stat().st_size == complete  # truncated before appending again


def test_a_data_dir_of_another_cluster_shape_is_refused(tmp_path):
    cfg = cfg_for(tmp_path, checkpoint_every_steps=1)
    durable, state, plan = new_initialized(cfg)
    drive(durable, state, plan, PUSHES[:2])
    durable.close()
    with pytest.raises(DurabilityError, match="checkpoint is for shard/shards/fragments"):
        ShardStorage(replace(cfg, fragments=4), 0).recover()


def test_a_stopped_shard_checkpoints_and_restarts_with_the_same_state(start_shard, peer):
    shard = start_shard(mode="async", heartbeat_interval_s=5.0, liveness=20)
    p = peer(shard.router, "a")
    p.hello()
    flat = small_flat()
    plan = plan_for(flat)
    p.request({"kind": "init", "island": "a", "plan": plan.to_wire()}, init_payload(plan, flat))
    size = plan.fragments[0].size
    ack, _ = p.request(push_header(plan, "a", 1, 0), delta_frames(np.ones(size, np.float32)))
    assert ack["outcome"] == "accepted"
    # the step runs off the serving loop: wait for it, so that the snapshot is of version 1
    before = wait_for(lambda: (v := p.status()["versions"])["0"] == 1 and v, "the step")
    reply, body = p.request({"kind": "snapshot", "island": "a", "fragment": 0})
    shard.stop()
    assert list((Path(shard.server.cfg.data_dir) / "shard-0").glob("checkpoint-*.ckpt"))
    again = start_shard(shard.server.cfg)
    q = peer(again.router, "a")
    assert q.status()["versions"] == before
    reply2, body2 = q.request({"kind": "snapshot", "island": "a", "fragment": 0})
    assert reply2["version"] == reply["version"]
    assert codec.decode(body2)["values"].tobytes() == codec.decode(body)["values"].tobytes()
    nack, _ = q.request(push_header(plan, "a", 1, 0), delta_frames(np.ones(size, np.float32)))
    assert nack["reason"] == "unknown_island"  # a restarted shard knows nobody
    q.hello()
    dup, _ = q.request(push_header(plan, "a", 1, 0), delta_frames(np.ones(size, np.float32)))
    assert dup["outcome"] == "duplicate"


# ----- kill -9 with real processes ------------------------------------------------------


def spawn_shard(port, data_dir):
    cmd = shard_argv(
        data_dir,
        port,
        *("--mode", "sync"),
        # explicit: every step (one island each) takes Nesterov
        *("--outer-optimizer", "nesterov", "--outer-lr", "0.7", "--outer-momentum", "0.9"),
        # exact fp32 state, so a plain optimizer replay is the reference
        *("--downlink", "float32", "--checkpoint-every-steps", "4"),
        *("--heartbeat-interval-s", "5", "--liveness", "100", "--log-level", "WARNING"),
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)


def connect(ctx, port, proc):
    """A peer welcomed by the shard process `proc` on `port`; fails with its stderr if it exits."""
    p = Peer(ctx, f"tcp://127.0.0.1:{port}", "a")
    try:
        p.send({"kind": "hello", "island": "a"})  # queued until the process serves
        # a loaded machine: importing JAX alone can take 10 s
        wait_for(
            lambda: p.sock.poll(0) or proc.poll() is not None, "the shard's welcome", timeout_s=60
        )
        if proc.poll() is not None:
            pytest.fail(f"the shard exited {proc.returncode} before serving: {proc.stderr.read()}")
        reply, _ = p.recv()
        assert reply["kind"] == "welcome", reply
    except BaseException:
        p.close()
        raise
    return p


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_kill_9_mid_run_loses_no_acked_delta_and_applies_none_twice(tmp_path, zmq_ctx):
    port = free_port(2)
    data_dir = tmp_path / "data"
    flat = small_flat()
    plan = plan_for(flat)
    size = plan.fragments[0].size
    deltas = {
        r: np.random.default_rng(r).standard_normal(size).astype(np.float32) * 0.05
        for r in range(1, 31)
    }
    kills_after = {5, 9, 14, 20, 26}  # kill -9 right after sending these rounds, before their ack
    acked: list[int] = []
    kills = 0
    proc, peer_ = spawn_shard(port, data_dir), None
    try:  # from here on the shard process is stopped whatever happens
        peer_ = connect(zmq_ctx, port, proc)
        reply, _ = peer_.request(
            {"kind": "init", "island": "a", "plan": plan.to_wire()}, init_payload(plan, flat)
        )
        assert reply["kind"] == "init_ok"
        rnd = 1
        while rnd <= 30:
            header = push_header(plan, "a", rnd, 0, base_version=0)
            rid = peer_.send(header, delta_frames(deltas[rnd]))
            if rnd in kills_after:
                kills_after.discard(rnd)
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
                kills += 1
                peer_.close()
                # a fresh port: while the shard was down, another process of the suite may
                # have taken the old one as its own (a connection's local port, say)
                port = free_port(2)
                proc = spawn_shard(port, data_dir)
                peer_ = connect(zmq_ctx, port, proc)
                continue  # resend the same round to the restarted shard
            ack, _ = peer_.recv(timeout_s=60)  # a restarted shard compiles its first step
            assert ack["id"] == rid and ack["kind"] == "ack", ack
            assert ack["outcome"] in ("accepted", "duplicate"), ack
            # a sync island waits for its round's merge (the step runs off the serving loop)
            merged = ack["merged_version"]
            wait_for(lambda m=merged, p=peer_: p.status()["versions"]["0"] >= m, "the round's step")
            acked.append(rnd)
            rnd += 1
        assert kills == 5
        status = peer_.status()
        reply, body = peer_.request({"kind": "snapshot", "island": "a", "fragment": 0})
    finally:
        if peer_ is not None:
            peer_.close()
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    assert proc.returncode == 0, err
    assert acked == list(range(1, 31))
    # none lost, none twice: each acked delta was merged exactly once, alone, in order
    assert status["accepted"] == 30 and status["steps"] == 30, status
    assert status["versions"]["0"] == 30 and status["pending"]["0"] == 0
    opt = FragmentOptimizer(make_outer_optimizer("nesterov", 0.7, 0.9))
    params = plan.gather(flat, 0)
    opt_state = opt.init(params)
    for r in range(1, 31):
        # every push is based on version 0, merged at version r - 1: factor (1 + (r-1))^-0.5
        factor = np.float32(1.0 * (1.0 + (r - 1)) ** -0.5)
        params, opt_state = opt.step(params, opt_state, deltas[r] * factor)
    assert reply["version"] == 30
    assert codec.decode(body)["values"].tobytes() == params.tobytes()
