"""The client's sans-I/O core against scripted shards on a fake clock (no sockets, no threads).

Each test drives `ClientCore` through `client_sim.Sim`: message loss,
duplication, reordering, a shard that falls silent and restarts, re-send
timing of the adaptive ack timeout, back-pressure, the join through its
states, many shards. Every time here is the fake clock's, so nothing depends
on the machine's speed.
"""

from __future__ import annotations

import numpy as np
import pytest
from client_sim import Sim, SimShard
from shard_helpers import plan_for, small_flat

from paramserver.client.types import ClientConfig, ClientError, JoinResult, PlanMismatch

pytestmark = pytest.mark.timeout(30)


def make_sim(shards=1, fragments=2, initialized_with=None, **overrides) -> Sim:
    """A sim of `shards` shards; initialised with `initialized_with` (None: empty cluster)."""
    plan = plan_for(small_flat(0), shards=shards, fragments=fragments)
    sims = [SimShard(i, plan) for i in range(shards)]
    if initialized_with is not None:
        for s in sims:
            s.init_with(initialized_with)
    settings = {"ack_timeout_s": 1.0, "ack_timeout_floor_s": 0.1, **overrides}
    return Sim(ClientConfig(connect=sims[0].router, island="isl", **settings), sims)


def joined_sim(**kw) -> tuple[Sim, JoinResult]:
    sim = make_sim(initialized_with=small_flat(0), **kw)
    result = sim.join(small_flat(0))
    assert isinstance(result, JoinResult), result
    return sim, result


def delta(sim: Sim, fragment: int, value: float = 0.01) -> np.ndarray:
    return np.full(sim.core.plan.fragments[fragment].size, value, np.float32)


# -- the join through its states ----------------------------------------------------------


def test_a_join_of_an_empty_cluster_inits_every_shard_in_order_then_snapshots_it():
    sim = make_sim(shards=3, fragments=6)
    mine = small_flat(0)
    result = sim.join(mine)
    assert isinstance(result, JoinResult), result
    kinds = [h["kind"] for h in sim.sent]
    assert kinds[:3] == ["hello"] * 3  # the configured shard, then the two others
    inits = [to for to, h in zip(sim.sent_to, sim.sent, strict=True) if h["kind"] == "init_begin"]
    assert inits == [s.router for s in sim.shards]  # shard 0 first, in index order
    assert sorted(h["fragment"] for h in sim.kinds("snapshot")) == list(range(6))
    last_piece = max(i for i, k in enumerate(kinds) if k == "init_piece")
    assert all(last_piece < i for i, k in enumerate(kinds) if k == "snapshot")
    # Clone pattern: every shard's SUB is opened before its fragments are snapshotted
    assert [e for role, e in sim.opened if role == "sub"] == [s.pub for s in sim.shards]
    for name, value in mine.items():
        np.testing.assert_array_equal(result.params[name], value)
    assert result.versions == {f: 0 for f in range(6)} and result.mode == "async"
    assert sim.core.joined


def test_a_join_of_an_initialised_cluster_sends_no_init_and_takes_the_clusters_values():
    theirs = small_flat(1)
    sim = make_sim(shards=2, fragments=4, initialized_with=theirs)
    result = sim.join(small_flat(0))  # same shapes, other values
    assert not sim.kinds("init_begin") and not sim.kinds("init_piece")
    for name, value in theirs.items():
        np.testing.assert_array_equal(result.params[name], value)


def test_a_plan_mismatch_fails_the_join_and_closes_every_link():
    other = {"x": np.zeros(9, np.float32)}  # another model
    sim = make_sim(shards=2, initialized_with=small_flat(0))
    outcome = sim.join(other)
    assert isinstance(outcome, PlanMismatch) and "plan mismatch" in str(outcome)
    assert outcome.cluster_hash and outcome.cluster_hash != outcome.island_hash
    assert sorted(leaf.path for leaf in outcome.cluster_leaves) == sorted(small_flat(0))
    assert outcome.detail  # the first leaf that differs, in words
    assert sim.links == {} and not sim.core.joined and sim.core.state == "idle"


def test_unanswered_hellos_are_re_sent_every_ack_timeout_until_the_join_times_out():
    sim = make_sim(join_timeout_s=5.0, ack_timeout_s=1.0)
    sim.shards[0].answering = False
    outcome = sim.join(small_flat(0))
    assert isinstance(outcome, ClientError)
    assert "no hello reply from shard at inproc://shard-0-router within 5s" in str(outcome)
    times = sim.times("hello")
    assert len(times) == 5  # at 0 and then once per second until the 5 s deadline
    assert all(b - a >= 1.0 for a, b in zip(times, times[1:], strict=False))
    assert sim.now <= 5.0 + 0.1  # failed at the deadline, not later


def test_an_id_in_use_is_asked_again_every_0_2_s_and_fails_after_in_use_wait():
    sim = make_sim(in_use_wait_s=1.0)
    sim.shards[0].refuse["hello"] = {"reason": "island_in_use", "detail": "live elsewhere"}
    outcome = sim.join(small_flat(0))
    assert isinstance(outcome, ClientError) and "in use by another running island" in str(outcome)
    times = sim.times("hello")
    assert all(b - a >= 0.2 - 1e-9 for a, b in zip(times, times[1:], strict=False))
    assert 1.0 <= times[-1] < 1.0 + 0.2 + 0.1 and len(times) in (5, 6)


def test_an_id_freed_during_the_in_use_wait_joins():
    sim = make_sim(in_use_wait_s=5.0, initialized_with=small_flat(0))
    sim.shards[0].refuse["hello"] = {"reason": "island_in_use", "detail": "live elsewhere"}
    sim.perform(sim.core.start_join(sim.now, small_flat(0)))
    sim.run(1.0)
    assert sim.core.join_outcome is None  # still asking
    del sim.shards[0].refuse["hello"]  # the old connection fell silent
    sim.run(0.5)
    assert isinstance(sim.core.join_outcome, JoinResult)


def test_a_half_initialised_cluster_is_completed_after_init_grace():
    theirs, mine = small_flat(1), small_flat(0)
    sim = make_sim(shards=2, fragments=4, init_grace_s=1.0)
    sim.shards[0].init_with(theirs)  # another island initialised shard 0, then died
    result = sim.join(mine)
    assert isinstance(result, JoinResult), result
    (init,) = sim.kinds("init_begin")
    at = sim.times("init_begin")[0]
    assert 1.0 <= at < 1.0 + 0.3  # after the grace, asking every 0.2 s meanwhile
    assert len(sim.kinds("hello")) >= 1 + 1 + 4  # first, shard 1, then its re-asks
    plan = sim.core.plan
    for f in plan.fragments:
        source = theirs if f.shard == 0 else mine
        np.testing.assert_array_equal(
            sim.shards[f.shard].values[f.index], plan.gather(source, f.index)
        )


def test_an_init_and_snapshots_go_in_pieces_and_a_lost_piece_and_reply_are_sent_again():
    flat = {"w": np.random.default_rng(3).standard_normal(5000).astype(np.float32)}
    plan = plan_for(flat, shards=1, fragments=2)  # 2500 elements a fragment
    shard = SimShard(0, plan, max_message_bytes=4096)  # pieces of 896 elements: 3 a fragment
    sim = Sim(ClientConfig(connect=shard.router, island="isl", ack_timeout_s=1.0), [shard])
    lost = {"up": 1, "down": 1}

    def fault(direction, header):
        kind = "init_piece" if direction == "up" else "init_piece_ok"
        if header["kind"] == kind and header.get("offset") == 896 and lost[direction]:
            lost[direction] -= 1
            return "drop"
        return "deliver"

    sim.fault = fault
    result = sim.join(flat)
    assert isinstance(result, JoinResult), result
    assert lost == {"up": 0, "down": 0}
    pieces = [(h["fragment"], h["offset"]) for h in sim.kinds("init_piece")]
    cut = [(f, o) for f in (0, 1) for o in (0, 896, 1792)]
    assert sorted(set(pieces)) == cut and len(pieces) == len(cut) + 2  # two re-sends
    (first, again) = [
        t
        for t, h in zip(sim.sent_at, sim.sent, strict=True)
        if h["kind"] == "init_piece" and (h["fragment"], h["offset"]) == (0, 896)
    ]
    assert 1.0 <= again - first < 1.2  # after the ack timeout  # fmt: skip
    assert all(h["plan_hash"] == plan.hash for h in sim.kinds("init_piece"))
    asked = sorted((h["fragment"], h["offset"], h["count"]) for h in sim.kinds("snapshot"))
    assert asked == [(f, o, 708 if o == 1792 else 896) for f, o in cut]
    assert result.params["w"].tobytes() == flat["w"].tobytes()


def test_an_init_piece_refused_storage_error_is_sent_again_after_the_ack_timeout():
    sim = make_sim(ack_timeout_s=1.0)
    shard = sim.shards[0]
    shard.refuse["init_piece"] = {"reason": "storage_error", "detail": "disk full"}
    sim.perform(sim.core.start_join(sim.now, small_flat(0)))
    sim.run(0.5)
    assert sim.core.join_outcome is None and len(sim.kinds("init_piece")) == 2  # the window
    del shard.refuse["init_piece"]  # the disk has room again
    sim.run(1.0)
    result = sim.core.join_outcome
    assert isinstance(result, JoinResult), result
    assert len(sim.kinds("init_piece")) == 4 and 1.0 <= sim.times("init_piece")[2] < 1.2
    for name, value in small_flat(0).items():
        np.testing.assert_array_equal(result.params[name], value)


def test_a_hello_refused_throttled_is_sent_again_after_retry_after_s_and_the_join_goes_on():
    sim = make_sim(ack_timeout_s=5.0)
    shard = sim.shards[0]
    shard.refuse["hello"] = {"reason": "throttled", "detail": "over", "retry_after_s": 0.3}
    sim.perform(sim.core.start_join(sim.now, small_flat(0)))
    sim.run(0.2)
    assert sim.core.join_outcome is None and len(sim.kinds("hello")) == 1  # not failed: later
    del shard.refuse["hello"]
    sim.run(1.0)
    assert isinstance(sim.core.join_outcome, JoinResult), sim.core.join_outcome
    first, again = sim.times("hello")[:2]
    assert 0.3 <= again - first < 0.5  # after retry_after_s (the reply took a tick), not 5 s


def test_an_unanswered_init_piece_is_re_sent_with_a_doubling_back_off():
    sim = make_sim(ack_timeout_s=1.0, ack_timeout_cap_s=2.0, join_timeout_s=9.0)
    sim.shards[0].max_message_bytes = 200  # pieces of 43 elements: 2 a fragment
    sim.fault = lambda direction, h: "drop" if h["kind"] == "init_piece_ok" else "deliver"
    outcome = sim.join(small_flat(0))
    assert isinstance(outcome, ClientError)  # every piece's reply is lost: the join times out
    first = [t for t, h in zip(sim.sent_at, sim.sent, strict=True)
             if h["kind"] == "init_piece" and (h["fragment"], h["offset"]) == (0, 0)]  # fmt: skip
    gaps = [b - a for a, b in zip(first, first[1:], strict=False)]
    assert len(gaps) == 4, gaps  # doubling, capped at ack_timeout_cap_s (ticks of 0.05 s)
    assert all(w <= g < w + 0.11 for g, w in zip(gaps, (1.0, 2.0, 2.0, 2.0), strict=True)), gaps


def test_snapshot_pieces_and_updates_published_meanwhile_are_replayed_in_order():
    sim = make_sim(fragments=2, initialized_with=small_flat(0))
    shard = sim.shards[0]
    held = {"on": True}
    sim.fault = lambda d, h: (
        "hold" if held["on"] and h["kind"] == "snapshot_reply" and h["fragment"] == 1 else "deliver"
    )
    sim.perform(sim.core.start_join(sim.now, small_flat(0)))
    sim.run(0.2)
    assert sim.core.state == "joining" and len(sim.held) == 1  # fragment 1's snapshot (seq 0)
    new = np.arange(sim.core.plan.fragments[1].size, dtype=np.float32)
    sim.publish(shard, 1, new)  # seq 1: buffered while the snapshot is incomplete
    sim.run(0.1)
    assert sim.core.join_outcome is None
    held["on"] = False
    sim.release_held()
    sim.run(0.1)
    result = sim.core.join_outcome
    assert isinstance(result, JoinResult) and result.versions == {0: 0, 1: 1}
    values = np.zeros(sim.core.plan.fragments[1].size, np.float32)
    assert sim.core.readout.replica[1].version == 1
    np.testing.assert_array_equal(sim.core.readout.replica[1].values, new + values)


def test_a_lost_snapshot_piece_is_asked_again_after_snapshot_timeout():
    sim = make_sim(fragments=2, initialized_with=small_flat(0), snapshot_timeout_s=2.0)
    lost = []

    def drop_one(direction, header):
        if header["kind"] == "snapshot_reply" and header["fragment"] == 1 and not lost:
            lost.append(header)
            return "drop"
        return "deliver"

    sim.fault = drop_one
    result = sim.join(small_flat(0))
    assert isinstance(result, JoinResult) and lost
    asked = [t for t, h in zip(sim.sent_at, sim.sent, strict=True) if h["kind"] == "snapshot"]
    assert len(asked) == 4  # both fragments, twice: a re-sync asks for the whole shard
    assert asked[2] - asked[0] > 2.0


# -- pushes: loss, duplication, reordering, re-send timing --------------------------------


def test_a_lost_push_is_re_sent_after_the_ack_timeout_and_acked_once():
    sim, _ = joined_sim(ack_timeout_s=1.0)
    lost = {"n": 0}

    def drop_first_push(direction, header):
        if direction == "up" and header["kind"] == "push" and lost["n"] == 0:
            lost["n"] += 1
            return "drop"
        return "deliver"

    sim.fault = drop_first_push
    pushed_at = sim.now
    sim.push(0, 1, delta(sim, 0))
    sim.run(2.0)
    times = sim.times("push")
    assert len(times) == 2 and times[1] - pushed_at == pytest.approx(1.0)
    stats = sim.core.stats()
    assert stats["resent"] == 1 and stats["acked"] == 1 and stats["pending"] == 0
    assert len(sim.shards[0].keys) == 1


def test_a_duplicated_push_is_resolved_once_and_not_re_sent():
    sim, _ = joined_sim()
    sim.fault = lambda d, h: "twice" if d == "up" and h["kind"] == "push" else "deliver"
    sim.push(0, 1, delta(sim, 0))
    sim.run(3.0)
    stats = sim.core.stats()
    assert stats["acked"] == 1 and stats["pending"] == 0 and stats["resent"] == 0
    assert len(sim.kinds("push")) == 1


def test_acks_that_arrive_out_of_order_resolve_each_delta():
    sim, _ = joined_sim(ack_timeout_s=5.0)
    sim.fault = lambda d, h: "hold" if h["kind"] == "ack" else "deliver"
    for r in range(3):
        sim.push(r % 2, r, delta(sim, r % 2))
    assert sim.core.stats()["pending"] == 3 and len(sim.held) == 3
    sim.release_held(reverse=True)
    sim.pump()
    stats = sim.core.stats()
    assert stats["acked"] == 3 and stats["pending"] == 0 and stats["resent"] == 0
    assert len(sim.core.readout.take_ack_latencies()) == 3


def test_acks_later_than_the_initial_timeout_stop_being_re_sent_once_measured():
    # every ack takes 0.8 s, above the initial 0.5 s timeout: round 0's delta is re-sent
    # once; the shard answers `duplicate` to that copy, which proves the re-send needless
    # and teaches the timer the 0.8 s latency (RFC 4015): later rounds are never re-sent
    sim, _ = joined_sim(ack_timeout_s=0.5, ack_timeout_cap_s=10.0, liveness=50)
    sim.fault = lambda d, h: "hold" if h["kind"] == "ack" else "deliver"
    resent = []
    for r in range(9):
        sim.push(0, r, delta(sim, 0))
        sim.run(0.8)
        sim.release_held()
        sim.pump()
        resent.append(sim.core.stats()["resent"])
    assert resent == [1] * 9
    stats = sim.core.stats()
    assert stats["acked"] == 9 and stats["spurious_resends"] == 1 and stats["duplicates"] == 0
    # SRTT 0.8 and RTTVAR 0.4 from the spurious re-send, then 8 samples of 0.8 s each
    # shrink RTTVAR by 3/4: the timeout is SRTT + 4 RTTVAR
    assert stats["ack_timeout_s"] == pytest.approx(0.8 + 4 * 0.4 * 0.75**8)


def test_unacked_deltas_are_re_sent_with_a_doubling_back_off():
    sim, _ = joined_sim(ack_timeout_s=1.0, ack_timeout_cap_s=4.0, liveness=100)
    sim.fault = lambda d, h: "drop" if d == "up" and h["kind"] == "push" else "deliver"
    start = sim.now
    sim.push(0, 1, delta(sim, 0))
    sim.run(12.0)
    gaps = np.diff([start, *sim.times("push")]).round(6).tolist()
    assert gaps[:5] == [0.0, 1.0, 2.0, 4.0, 4.0]  # doubling, capped at 4 s


def test_a_refused_for_now_delta_waits_for_its_fragment_to_step():
    sim, _ = joined_sim(ack_timeout_s=5.0, ack_timeout_floor_s=2.0)
    shard = sim.shards[0]
    shard.push_refusals.append("too_many_pending")  # its buffer for this island is full
    sim.push(0, 1, delta(sim, 0))
    stats = sim.core.stats()
    assert stats["pending"] == 1 and stats["deferred"] == 1  # kept: back-pressure, not loss
    sim.run(1.0)
    assert len(sim.kinds("push")) == 1  # not re-sent before the fragment steps
    sim.publish(shard, 0, shard.values[0] + 1)
    sim.pump()
    assert len(sim.kinds("push")) == 2 and sim.core.stats()["pending"] == 0


def test_a_throttled_push_is_re_sent_after_the_acks_retry_after_s():
    sim, _ = joined_sim(ack_timeout_s=5.0, ack_timeout_floor_s=2.0)
    shard = sim.shards[0]
    shard.push_refusals.append({"reason": "throttled", "retry_after_s": 0.3})
    pushed_at = sim.now
    sim.push(0, 1, delta(sim, 0))
    assert sim.core.stats()["pending"] == 1  # kept, not lost
    sim.run(1.0)
    times = sim.times("push")
    # again after the shard's 0.3 s (ticks of 0.05 s), not the ledger's 1 s default nor 5 s
    assert len(times) == 2 and 0.3 <= times[1] - pushed_at < 0.4, times
    assert sim.core.stats()["pending"] == 0 and len(shard.keys) == 1


def test_pending_counts_every_unacked_delta_up_to_max_unacked():
    sim, _ = joined_sim(max_unacked=3)
    sim.shards[0].answering = False
    for r in range(3):
        sim.push(0, r, delta(sim, 0))
    assert sim.core.stats()["pending"] == 3 == len(sim.core.ledger)  # Client.push blocks now
    sim.push(0, 2, delta(sim, 0))  # the same round again: ignored, not counted twice
    assert sim.core.stats()["pending"] == 3


# -- a shard that falls silent, restarts, forgets us --------------------------------------


def test_a_silent_shard_is_reconnected_and_its_pending_deltas_re_sent():
    sim, _ = joined_sim(heartbeat_interval_s=1.0, liveness=5, ack_timeout_s=30.0)
    shard = sim.shards[0]
    shard.answering = False
    silent_from = sim.now
    sim.push(0, 1, delta(sim, 0))
    dealers_before = [e for role, e in sim.opened if role == "dealer"]
    sim.run(5.0)
    assert sim.core.stats()["reconnects"] == 0  # silent for 5 intervals is not yet dead
    sim.run(0.2)
    assert sim.core.stats()["reconnects"] == 1 and sim.core.stats()["shards_down"] == 1
    assert len([e for role, e in sim.opened if role == "dealer"]) == len(dealers_before) + 1
    assert sim.times("hello")[-1] - silent_from > 5.0
    shard.restart()
    shard.answering = True
    sim.run(3.0)
    stats = sim.core.stats()
    assert stats["acked"] == 1 and stats["pending"] == 0 and stats["shards_down"] == 0
    assert stats["resyncs"] >= 1 and len(shard.keys) == 1


def test_a_shard_that_forgot_the_island_gets_a_hello_then_the_delta_again():
    sim, _ = joined_sim(ack_timeout_s=30.0)
    shard = sim.shards[0]
    shard.known.clear()  # restarted between two heartbeats
    sim.push(1, 4, delta(sim, 1))
    sim.run(0.2)
    kinds = [h["kind"] for h in sim.sent if not h.get("attach")]  # a bulk link's hello aside
    first = kinds.index("push")
    # the welcome re-sends the delta, then re-snapshots the shard
    assert kinds[first : first + 5] == ["push", "hello", "push", "snapshot", "snapshot"]
    stats = sim.core.stats()
    assert stats["acked"] == 1 and stats["pending"] == 0 and stats["rejected"] == {}


# -- many shards, close -------------------------------------------------------------------


def test_many_shards_each_get_their_fragments_deltas_and_rounds_merge():
    sim = make_sim(shards=4, fragments=8, initialized_with=small_flat(0))
    assert isinstance(sim.join(small_flat(0)), JoinResult)
    plan = sim.core.plan
    for f in range(8):
        sim.push(f, 7, delta(sim, f))
    pushes = [
        (h["fragment"], to)
        for h, to in zip(sim.sent, sim.sent_to, strict=True)
        if h["kind"] == "push"
    ]
    assert sorted(pushes) == [(f, sim.shards[plan.fragments[f].shard].router) for f in range(8)]
    assert sim.core.stats()["acked"] == 8
    assert not sim.core.readout.round_merged(7)  # acked, not yet in the replica
    for f in range(8):
        shard = sim.shards[plan.fragments[f].shard]
        sim.publish(shard, f, shard.values[f] - 1)
    sim.pump()
    assert sim.core.readout.round_merged(7)
    assert [u.fragment for u in sim.core.readout.take_updates()] == list(range(8))


def test_close_waits_for_acks_while_their_shard_is_up_then_hands_the_deltas_back():
    sim, _ = joined_sim(liveness=100)
    sim.shards[0].answering = False
    sim.push(0, 3, delta(sim, 0, 0.5))
    sim.perform(sim.core.begin_close(sim.now, 2.0))
    sim.run(1.9)
    assert not sim.core.closed  # the shard is up: wait for the ack
    sim.run(0.2)
    assert sim.core.closed and sim.links == {}
    (kept,) = sim.core.dropped
    assert (kept.fragment, kept.round, kept.tokens, kept.steps) == (0, 3, 100, 10)
    assert sim.kinds("bye")


def test_close_does_not_wait_for_a_shard_that_is_down():
    sim, _ = joined_sim(heartbeat_interval_s=1.0, liveness=2)
    sim.shards[0].answering = False
    sim.push(0, 3, delta(sim, 0))
    sim.run(3.0)
    assert sim.core.stats()["shards_down"] == 1
    sim.perform(sim.core.begin_close(sim.now, 3600.0))
    assert sim.core.closed and len(sim.core.dropped) == 1


# -- the core decides without I/O ---------------------------------------------------------

DECIDING = (
    "core", "joining", "handshake", "welcome", "ledger", "replica", "shards", "types",
)  # fmt: skip


@pytest.mark.parametrize("module", DECIDING)
def test_the_client_modules_that_decide_import_no_sockets_threads_or_clock(module):
    import ast
    from pathlib import Path

    path = Path(__file__).parents[1] / "paramserver" / "client" / f"{module}.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert not names & {"zmq", "threading", "time", "queue", "socket"}, (module, names)


def test_a_push_says_the_islands_own_h_once_it_is_known():
    sim, _ = joined_sim()
    sim.push(0, 1, delta(sim, 0))
    sim.run(1.0)
    assert "inner_steps" not in sim.kinds("push")[0]  # not said: the shards infer nothing
    sim.core.step_time_s, sim.core.inner_steps = 0.1, 20  # what report_step_time sets
    sim.push(0, 2, delta(sim, 0), base_version=1)
    sim.run(1.0)
    assert sim.kinds("push")[1]["inner_steps"] == 20
