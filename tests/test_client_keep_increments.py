"""A client that keeps increments (`ClientConfig(keep="increments")`) on a fake clock.

Such a client (an island whose device exchange keeps the global values) holds
no float32 replica: the join hands the values over, every later version comes
as its increment's int8 codes, or, after a snapshot of a version the caller
does not hold, as the snapshot's values, and `take_updates` hands out every
version in order. Added up in that order they equal the shard's values bit
for bit, whatever was lost, re-snapshotted or left untaken meanwhile.
"""

from __future__ import annotations

import numpy as np
import pytest
from client_sim import Sim, SimShard
from shard_helpers import plan_for, small_flat

from paramserver.client.replica import apply_update
from paramserver.client.types import ClientConfig, JoinResult

pytestmark = pytest.mark.timeout(30)


def make_sim(fragments: int = 2) -> Sim:
    shard = SimShard(0, plan_for(small_flat(0), shards=1, fragments=fragments))
    shard.init_with(small_flat(0))
    cfg = ClientConfig(
        connect=shard.router, island="isl", keep="increments", ack_timeout_floor_s=0.1
    )
    return Sim(cfg, [shard])


def joined_sim() -> tuple[Sim, dict[int, tuple[int, np.ndarray]]]:
    """A joined sim and what its caller holds: fragment -> (version, values)."""
    sim = make_sim()
    result = sim.join(small_flat(0))
    assert isinstance(result, JoinResult), result
    plan = result.plan
    return sim, {f: (result.versions[f], plan.gather(result.params, f)) for f in result.versions}


def change(sim: Sim, fragment: int, seed: int) -> np.ndarray:
    size = sim.core.plan.fragments[fragment].size
    return np.random.default_rng(seed).normal(0.0, 0.01, size).astype(np.float32)


def follow(held: dict, updates: list) -> dict:
    """What a caller holds after taking `updates` in order (each must apply to what it holds)."""
    for u in updates:
        version, values = held[u.fragment]
        if u.values is not None:
            assert u.version >= version
            held[u.fragment] = (u.version, np.array(u.values))
        else:
            assert u.version == version + 1, (u.fragment, u.version, version)
            held[u.fragment] = (u.version, apply_update(values, "increment", u.increment.values()))
    return held


def assert_holds_the_shards_values(sim: Sim, held: dict) -> None:
    shard = sim.shards[0]
    for f, (version, values) in held.items():
        assert version == shard.versions[f]
        assert values.tobytes() == shard.values[f].tobytes(), f  # bit for bit
    assert all(state.values is None for state in sim.core.readout.replica.values())


def test_every_increment_is_handed_out_as_its_codes_in_order():
    sim, held = joined_sim()
    assert all(state.values is None for state in sim.core.readout.replica.values())
    for k in range(3):  # nothing taken meanwhile: every version waits, not only the newest
        for f in (0, 1):
            sim.publish(sim.shards[0], f, change(sim, f, 10 * k + f), increment=True)
        sim.run(0.1)
    updates = sim.core.readout.take_updates()
    assert [(u.fragment, u.version) for u in updates] == [(f, v) for f in (0, 1) for v in (1, 2, 3)]
    assert all(u.values is None and u.increment is not None for u in updates)
    assert_holds_the_shards_values(sim, follow(held, updates))
    assert sim.core.readout.take_updates() == []


def test_the_join_hands_over_the_values_with_the_increments_published_meanwhile():
    sim = make_sim()
    shard = sim.shards[0]
    held_back = {"on": True}
    sim.fault = lambda d, h: (
        "hold"
        if held_back["on"] and h["kind"] == "snapshot_reply" and h["fragment"] == 1
        else "deliver"
    )
    sim.perform(sim.core.start_join(sim.now, small_flat(0)))
    sim.run(0.2)
    assert sim.core.state == "joining" and len(sim.held) == 1  # fragment 1's snapshot
    for f in (0, 1):  # buffered while the snapshot is incomplete, then replayed onto it
        sim.publish(shard, f, change(sim, f, f), increment=True)
    sim.run(0.1)
    held_back["on"] = False
    sim.release_held()
    sim.run(0.1)
    result = sim.core.join_outcome
    assert isinstance(result, JoinResult) and result.versions == {0: 1, 1: 1}
    held = {f: (result.versions[f], result.plan.gather(result.params, f)) for f in (0, 1)}
    assert_holds_the_shards_values(sim, held)
    assert sim.core.readout.take_updates() == []  # the join returned them


def test_a_missed_update_hands_out_the_snapshots_values_then_codes_again():
    sim, held = joined_sim()
    shard = sim.shards[0]
    sim.publish(shard, 0, change(sim, 0, 1), increment=True)
    sim.run(0.1)
    dropped = []
    sim.fault = lambda d, h: (
        "drop" if h["kind"] == "update" and not dropped and not dropped.append(h) else "deliver"
    )
    sim.publish(shard, 0, change(sim, 0, 2), increment=True)  # lost
    sim.publish(shard, 0, change(sim, 0, 3), increment=True)  # a gap: re-snapshot
    sim.run(0.2)
    sim.publish(shard, 0, change(sim, 0, 4), increment=True)
    sim.run(0.1)
    updates = sim.core.readout.take_updates()
    # the increment to 1 was replaced by the snapshot's values of 3; 4 follows it as codes
    assert [(u.version, u.values is None) for u in updates] == [(3, False), (4, True)]
    assert sim.core.stats()["resyncs"] == 1
    assert_holds_the_shards_values(sim, follow(held, updates))


def test_untaken_increments_past_the_fragments_float32_size_give_way_to_a_snapshot():
    sim, held = joined_sim()
    shard, size = sim.shards[0], sim.core.plan.fragments[0].size
    versions = 6
    for k in range(versions):
        sim.publish(shard, 0, change(sim, 0, k), increment=True)
        sim.run(0.1)
    updates = sim.core.readout.take_updates()
    # at most `size` float32 bytes of codes were kept: the snapshot's values, then codes
    kept = [u.increment.nbytes for u in updates if u.values is None]
    assert updates[0].values is not None and 0 < sum(kept) <= 4 * size
    assert updates[-1].version == versions and sim.core.stats()["resyncs"] == 1
    assert_holds_the_shards_values(sim, follow(held, updates))


def test_a_re_snapshot_of_the_versions_handed_out_hands_nothing_again():
    sim, held = joined_sim()
    shard = sim.shards[0]
    sim.publish(shard, 0, change(sim, 0, 1), increment=True)
    sim.run(0.1)
    held = follow(held, sim.core.readout.take_updates())
    shard.known.clear()  # it forgot us: hello, welcome, a re-snapshot at the same versions
    sim.push(1, 4, np.zeros(sim.core.plan.fragments[1].size, np.float32))
    sim.run(0.5)
    assert sim.core.stats()["resyncs"] == 1 and sim.core.stats()["snapshots"] == 4
    assert sim.core.readout.take_updates() == []
    sim.publish(shard, 0, change(sim, 0, 2), increment=True)
    sim.run(0.1)
    updates = sim.core.readout.take_updates()
    assert [(u.version, u.values is None) for u in updates] == [(2, True)]
    assert_holds_the_shards_values(sim, follow(held, updates))


def test_a_restarted_re_snapshot_still_hands_out_the_values_the_first_one_read():
    shard = SimShard(0, plan_for(small_flat(0), shards=1, fragments=2))
    shard.init_with(small_flat(0))
    cfg = ClientConfig(connect=shard.router, island="isl", keep="increments",
                       ack_timeout_floor_s=0.1, snapshot_timeout_s=1.0)  # fmt: skip
    sim = Sim(cfg, [shard])
    result = sim.join(small_flat(0))
    held = {f: (result.versions[f], result.plan.gather(result.params, f)) for f in (0, 1)}
    sim.publish(shard, 0, change(sim, 0, 1), increment=True)
    sim.run(0.1)
    held = follow(held, sim.core.readout.take_updates())
    faults = {"drop_update": True, "hold_snapshot_of_1": True}

    def fault(direction: str, header: dict) -> str:
        if header["kind"] == "update" and faults["drop_update"]:
            faults["drop_update"] = False
            return "drop"
        if header["kind"] == "snapshot_reply" and header["fragment"] == 1:
            return "hold" if faults["hold_snapshot_of_1"] else "deliver"
        return "deliver"

    sim.fault = fault
    sim.publish(shard, 0, change(sim, 0, 2), increment=True)  # lost
    sim.publish(shard, 0, change(sim, 0, 3), increment=True)  # a gap: re-snapshot
    sim.run(0.2)  # fragment 0's snapshot (version 3) is in, fragment 1's is held back
    assert sim.core.readout.take_updates() == [] and len(sim.held) == 1
    faults["hold_snapshot_of_1"] = False
    sim.run(1.5)  # the re-snapshot times out and starts again: fragment 0 is still at 3
    assert sim.core.stats()["resyncs"] == 2
    sim.publish(shard, 0, change(sim, 0, 4), increment=True)
    sim.run(0.1)
    updates = sim.core.readout.take_updates()
    # the first read's values of 3 were not handed out yet: the second read hands them out
    assert [(u.version, u.values is None) for u in updates] == [(3, False), (4, True)]
    assert_holds_the_shards_values(sim, follow(held, updates))
