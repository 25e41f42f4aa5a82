"""The island's replica and Clone-pattern feed: snapshots, sequenced updates, gaps, deltas."""

import numpy as np
import pytest

from paramserver.client.replica import Published, Resync, ShardFeed, apply_update


def vec(*xs):
    return np.array(xs, dtype=np.float32)


def fragments(updates):
    return [u.fragment for u in updates]


def synced_feed(seq=5):
    replica = {}
    feed = ShardFeed(0, (0, 2), replica)
    assert feed.begin_sync(0.0) == [0, 2]
    assert fragments(feed.on_snapshot(0, 3, seq, vec(1, 2))) == [0]
    assert fragments(feed.on_snapshot(2, 7, seq, vec(5))) == [2]
    assert not feed.syncing and feed.last_seq == seq
    return feed, replica


def test_apply_update_full_and_delta_bit_exact():
    cur = vec(1.0, 2.0, 1e-8)
    change = vec(0.1, -2.0, 1.0)
    out = apply_update(cur, "increment", change)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, np.add(cur, change, dtype=np.float32))
    assert cur[0] == np.float32(1.0)  # not modified
    full = apply_update(cur, "full", change)
    np.testing.assert_array_equal(full, change)
    assert full is not change
    with pytest.raises(ValueError, match="unknown update mode"):
        apply_update(cur, "half", change)
    with pytest.raises(ValueError, match="needs current values"):
        apply_update(None, "increment", change)


def test_in_order_updates_apply_and_old_versions_are_dropped():
    feed, replica = synced_feed()
    assert fragments(feed.on_update(Published(6, 0, 4, "full", vec(9, 9)))) == [0]
    assert replica[0].version == 4
    assert fragments(feed.on_update(Published(7, 2, 8, "increment", vec(1)))) == [2]
    np.testing.assert_array_equal(replica[2].values, vec(6))
    assert fragments(feed.on_update(Published(8, 0, 4, "full", vec(0, 0)))) == []  # not newer
    np.testing.assert_array_equal(replica[0].values, vec(9, 9))


def test_gap_and_restarted_stream_ask_for_resync():
    feed, _ = synced_feed()
    with pytest.raises(Resync, match="missed updates"):
        feed.on_update(Published(7, 0, 4, "full", vec(0, 0)))
    feed, _ = synced_feed()
    with pytest.raises(Resync):
        feed.on_update(Published(1, 0, 4, "full", vec(0, 0)))  # shard restarted its seq
    feed, _ = synced_feed()
    feed.on_heartbeat(5)
    with pytest.raises(Resync, match="heartbeat seq 6"):
        feed.on_heartbeat(6)


def test_delta_that_skips_a_version_asks_for_resync():
    feed, _ = synced_feed()
    with pytest.raises(Resync, match="delta to version 5"):
        feed.on_update(Published(6, 0, 5, "increment", vec(1, 1)))


def test_updates_buffered_during_sync_replay_only_newer_than_snapshot():
    replica = {}
    feed = ShardFeed(1, (1, 3), replica)
    feed.begin_sync(0.0)
    # Snapshot of 1 includes seq 10; seq 11 updates fragment 1, seq 12 fragment 3,
    # which the snapshot of 3 (taken at seq 12) already includes.
    assert fragments(feed.on_update(Published(11, 1, 4, "increment", vec(1)))) == []
    assert fragments(feed.on_update(Published(12, 3, 9, "full", vec(7)))) == []
    assert fragments(feed.on_snapshot(1, 3, 10, vec(10))) == [1]
    assert fragments(feed.on_snapshot(3, 9, 12, vec(7))) == [3, 1]
    assert replica[1].version == 4
    np.testing.assert_array_equal(replica[1].values, vec(11))
    assert feed.last_seq == 12
    assert fragments(feed.on_update(Published(13, 3, 10, "full", vec(8)))) == [3]


def test_hole_between_snapshots_asks_for_resync():
    feed = ShardFeed(0, (0, 1), {})
    feed.begin_sync(0.0)
    feed.on_update(Published(12, 1, 2, "full", vec(1)))
    feed.on_snapshot(0, 1, 10, vec(0))
    with pytest.raises(Resync, match="seq 11 missing"):
        feed.on_snapshot(1, 2, 12, vec(1))
    feed = ShardFeed(0, (0, 1), {})
    feed.begin_sync(0.0)
    feed.on_snapshot(0, 1, 10, vec(0))
    with pytest.raises(Resync, match="up to seq 12"):
        feed.on_snapshot(1, 2, 12, vec(1))


def test_snapshot_is_authoritative_and_unasked_snapshots_are_ignored():
    feed, replica = synced_feed()
    assert fragments(feed.on_snapshot(0, 99, 5, vec(0, 0))) == []  # not awaited
    feed.begin_sync(1.0)
    assert fragments(feed.on_snapshot(0, 2, 1, vec(4, 4))) == [0]  # older version after a restart
    assert replica[0].version == 2


def test_update_for_a_foreign_fragment_asks_for_resync():
    feed, _ = synced_feed()
    with pytest.raises(Resync, match="does not own"):
        feed.on_update(Published(6, 1, 1, "full", vec(1)))
