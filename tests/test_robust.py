"""Robust aggregation: the pure clip decision, and a shard that keeps one poisoned island in check."""

from __future__ import annotations

import numpy as np
import pytest
from shard_helpers import delta_frames, init_payload, plan_for, push_header, small_flat

from paramserver.server.config import ConfigError, ShardConfig
from paramserver.server.state import ShardState
from paramserver.server.step.weighting import clip, clip_factor, l2_norm
from paramserver.server.storage.checkpoint import export_state, restore_state
from paramserver.wire.protocol import ACCEPTED

T0 = 1_000_000.0


def test_clip_factor():
    assert clip_factor(10.0, [1.0, 1.0, 2.0], 3.0) == 1.0  # history too short
    assert clip_factor(10.0, [1.0, 1.0, 2.0, 2.0], 0.0) == 1.0  # off
    assert clip_factor(2.0, [1.0, 1.0, 2.0, 2.0], 3.0) == 1.0  # within the bound
    assert clip_factor(45.0, [1.0, 1.0, 2.0, 2.0], 3.0) == pytest.approx(4.5 / 45.0)
    assert clip_factor(0.0, [1.0] * 8, 3.0) == 1.0
    assert l2_norm(np.array([3.0, 4.0], np.float32)) == pytest.approx(5.0)


def test_config_validates_the_multiple():
    with pytest.raises(ConfigError, match="clip_norm_multiple"):
        ShardConfig(clip_norm_multiple=0.5)
    assert ShardConfig().clip_norm_multiple == 10.0  # on by default


def _run(multiple: float, poison: float):
    """Two honest islands for 6 rounds, then a third sends a delta `poison` times too big."""
    cfg = ShardConfig(
        mode="sync", fsync=False, clip_norm_multiple=multiple, max_delta_norm_ratio=0.0
    )  # the relative clip alone (the absolute bound would refuse the poison)
    flat = small_flat()
    plan = plan_for(flat, 1, 2)
    state = ShardState(cfg, 0)
    events = [state.initialize(plan.to_wire(), init_payload(plan, flat)).event]
    rng = np.random.default_rng(0)
    size = plan.fragments[0].size
    honest = ("a", "b")
    for island in (*honest, "evil"):
        state.hello(island, T0)
    for rnd in range(1, 8):
        pushers = honest if rnd < 7 else (*honest, "evil")
        for island in pushers:
            v = (rng.standard_normal(size) * 0.01).astype(np.float32)
            if island == "evil":
                v *= poison
            h = push_header(plan, island, rnd, 0, state.versions()[0])
            out = state.submit_delta(h, delta_frames(v), T0)
            assert out.status == ACCEPTED, out
            events.append(out.event)
        if rnd < 7:  # "evil" is silent until its attack: step the honest rounds by hand
            events.append(state.step(0, T0)[0])
    events.append(state.step(0, T0)[0])
    return state, events, flat, plan


def test_one_poisoned_island_cannot_wreck_the_model():
    _, _, flat, plan = _run(3.0, 1.0)
    before = plan.gather(flat, 0)
    clipped, events, _, _ = _run(3.0, 1e4)
    wrecked, _, _, _ = _run(0.0, 1e4)
    moved_clipped = np.abs(clipped.snapshot(0)[1] - before).max()
    moved_wrecked = np.abs(wrecked.snapshot(0)[1] - before).max()
    assert clipped.counters.clipped == 1 and wrecked.counters.clipped == 0
    assert moved_wrecked > 100 * moved_clipped
    assert moved_clipped < 1.0  # honest deltas are ~0.01 per element
    assert clipped.status(T0)["clipped"] == 1

    # replaying the log clips the same delta the same way, bit for bit
    replica = ShardState(clipped.cfg, 0)
    for event in events:
        replica.apply(event)
    assert replica.snapshot(0)[1].tobytes() == clipped.snapshot(0)[1].tobytes()
    assert replica.counters.clipped == 1

    # a checkpoint keeps the recent norms, so the bound survives a restart
    meta, arrays = export_state(clipped)
    restored = restore_state(clipped.cfg, 0, meta, arrays)
    assert restored.fragments[0].norms == clipped.fragments[0].norms
    assert restored.counters.clipped == 1


def test_clip_keeps_the_clipped_norm_in_a_bounded_history():
    recent = [1.0] * 32
    delta = np.full(4, 5.0, np.float32)  # norm 10
    norm, factor, kept = clip(delta, recent, multiple=2.0)
    assert norm == 10.0 and factor == 0.2  # bound 2 x median 1 = 2
    assert len(kept) == 32 and kept[-1] == 2.0 and recent == [1.0] * 32
