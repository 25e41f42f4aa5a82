"""A client without a replica (`ClientConfig(keep="versions")`) against real shards.

It follows versions only: its join reads no values, its updates are not
decoded, and what it holds does not grow with the model, while pushes, acks,
versions and `round_merged` work as with a replica.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from client_helpers import clients
from conftest import wait_for
from shard_helpers import delta_frames, small_flat
from shard_process import ShardProcess

from paramserver.client import ClientConfig, ClientConfigError
from paramserver.client.replica import apply_update
from paramserver.plumbing import probe

pytestmark = pytest.mark.timeout(120)

LARGE = 1 << 22  # elements of the model of the memory test: 16 MiB of float32


@pytest.fixture
def client():
    yield from clients()


def large_flat() -> dict[str, np.ndarray]:
    return {"w": np.linspace(-1.0, 1.0, LARGE, dtype=np.float32)}


def test_keep_must_be_one_of_its_choices():
    with pytest.raises(ClientConfigError, match="keep.*values, increments, versions"):
        ClientConfig(connect="tcp://127.0.0.1:5555", island="a", keep="no")


def _updates_of_every_fragment(c, fragments: int) -> dict:
    """Poll `c` until it handed out an update of each of its `fragments`: fragment -> Update."""
    got: dict = {}
    wait_for(
        lambda: got.update({u.fragment: u for u in c.poll_updates()}) or len(got) == fragments,
        f"updates of {fragments} fragments",
    )
    return got


@pytest.mark.parametrize("shards", [1, 2])
def test_without_a_replica_pushes_acks_and_versions_work_and_no_values_are_kept(
    cluster, client, shards
):
    c = cluster(shards)
    a = client(c.connect, "a")
    res = a.join(small_flat(0))
    b = client(c.connect, "b", keep="versions")
    joined = b.join(small_flat(1))
    assert joined.params == {}
    assert joined.plan.hash == res.plan.hash and joined.versions == res.versions
    assert b.stats()["snapshots"] == res.plan.num_fragments

    for fragment in range(res.plan.num_fragments):
        size = res.plan.fragments[fragment].size
        b.push(fragment, 3, joined.versions[fragment], 10, 1, delta_frames(np.ones(size, "f4")))
    wait_for(lambda: b.stats()["acked"] == res.plan.num_fragments, "b's acks")
    wait_for(lambda: b.round_merged(3), "round 3 merged, as b sees it")

    got = _updates_of_every_fragment(b, res.plan.num_fragments)
    assert {f: u.version for f, u in got.items()} == {f: v + 1 for f, v in res.versions.items()}
    assert all(u.values is None and u.increment is None for u in got.values())
    # the island with a replica got the same versions, with the values b's deltas changed
    seen = _updates_of_every_fragment(a, res.plan.num_fragments)
    for fragment, update in seen.items():
        assert update.version == got[fragment].version
        assert not np.array_equal(update.values, res.plan.gather(res.params, fragment))
    stats = b.stats()
    assert stats["version_lag"] == 0 and stats["updates_applied"] == res.plan.num_fragments
    assert stats["pending"] == 0 and stats["rejected"] == {} and stats["bad_messages"] == 0


def test_with_increments_the_codes_added_in_order_equal_the_shards_snapshot(cluster, client):
    c = cluster(2)
    a = client(c.connect, "a")
    res = a.join(small_flat(0))
    b = client(c.connect, "b", keep="increments")
    joined = b.join(small_flat(1))
    plan, fragments = joined.plan, range(joined.plan.num_fragments)
    assert joined.versions == res.versions
    assert all(joined.params[k].tobytes() == res.params[k].tobytes() for k in res.params)
    held = {f: (joined.versions[f], plan.gather(joined.params, f)) for f in fragments}
    rng = np.random.default_rng(3)
    rounds = 3
    for r in range(rounds):  # `a` pushes; `b` takes nothing meanwhile: it keeps a chain
        for f in fragments:
            delta = rng.normal(0.0, 0.01, plan.fragments[f].size).astype(np.float32)
            a.push(f, r, res.versions[f] + r, 10, 1, delta_frames(delta, "int8"))
        wait_for(lambda r=r: a.round_merged(r), f"round {r} merged")
    published = rounds * plan.num_fragments
    wait_for(lambda: b.stats()["updates_applied"] == published, "b heard every version")

    updates = b.poll_updates()
    assert len(updates) == published  # every version, not the newest of each fragment
    for u in updates:  # fragment order, then version order: each follows the one before
        version, values = held[u.fragment]
        assert u.version == version + 1 and u.values is None and u.increment is not None
        held[u.fragment] = (u.version, apply_update(values, "increment", u.increment.values()))
    _, flat, versions = probe.global_params(c.connect)
    for f in fragments:
        assert held[f][0] == versions[f] == res.versions[f] + rounds
        assert held[f][1].tobytes() == plan.gather(flat, f).tobytes()  # bit for bit
    # the island with a replica holds the same values
    seen = _updates_of_every_fragment(a, plan.num_fragments)
    assert all(seen[f].values.tobytes() == held[f][1].tobytes() for f in fragments)
    stats = b.stats()
    assert stats["version_lag"] == 0 and stats["resyncs"] == 0 and stats["bad_messages"] == 0


def _traced_peak(client, connect: str, island: str, frames: dict, **overrides) -> int:
    """Peak bytes Python allocated while one client joined, pushed a round and saw it merged.

    Its parameters and the delta frames are made before; the shard is another process, and
    the client is closed afterwards. With `keep="increments"` the join (whose values are
    the caller's) is not counted: from its end on, the client should hold no copy.
    """
    flat = {"w": np.zeros(LARGE, np.float32)}
    # slow heartbeats: a loaded machine must not make it reconnect (a re-snapshot reads values)
    c = client(connect, island, heartbeat_interval_s=2.0, reconnect_cap_s=10.0, **overrides)
    after_join = overrides.get("keep") == "increments"
    if not after_join:
        tracemalloc.start()
    try:
        res = c.join(flat)
        if after_join:
            tracemalloc.start()
        for fragment, delta in frames.items():
            c.push(fragment, 1, res.versions[fragment], 10, 1, delta)
        wait_for(lambda: c.round_merged(1), f"{island}'s round merged", timeout_s=60)
        updates = c.poll_updates()
        assert len(updates) == len(frames)
        if after_join:
            assert all(u.values is None and u.increment is not None for u in updates)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        c.close()  # it must not decode the next client's updates while that one is measured


def test_a_client_without_a_replica_holds_no_copy_of_the_model(tmp_path, zmq_ctx, client):
    shard = ShardProcess(
        tmp_path / "data", "--mode", "async", "--fragments", "4", "--checkpoint-every-s", "0"
    )
    try:
        shard.wait_ready(zmq_ctx)
        first = client(shard.router, "init")
        res = first.join(large_flat())
        first.close()
        sizes = {f.index: f.size for f in res.plan.fragments}
        frames = {f: delta_frames(np.full(n, 1e-3, "f4"), "int8") for f, n in sizes.items()}
        model_bytes = 4 * LARGE
        # the control: with a replica, the client allocates at least the model
        assert _traced_peak(client, shard.router, "with", frames) >= model_bytes
        assert _traced_peak(client, shard.router, "versions", frames, keep="versions") < (
            model_bytes / 4
        )
        # int8 codes of every fragment's increment: a quarter of the model, and no float32
        assert _traced_peak(client, shard.router, "increments", frames, keep="increments") < (
            model_bytes / 2
        )
    finally:
        shard.stop()
