"""The client's outbox ledger: ack decisions, re-send timing and deferrals, with explicit time."""

import pytest

from paramserver.outbox import DECODE_RETRIES, Outbox

ACK_S, CAP_S = 1.0, 4.0  # first re-send after 1 s, doubling, at most every 4 s
KEY = (0, 7)  # (fragment, round)


def ledger(*keys, shard=0, now=10.0):
    """An outbox holding `keys` (default KEY), all of `shard`, pushed and sent at `now`."""
    box = Outbox(ACK_S, CAP_S)
    for key in keys or (KEY,):
        assert box.add(key, shard, [b"frames"], 6, now)
        assert box.sent(key, now) is False  # the first send is not a re-send
    return box


# outcome, reason -> decision, whether the delta is still pending, deferred afterwards
ACKS = [
    ("accepted", None, "done", False, False),
    ("duplicate", None, "done", False, False),
    ("accepted", "too_many_pending", "done", False, False),  # reasons only matter on rejection
    ("rejected", "unknown_island", "rejoin", True, False),
    ("rejected", "too_many_pending", "defer", True, True),
    ("rejected", "storage_error", "defer", True, True),  # nothing kept: again after the back-off
    ("rejected", "codec_error", "resend", True, False),
    ("rejected", "plan_mismatch", "done", False, False),
    ("rejected", "replayed_round", "done", False, False),
    ("rejected", "future_base_version", "done", False, False),
    ("rejected", "bad_shape", "done", False, False),
    ("rejected", "non_finite", "done", False, False),
    ("rejected", "oversize", "done", False, False),
    ("rejected", "unknown_fragment", "done", False, False),
    ("rejected", "internal_error", "done", False, False),
    ("rejected", "island_in_use", "done", False, False),  # another process has the id: final
    ("rejected", None, "done", False, False),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("outcome, reason, decision, kept, deferred", ACKS)
def test_ack_decision_table(outcome, reason, decision, kept, deferred):
    box = ledger()
    assert box.on_ack(KEY, outcome, reason) == decision
    assert (KEY in box) is kept
    assert len(box) == int(kept)
    if kept:
        assert box.get(KEY).deferred is deferred
    else:
        assert box.get(KEY) is None


@pytest.mark.timeout(10)
def test_codec_error_is_resent_three_times_then_final():
    assert DECODE_RETRIES == 3
    box = ledger()
    decisions = [box.on_ack(KEY, "rejected", "codec_error") for _ in range(4)]
    assert decisions == ["resend", "resend", "resend", "done"]
    assert KEY not in box


@pytest.mark.timeout(10)
def test_unknown_island_and_deferral_do_not_use_up_decode_retries():
    box = ledger()
    for _ in range(5):
        assert box.on_ack(KEY, "rejected", "unknown_island") == "rejoin"
        assert box.on_ack(KEY, "rejected", "too_many_pending") == "defer"
    assert box.get(KEY).decode_retries == 0
    assert box.on_ack(KEY, "rejected", "codec_error") == "resend"


@pytest.mark.timeout(10)
def test_on_ack_of_a_key_not_pending_says_to_check_first():
    box = ledger()
    assert box.on_ack(KEY, "accepted", None) == "done"
    with pytest.raises(KeyError, match="check `key in outbox`"):
        box.on_ack(KEY, "duplicate", None)


# attempt (back-off re-sends so far), now -> due, for a delta last sent at 10.0
DUE = [
    (0, 10.0, False),
    (0, 10.999, False),
    (0, 11.0, True),  # 1 s
    (1, 11.999, False),
    (1, 12.0, True),  # 2 s
    (2, 13.999, False),
    (2, 14.0, True),  # 4 s
    (3, 13.999, False),
    (3, 14.0, True),  # 8 s, capped at 4 s
    (50, 14.0, True),
    (0, 9.0, False),  # a clock before the send
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("attempt, now, due", DUE)
def test_due_table(attempt, now, due):
    box = ledger(now=10.0)
    box.get(KEY).attempt = attempt
    assert box.due(now, up={0}) == ([KEY] if due else [])
    assert box.get(KEY).attempt == attempt + due  # a due delta's attempt is counted


@pytest.mark.timeout(10)
def test_resend_schedule_doubles_from_each_send_up_to_the_cap():
    box = ledger(now=10.0)
    schedule = []
    for tick in range(100, 3000):  # 10.0 .. 29.99 s in 10 ms ticks
        now = tick / 100
        for key in box.due(now, up={0}):
            assert box.sent(key, now) is True  # every later send is a re-send
            schedule.append(now)
    assert schedule == [11.0, 13.0, 17.0, 21.0, 25.0, 29.0]


@pytest.mark.timeout(10)
def test_a_blocked_send_waits_the_same_back_off_and_is_not_a_send():
    box = Outbox(ACK_S, CAP_S)
    assert box.add(KEY, 0, [b"f"], 1, now=10.0)
    box.blocked(KEY, 10.5)  # the socket's queue was full
    assert box.get(KEY).sends == 0
    assert box.due(11.4, up={0}) == []
    assert box.due(11.5, up={0}) == [KEY]
    assert box.sent(KEY, 11.5) is False  # the first send that went out


@pytest.mark.timeout(10)
def test_deltas_of_a_down_shard_wait_without_counting_attempts():
    box = ledger((0, 1), shard=0)
    assert box.add((1, 1), 1, [b"f"], 1, 10.0)
    box.sent((1, 1), 10.0)
    assert box.due(20.0, up={1}) == [(1, 1)]
    assert box.get((0, 1)).attempt == 0
    assert box.due(20.0, up=set()) == []


@pytest.mark.timeout(10)
def test_due_keeps_push_order_and_deferred_deltas_stay_deferred():
    keys = [(2, 5), (0, 5), (1, 5)]
    box = ledger(*keys)
    assert box.on_ack((0, 5), "rejected", "too_many_pending") == "defer"
    assert box.due(11.0, up={0}) == keys
    assert box.get((0, 5)).deferred


@pytest.mark.timeout(10)
def test_a_step_releases_the_deferred_deltas_of_its_fragment_only():
    keys = [(0, 1), (1, 1), (0, 2), (0, 3)]
    box = ledger(*keys)
    for key in [(0, 1), (1, 1), (0, 3)]:
        assert box.on_ack(key, "rejected", "too_many_pending") == "defer"
    assert box.on_step(0) == [(0, 1), (0, 3)]  # (0, 2) was not deferred
    assert not any(box.get(k).deferred for k in [(0, 1), (0, 3)])
    assert box.on_step(0) == []  # released once
    assert box.on_step(1) == [(1, 1)]
    assert box.on_step(5) == []


@pytest.mark.timeout(10)
def test_rejoin_resends_every_delta_of_that_shard_in_push_order():
    box = ledger((3, 1), (1, 1), shard=1)
    assert box.add((0, 1), 0, [b"f"], 1, 10.0)
    box.on_ack((1, 1), "rejected", "too_many_pending")
    box.get((3, 1)).attempt = 2
    assert box.on_rejoin(1) == [(3, 1), (1, 1)]
    assert box.on_rejoin(0) == [(0, 1)]
    assert box.on_rejoin(2) == []
    assert box.get((1, 1)).deferred and box.get((3, 1)).attempt == 2  # unchanged


@pytest.mark.timeout(10)
def test_a_round_still_pending_is_not_added_again():
    box = ledger(now=10.0)
    assert box.add(KEY, 1, [b"other"], 5, now=12.0) is False
    entry = box.get(KEY)
    assert (entry.shard, entry.frames, entry.nbytes, entry.queued_at) == (0, [b"frames"], 6, 10.0)
    assert box.add((0, 8), 0, [b"next"], 4, now=12.0) is True
    assert len(box) == 2


@pytest.mark.timeout(10)
def test_resolved_and_dropped_deltas_leave_the_ledger():
    box = ledger((0, 1), (0, 2), (1, 2))
    assert box.on_ack((0, 1), "accepted", None) == "done"
    assert len(box) == 2 and (0, 1) not in box
    assert box.add((0, 1), 0, [b"f"], 1, 11.0)  # the key can be pushed again once resolved
    assert box.drop_all() == [[b"frames"], [b"frames"], [b"f"]]  # in push order, to keep
    assert len(box) == 0 and not box
    assert box.due(100.0, up={0, 1}) == [] and box.on_rejoin(0) == []


@pytest.mark.timeout(10)
def test_storage_error_keeps_the_delta_and_resends_on_the_doubling_back_off():
    # the shard could not write its log: nothing of the delta was kept there, so it is
    # sent again, but on the back-off (not at once: a broken disk is not hammered)
    box = ledger(now=10.0)
    assert box.on_ack(KEY, "rejected", "storage_error") == "defer"
    resent = []
    for tick in range(1000, 2000):  # 10.0 .. 19.99 s in 10 ms ticks
        now = tick / 100
        for key in box.due(now, up={0}):
            box.sent(key, now)
            resent.append(now)
            assert box.on_ack(key, "rejected", "storage_error") == "defer"
    assert resent == [11.0, 13.0, 17.0]
    assert box.on_ack(KEY, "accepted", None) == "done"  # the disk works again
    assert len(box) == 0


@pytest.mark.timeout(10)
def test_shards_names_the_shards_holding_pending_deltas():
    box = ledger((0, 1), shard=2)
    assert box.add((1, 1), 0, [b"f"], 1, 10.0)
    assert box.shards() == {0, 2}
    box.on_ack((0, 1), "accepted", None)
    assert box.shards() == {0}
    box.drop_all()
    assert box.shards() == set()
