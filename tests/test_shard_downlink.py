"""The int8 downlink: replicas that add every published update equal the shard bit for bit."""

from dataclasses import replace

import numpy as np
import pytest
import zmq
from conftest import wait_for
from shard_helpers import delta_frames, init_payload, plan_for, push_header, small_flat

import codec
from paramserver.server.config import ShardConfig
from paramserver.server.state import ShardState
from paramserver.server.step.downlink import Downlink, DownlinkError, new_residual
from paramserver.server.storage.checkpoint import export_state, restore_state
from paramserver.wire import protocol

T0 = 1_000_000.0
CFG = ShardConfig(mode="async", downlink="int8", fsync=False)


def run_steps(cfg, steps, seed=0):
    """Initialize a state and step it `steps` times; returns (state, plan, events, updates)."""
    flat = small_flat(seed)
    plan = plan_for(flat, cfg.shards, cfg.num_fragments)
    state = ShardState(cfg, 0)
    events = [state.initialize(plan.to_wire(), init_payload(plan, flat)).event]
    state.hello("a", T0)
    rng = np.random.default_rng(seed + 1)
    updates = []
    for rnd in range(1, steps + 1):
        fragment = rnd % 2
        d = rng.standard_normal(plan.fragments[fragment].size).astype(np.float32) * 0.05
        h = push_header(plan, "a", rnd, fragment, state.versions()[fragment])
        out = state.submit_delta(h, delta_frames(d), T0 + rnd)
        events.append(out.event)
        event, update = state.step(fragment, T0 + rnd)
        events.append(event)
        # values view the params, which the next step updates in place: keep a copy
        updates.append(replace(update, values=update.values.copy()))
    return state, plan, flat, events, updates


def test_a_replica_adding_every_update_equals_the_shard_at_every_version():
    state, plan, flat, _, updates = run_steps(CFG, 60)
    replica = {f: plan.gather(flat, f) for f in (0, 1)}
    for u in updates:
        assert u.frames is not None
        decoded = codec.decode(list(u.frames))["values"]
        replica[u.fragment] = np.add(replica[u.fragment], decoded, dtype=np.float32)
        assert replica[u.fragment].tobytes() == u.values.tobytes(), u.version
    for f in (0, 1):
        assert replica[f].tobytes() == state.snapshot(f)[1].tobytes()


def test_the_int8_downlink_tracks_the_float32_trajectory_closely():
    exact, *_ = run_steps(replace(CFG, downlink="float32"), 60)
    quant, *_ = run_steps(CFG, 60)
    for f in (0, 1):
        a, b = exact.snapshot(f)[1], quant.snapshot(f)[1]
        assert np.linalg.norm(a - b) / np.linalg.norm(a) < 5e-3
        assert quant.fragments[f].residual is not None


def test_replay_and_checkpoint_reproduce_frames_params_and_residuals():
    state, _, _, events, updates = run_steps(CFG, 20)
    replica = ShardState(CFG, 0)
    replayed = [u for u in (replica.apply(e) for e in events) if u is not None]
    assert [tuple(bytes(memoryview(f)) for f in u.frames) for u in replayed] == [
        tuple(bytes(memoryview(f)) for f in u.frames) for u in updates
    ]
    meta, arrays = export_state(replica)
    restored = restore_state(CFG, 0, meta, arrays)
    for f in (0, 1):
        assert restored.snapshot(f)[1].tobytes() == state.snapshot(f)[1].tobytes()
        assert restored.fragments[f].residual.tobytes() == state.fragments[f].residual.tobytes()


def test_downlink_rejects_unknown_schemes_and_full_mode_publishing():
    with pytest.raises(DownlinkError, match="int4"):
        Downlink("int4")
    with pytest.raises(DownlinkError):
        Downlink("float32").begin(np.zeros(3, np.float32), new_residual(3))


@pytest.mark.timeout(60)
def test_a_subscriber_replica_equals_the_live_shard(start_shard, peer, zmq_ctx):
    shard = start_shard(mode="async", downlink="int8", heartbeat_interval_s=0.05, liveness=400)
    sub = zmq_ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(shard.pub)
    try:
        assert sub.poll(10_000), "no heartbeat: subscription not live"
        flat = small_flat(3)
        plan = plan_for(flat)
        p = peer(shard.router, "a")
        p.hello()
        p.request({"kind": "init", "island": "a", "plan": plan.to_wire()}, init_payload(plan, flat))
        replica = {f: plan.gather(flat, f) for f in (0, 1)}
        rng = np.random.default_rng(4)
        pushes = 30
        for rnd in range(1, pushes + 1):
            f = rnd % 2
            d = rng.standard_normal(plan.fragments[f].size).astype(np.float32) * 0.05
            ack, _ = p.request(push_header(plan, "a", rnd, f, 0), delta_frames(d, "int8"))
            assert ack["outcome"] == "accepted"
        # steps run off the serving loop, and a step's update is published after its
        # record is fsynced: once nothing is pending or stepping, the snapshots say where
        # each fragment is (a last update may still be on its way: a snapshot's seq says)
        wait_for(
            lambda: (s := p.status())["pending"] == {"0": 0, "1": 0} and s["stepping"] is None,
            "every step",
        )
        snaps = {}
        for f in (0, 1):
            reply, body = p.request({"kind": "snapshot", "island": "a", "fragment": f})
            snaps[f] = (reply["seq"], codec.decode(body)["values"])
        seen, last_seq = 0, 0
        while last_seq < max(seq for seq, _ in snaps.values()):
            assert sub.poll(10_000), f"only {seen} updates arrived"
            msg, body = protocol.unpack(sub.recv_multipart(), role=protocol.PUB)
            if msg["kind"] != "update":
                continue
            assert msg["mode"] == "increment" and msg["seq"] == last_seq + 1
            last_seq = msg["seq"]
            f = msg["fragment"]
            if last_seq <= snaps[f][0]:  # the snapshot of f was taken after this update
                values = codec.decode(body)["values"]
                replica[f] = np.add(replica[f], values, dtype=np.float32)
            seen += 1
        for f in (0, 1):
            assert snaps[f][1].tobytes() == replica[f].tobytes()
    finally:
        sub.close(linger=0)
