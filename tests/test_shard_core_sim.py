"""Deterministic simulations of the shard core: a fake clock, no sockets, no threads.

Each test drives `ShardCore` over a real data directory through the loop's
batch path (tests/shard_sim.py) and decides what arrives, in which order,
how often, and when time passes: lost, duplicated and reordered messages,
a failing fsync, crashes and restarts, 32 islands, quorum, grace and
liveness by the fake clock.
"""

from __future__ import annotations

import numpy as np
import pytest
from shard_sim import Island, ShardSim
from test_shard_durability import assert_same

from paramserver.server.shard import run_batch
from paramserver.wire import protocol

pytestmark = pytest.mark.timeout(60)


def _acks(replies):
    return {(conn, h["round"], h["fragment"]): h for conn, h in replies if h["kind"] == "ack"}


def test_lost_duplicated_and_reordered_pushes_are_each_applied_once(tmp_path):
    sim = ShardSim(tmp_path)
    islands = [Island(name) for name in "abcd"]
    assert sim.init(islands[0])["kind"] == "init_ok"
    for island in islands[1:]:
        assert sim.one(island.hello())["kind"] == "welcome"
    rng = np.random.default_rng(7)
    unacked = {(i.name, rnd, rnd % 2): i for i in islands for rnd in range(1, 7)}
    keys = set(unacked)
    delivered = lost_replies = 0
    for _ in range(200):
        if not unacked:
            break
        wave = [(key, island) for key, island in unacked.items() if rng.random() < 0.6]
        wave += [wave[j] for j in rng.integers(0, len(wave), len(wave) // 3)] if wave else []
        rng.shuffle(wave)  # reordered, some twice
        arriving = [(k, i) for k, i in wave if rng.random() >= 0.2]  # 20% of requests lost
        delivered += len(arriving)
        requests = [sim.push(i, rnd, fragment) for (_, rnd, fragment), i in arriving]
        acks = _acks(sim.batch(*requests))
        for (name, rnd, fragment), island in arriving:
            ack = acks[(island.conn, rnd, fragment)]
            assert ack["outcome"] in ("accepted", "duplicate"), ack
            if rng.random() < 0.2:  # the reply is lost: the island sends it again
                lost_replies += 1
                continue
            unacked.pop((name, rnd, fragment), None)
        sim.advance(0.05)
    assert not unacked and lost_replies > 0
    sim.batch()  # a last tick merges what is pending
    accepted, merged = sim.logged()
    assert sorted(accepted) == sorted(keys)  # each once in the log: none lost, none twice
    assert sorted(merged) == sorted(keys)  # each merged by exactly one step
    counters = sim.state.counters
    assert counters.accepted == len(keys) and counters.rejected == {}
    assert counters.accepted + counters.duplicates == delivered
    assert all(not f.pending for f in sim.state.fragments.values())


def test_a_failed_fsync_refuses_the_batch_and_applies_nothing(tmp_path):
    sim = ShardSim(tmp_path)
    a = Island("a")
    sim.init(a)
    assert sim.one(sim.push(a, 1))["outcome"] == "accepted"
    assert sim.state.versions() == {0: 1, 1: 0}
    published = len(sim.published)
    newcomer = Island("b")
    sim.fsync_fails = True
    replies = [h for _, h in sim.batch(
        sim.push(a, 2), sim.push(a, 1), newcomer.hello(), a.request({"kind": "status"}),
        a.request({"kind": "snapshot", "fragment": 0}),
    )]  # fmt: skip
    sim.fsync_fails = False
    fresh, duplicate, welcome, status, snapshot = replies
    for ack in (fresh, duplicate):  # both promised durability: both taken back
        assert (ack["outcome"], ack["reason"]) == ("rejected", "storage_error"), ack
        assert "Input/output error" in ack["detail"] and "send it again" in ack["detail"]
        assert ack["version"] == 1 and ack["merged_version"] is None
    assert welcome["kind"] == "welcome" and snapshot["version"] == 1  # need no disk
    assert status["kind"] == "status_reply"
    assert len(sim.published) == published  # the step of round 2 was not published
    state = sim.state
    assert state.versions() == {0: 1, 1: 0} and state.counters.accepted == 1
    assert state.dedup[("a", 0)].rounds == {1} and not state.fragments[0].pending
    assert state.counters.rejected == {"storage_error": 2}
    assert sim.logged()[0] == [("a", 1, 0)]
    # the islands and request counters survive the rebuild: no new hello needed
    assert sim.one(sim.push(newcomer, 1))["outcome"] == "accepted"
    assert sim.one(sim.push(a, 2))["outcome"] == "accepted"
    assert sim.state.versions()[0] == 3 and sim.published[-1]["version"] == 3


def test_an_init_that_cannot_be_synced_leaves_the_shard_uninitialized(tmp_path):
    sim = ShardSim(tmp_path)
    sim.fsync_fails = True
    refused = sim.init(Island("a"))
    sim.fsync_fails = False
    assert (refused["kind"], refused["reason"]) == ("rejected", "storage_error"), refused
    assert not sim.state.initialized
    assert sim.init(Island("a"))["kind"] == "init_ok"


def test_restarts_lose_no_acked_delta_and_apply_none_twice(tmp_path):
    sim = ShardSim(tmp_path, checkpoint_every_steps=2)
    islands = [Island(name) for name in ("a", "b", "c")]
    sim.init(islands[0])
    acked: set[tuple[str, int, int]] = set()
    for rnd in range(1, 9):
        for island in islands:
            sim.one(island.hello())
        requests = [sim.push(i, rnd, rnd % 2) for i in islands]
        if rnd % 4 == 1:  # the process dies with these requests received, unanswered
            sim.crash_and_restart()
        elif rnd % 4 == 2:  # durable, then the process dies before the acks go out
            sim.batch(*requests)
            before = sim.state
            sim.crash_and_restart()
            assert_same(before, sim.state)
        else:
            for conn, ack in sim.batch(*requests):
                assert ack["outcome"] == "accepted", ack
                acked.add((conn.decode()[5:], rnd, rnd % 2))
        sim.advance(1.0)
    assert list(sim.storage.dir.glob("checkpoint-*.ckpt"))  # some came from a checkpoint
    sim.crash_and_restart()
    for island in islands:
        sim.one(island.hello())
    resent = {}
    for rnd in range(1, 9):  # every island resends every round it holds unacked
        for conn, ack in sim.batch(*[sim.push(i, rnd, rnd % 2) for i in islands]):
            resent[(conn.decode()[5:], rnd, rnd % 2)] = ack["outcome"]
    assert all(resent[key] == "duplicate" for key in acked)  # none lost
    assert set(resent.values()) <= {"accepted", "duplicate"}
    state = sim.state
    assert state.counters.accepted == 3 * 8  # each key accepted once over all restarts
    for island, rnd, fragment in resent:
        assert rnd in state.dedup[(island, fragment)].rounds


def test_32_islands_quorum_then_a_grace_window_by_the_clock(tmp_path):
    sim = ShardSim(
        tmp_path, mode="quorum", quorum=4, grace_rule="fraction", grace_min_s=0.5,
        grace_max_s=0.5, heartbeat_interval_s=1.0, liveness=30,
    )  # fmt: skip
    islands = [Island(f"i{k:02d}") for k in range(32)]
    sim.init(islands[0])
    sim.batch(*[i.hello() for i in islands[1:]])
    start = sim.now
    sim.batch(*[sim.push(i, 1) for i in islands[:3]])
    assert sim.state.versions()[0] == 0  # 3 of the 4 needed
    sim.advance(0.1)
    sim.batch(sim.push(islands[3], 1))  # the quorum: the grace window starts now
    assert sim.core.next_wake(sim.now) == pytest.approx(start + 0.6)
    sim.advance(0.2)
    sim.batch(sim.push(islands[4], 1))  # within the window: merged in the same step
    sim.advance(0.299)
    sim.batch()
    assert sim.state.versions()[0] == 0
    sim.advance(0.001)
    sim.batch()
    assert sim.state.versions()[0] == 1
    assert sorted(sim.logged()[1]) == sorted((i.name, 1, 0) for i in islands[:5])
    update = sim.published[-1]
    assert (update["kind"], update["fragment"], update["version"]) == ("update", 0, 1)


def test_sync_waits_for_every_live_island_and_the_clock_declares_the_silent_one_dead(tmp_path):
    sim = ShardSim(tmp_path, mode="sync", heartbeat_interval_s=1.0, liveness=3)
    islands = [Island(f"i{k:02d}") for k in range(32)]
    sim.init(islands[0])
    sim.batch(*[i.hello() for i in islands[1:]])
    silent_since = sim.now
    sim.batch(*[sim.push(i, 1) for i in islands[:31]])  # i31 never pushes, then falls silent
    for _ in range(2):
        sim.advance(1.0)
        sim.batch(*[i.heartbeat() for i in islands[:31]])
        assert sim.state.versions()[0] == 0, "stepped without a live island"
    sim.advance(silent_since + 3.0 - sim.now)  # exactly the liveness budget: still live
    sim.batch()
    assert sim.state.versions()[0] == 0
    sim.advance(0.01)
    sim.batch()
    assert sim.state.versions()[0] == 1
    assert len(sim.logged()[1]) == 31
    assert sim.state.status(sim.now)["islands_live"] == sorted(i.name for i in islands[:31])


def test_a_silent_connection_loses_its_id_exactly_after_the_takeover_silence(tmp_path):
    # quiet_s = min(2, liveness) intervals = 0.4 s; the island itself stays live (50 intervals)
    sim = ShardSim(tmp_path, heartbeat_interval_s=0.2, liveness=50)
    old, new = Island("a", b"old"), Island("a", b"new")
    sim.init(old)
    assert sim.one(new.hello())["reason"] == "island_in_use"
    sim.advance(0.39)
    assert sim.one(new.heartbeat())["reason"] == "island_in_use"  # not yet silent long enough
    sim.advance(0.02)
    assert sim.one(new.heartbeat())["reason"] == "unknown_island"  # say hello: take it over
    assert sim.one(new.hello())["kind"] == "welcome"
    assert sim.one(sim.push(new, 1))["outcome"] == "accepted"
    assert sim.one(old.heartbeat())["reason"] == "island_in_use"


def test_an_idle_pub_heartbeats_once_per_interval_with_the_last_seq(tmp_path):
    sim = ShardSim(tmp_path, heartbeat_interval_s=1.0)
    a = Island("a")
    sim.init(a)
    sim.one(sim.push(a, 1))
    assert [p["kind"] for p in sim.published] == ["update"]
    sim.advance(0.999)
    sim.batch()
    assert len(sim.published) == 1
    sim.advance(0.001)
    sim.batch()
    sim.batch()
    assert [(p["kind"], p["seq"]) for p in sim.published] == [("update", 1), ("heartbeat", 1)]


class HeldStepWorker:
    """The step thread's place in the loop (`StepWorker`'s interface), run when the test says."""

    def __init__(self) -> None:
        self.work = None
        self.ran = False

    @property
    def busy(self) -> bool:
        return self.work is not None

    def submit(self, work) -> None:
        assert self.work is None
        self.work, self.ran = work, False

    def finish(self) -> None:
        self.work.run()
        self.ran = True

    def take(self):
        if not self.ran:
            return None
        work, self.work, self.ran = self.work, None, False
        return work


def test_requests_during_a_step_are_answered_without_changing_its_result(tmp_path):
    sim, alone = ShardSim(tmp_path / "live"), ShardSim(tmp_path / "alone")
    a, b = Island("a"), Island("b")
    for s in (sim, alone):
        assert s.init(a)["kind"] == "init_ok"
        assert s.one(b.hello())["kind"] == "welcome"
    worker = HeldStepWorker()

    def turn(*requests):
        messages = run_batch(sim.core, sim.storage, list(requests), sim.now, True, worker)
        return [sim_reply(frames) for conn, frames in messages if conn is not None], [
            sim_reply(frames, publish=True) for conn, frames in messages if conn is None
        ]

    replies, _ = turn(sim.push(a, 1))
    assert replies[0]["outcome"] == "accepted" and replies[0]["merged_version"] == 1
    assert worker.busy and sim.core.stepping.fragment == 0  # a's delta is being stepped
    replies, published = turn(
        a.heartbeat(),
        sim.push(b, 1),
        b.request({"kind": "snapshot", "fragment": 0}),  # held: fragment 0's arrays change
        sim.push(a, 1),
        a.request({"kind": "status"}),
    )
    heartbeat, ack_b, dup_a, status = replies
    assert heartbeat["kind"] == "heartbeat" and not published
    # b's delta joins the next step: version 2 is the first that includes it
    assert ack_b["outcome"] == "accepted" and (ack_b["version"], ack_b["merged_version"]) == (0, 2)
    assert dup_a["outcome"] == "duplicate" and dup_a["merged_version"] == 1  # in the step
    assert status["status"]["stepping"]["fragment"] == 0 and status["status"]["versions"]["0"] == 0
    assert sim.state.fragments[0].version == 0
    worker.finish()
    replies, published = turn()  # the step is booked, then b's delta is stepped
    (snapshot,) = replies  # the held snapshot, of version 1
    assert snapshot["kind"] == "snapshot_reply" and snapshot["version"] == 1
    assert [(p["fragment"], p["version"]) for p in published] == [(0, 1)]
    assert worker.busy and sim.core.stepping.merged_in[0].island == "b"
    # the step merged a's delta alone, as if b's had come after it
    alone.one(alone.push(a, 1))
    assert sim.state.snapshot(0)[1].tobytes() == alone.state.snapshot(0)[1].tobytes()
    worker.finish()
    _, published = turn()
    assert [(p["fragment"], p["version"]) for p in published] == [(0, 2)]
    alone.one(alone.push(b, 1))
    assert_same(sim.state, alone.state)
    accepted, merged = sim.logged()  # the log replays to the same state
    assert merged == [("a", 1, 0), ("b", 1, 0)]
    sim.crash_and_restart()
    assert_same(sim.state, alone.state)


def sim_reply(frames, publish: bool = False):
    """A message's decoded header (a reply, or a publish)."""
    return protocol.unpack(frames, protocol.PUB if publish else protocol.REPLY)[0]
