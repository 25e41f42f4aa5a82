"""The client's ledger: ack decisions, re-send timing and deferrals, with explicit time."""

import pytest

from paramserver.client.ledger import DECODE_RETRIES, THROTTLED_RETRY_S, Ledger
from paramserver.client.types import PushRequest

ACK_S, CAP_S = 1.0, 4.0  # first re-send after 1 s, doubling, at most every 4 s
T0 = 10.0  # when `ledger` pushes and sends (an ack at T0 is a 0 s sample: the floor, 1 s)
KEY = (0, 7)  # (fragment, round)


def _request(key):
    """A delta under `key` = (fragment, round)."""
    return PushRequest(key[0], key[1], 0, 1, 1, [b"delta"])


def ledger(*keys, shard=0, now=10.0):
    """A ledger holding `keys` (default KEY), all of `shard`, pushed and sent at `now`."""
    box = Ledger(ACK_S, CAP_S)
    for key in keys or (KEY,):
        assert box.add(key, shard, [b"frames"], 6, now, request=_request(key))
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
    ("rejected", "throttled", "defer", True, True),  # over the shard's rate: after retry_after_s
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
    assert box.on_ack(KEY, outcome, reason, T0) == decision
    assert (KEY in box) is kept
    assert len(box) == int(kept)
    if kept:
        assert box.get(KEY).deferred is deferred
    else:
        assert box.get(KEY) is None


@pytest.mark.timeout(10)
def test_a_throttled_delta_is_re_sent_after_retry_after_not_when_its_fragment_steps():
    box = ledger(KEY, (1, 7))
    timeout_before = box.timer.timeout_s(0)
    assert box.on_ack(KEY, "rejected", "throttled", T0, retry_after_s=0.25) == "defer"
    assert box.on_ack((1, 7), "rejected", "throttled", T0) == "defer"  # no retry_after_s
    assert box.on_step(0) == []  # a step does not lift a rate limit
    assert box.due(T0 + 0.2, up={0}) == []
    assert box.due(T0 + 0.25, up={0}) == [KEY]  # T0 + retry_after_s
    box.sent(KEY, T0 + 0.25)
    assert box.due(T0 + THROTTLED_RETRY_S - 0.01, up={0}) == []
    assert box.due(T0 + THROTTLED_RETRY_S, up={0}) == [(1, 7)]
    assert box.get(KEY).attempt == 0 and not box.get(KEY).deferred  # not late: no back-off
    assert box.timer.timeout_s(0) == timeout_before  # a throttle answer is no latency sample
    assert box.on_ack(KEY, "accepted", None, T0 + 0.3) == "done"  # not lost: it got in


@pytest.mark.timeout(10)
def test_codec_error_is_resent_three_times_then_final():
    assert DECODE_RETRIES == 3
    box = ledger()
    decisions = [box.on_ack(KEY, "rejected", "codec_error", T0) for _ in range(4)]
    assert decisions == ["resend", "resend", "resend", "done"]
    assert KEY not in box


@pytest.mark.timeout(10)
def test_unknown_island_and_deferral_do_not_use_up_decode_retries():
    box = ledger()
    for _ in range(5):
        assert box.on_ack(KEY, "rejected", "unknown_island", T0) == "rejoin"
        assert box.on_ack(KEY, "rejected", "too_many_pending", T0) == "defer"
    assert box.get(KEY).decode_retries == 0
    assert box.on_ack(KEY, "rejected", "codec_error", T0) == "resend"


@pytest.mark.timeout(10)
def test_on_ack_of_a_key_not_pending_says_to_check_first():
    box = ledger()
    assert box.on_ack(KEY, "accepted", None, T0) == "done"
    with pytest.raises(KeyError, match="check `key in ledger`"):
        box.on_ack(KEY, "duplicate", None, T0)


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
    box = Ledger(ACK_S, CAP_S)
    assert box.add(KEY, 0, [b"f"], 1, now=10.0, request=_request(KEY))
    box.blocked(KEY, 10.5)  # the socket's queue was full
    assert box.get(KEY).sends == 0
    assert box.due(11.4, up={0}) == []
    assert box.due(11.5, up={0}) == [KEY]
    assert box.sent(KEY, 11.5) is False  # the first send that went out


@pytest.mark.timeout(10)
def test_deltas_of_a_down_shard_wait_without_counting_attempts():
    box = ledger((0, 1), shard=0)
    assert box.add((1, 1), 1, [b"f"], 1, 10.0, request=_request((1, 1)))
    box.sent((1, 1), 10.0)
    assert box.due(20.0, up={1}) == [(1, 1)]
    assert box.get((0, 1)).attempt == 0
    assert box.due(20.0, up=set()) == []


@pytest.mark.timeout(10)
def test_due_keeps_push_order_and_deferred_deltas_stay_deferred():
    keys = [(2, 5), (0, 5), (1, 5)]
    box = ledger(*keys)
    assert box.on_ack((0, 5), "rejected", "too_many_pending", T0) == "defer"
    assert box.due(11.0, up={0}) == keys
    assert box.get((0, 5)).deferred


@pytest.mark.timeout(10)
def test_a_step_releases_the_deferred_deltas_of_its_fragment_only():
    keys = [(0, 1), (1, 1), (0, 2), (0, 3)]
    box = ledger(*keys)
    for key in [(0, 1), (1, 1), (0, 3)]:
        assert box.on_ack(key, "rejected", "too_many_pending", T0) == "defer"
    assert box.on_step(0) == [(0, 1), (0, 3)]  # (0, 2) was not deferred
    assert not any(box.get(k).deferred for k in [(0, 1), (0, 3)])
    assert box.on_step(0) == []  # released once
    assert box.on_step(1) == [(1, 1)]
    assert box.on_step(5) == []


@pytest.mark.timeout(10)
def test_rejoin_resends_every_delta_of_that_shard_in_push_order():
    box = ledger((3, 1), (1, 1), shard=1)
    assert box.add((0, 1), 0, [b"f"], 1, 10.0, request=_request((0, 1)))
    box.on_ack((1, 1), "rejected", "too_many_pending", T0)
    box.get((3, 1)).attempt = 2
    assert box.on_rejoin(1) == [(3, 1), (1, 1)]
    assert box.on_rejoin(0) == [(0, 1)]
    assert box.on_rejoin(2) == []
    assert box.get((1, 1)).deferred and box.get((3, 1)).attempt == 2  # unchanged


@pytest.mark.timeout(10)
def test_a_round_still_pending_is_not_added_again():
    box = ledger(now=10.0)
    assert box.add(KEY, 1, [b"other"], 5, now=12.0, request=_request(KEY)) is False
    entry = box.get(KEY)
    assert (entry.shard, entry.frames, entry.nbytes, entry.queued_at) == (0, [b"frames"], 6, 10.0)
    assert box.add((0, 8), 0, [b"next"], 4, now=12.0, request=_request((0, 8))) is True
    assert len(box) == 2


@pytest.mark.timeout(10)
def test_resolved_and_dropped_deltas_leave_the_ledger():
    box = ledger((0, 1), (0, 2), (1, 2))
    assert box.on_ack((0, 1), "accepted", None, T0) == "done"
    assert len(box) == 2 and (0, 1) not in box
    assert box.add(
        (0, 1), 0, [b"f"], 1, 11.0, request=_request((0, 1))
    )  # the key can be pushed again once resolved
    dropped = box.drop_all()  # in push order, to keep, as pushed (frames as bytes)
    assert dropped == [_request((0, 2)), _request((1, 2)), _request((0, 1))]
    assert len(box) == 0 and not box
    assert box.due(100.0, up={0, 1}) == [] and box.on_rejoin(0) == []


@pytest.mark.timeout(10)
def test_storage_error_keeps_the_delta_and_resends_on_the_doubling_back_off():
    # the shard could not write its log: nothing of the delta was kept there, so it is
    # sent again, but on the back-off (not at once: a broken disk is not hammered)
    box = ledger(now=10.0)
    assert box.on_ack(KEY, "rejected", "storage_error", T0) == "defer"
    resent = []
    for tick in range(1000, 2000):  # 10.0 .. 19.99 s in 10 ms ticks
        now = tick / 100
        for key in box.due(now, up={0}):
            box.sent(key, now)
            resent.append(now)
            assert box.on_ack(key, "rejected", "storage_error", now) == "defer"
    assert resent == [11.0, 13.0, 17.0]
    assert box.on_ack(KEY, "accepted", None, 20.0) == "done"  # the disk works again
    assert len(box) == 0


@pytest.mark.timeout(10)
def test_shards_names_the_shards_holding_pending_deltas():
    box = ledger((0, 1), shard=2)
    assert box.add((1, 1), 0, [b"f"], 1, 10.0, request=_request((1, 1)))
    assert box.shards() == {0, 2}
    box.on_ack((0, 1), "accepted", None, T0)
    assert box.shards() == {0}
    box.drop_all()
    assert box.shards() == set()


# -- the adaptive timeout (paramserver.client.ledger) ------------------------------------------


def sent_at(box, key, now, shard=0):
    assert box.add(key, shard, [b"f"], 1, now, request=_request(key))
    assert box.sent(key, now) is False


@pytest.mark.timeout(10)
def test_the_timeout_follows_the_measured_ack_latency():
    box = Ledger(5.0, 60.0, 1.0)
    sent_at(box, (0, 1), 0.0)
    assert box.on_ack((0, 1), "accepted", None, 2.0) == "done"  # 2 s: SRTT 2, RTTVAR 1
    assert box.timer.base_s == 6.0
    sent_at(box, (0, 2), 10.0)
    assert box.due(15.99, up={0}) == []  # not after the initial 5 s
    assert box.due(16.0, up={0}) == [(0, 2)]


@pytest.mark.timeout(10)
def test_a_steady_short_latency_lowers_the_timeout_to_the_floor_not_below():
    box = Ledger(5.0, 60.0, 1.0)
    for r in range(20):
        sent_at(box, (0, r), 10.0 * r)
        box.on_ack((0, r), "accepted", None, 10.0 * r + 0.01)
    assert box.timer.base_s == 1.0
    sent_at(box, (0, 99), 500.0)
    assert box.due(500.99, up={0}) == []
    assert box.due(501.0, up={0}) == [(0, 99)]


@pytest.mark.timeout(10)
def test_the_floor_is_never_above_the_initial_timeout():
    for floor in (None, 1.0, 0.2):
        box = Ledger(0.2, 0.4, floor)
        sent_at(box, KEY, 10.0)
        box.on_ack(KEY, "accepted", None, 10.0)  # a 0 s sample
        assert box.timer.base_s == 0.2


@pytest.mark.timeout(10)
def test_karn_the_ack_of_a_re_sent_delta_is_not_a_sample_and_the_back_off_stays():
    box = Ledger(1.0, 8.0)
    sent_at(box, (0, 1), 10.0)
    assert box.due(11.0, up={0}) == [(0, 1)]
    assert box.sent((0, 1), 11.0) is True
    assert box.on_ack((0, 1), "accepted", None, 11.5) == "done"  # answers which copy?
    assert box.timer.srtt_s is None and box.timer.backoff == 1
    sent_at(box, (0, 2), 20.0)  # backed off: waits 2 s, so its ack can be measured
    assert box.due(21.99, up={0}) == []
    box.on_ack((0, 2), "accepted", None, 21.5)
    assert (box.timer.srtt_s, box.timer.backoff, box.timer.base_s) == (1.5, 0, 4.5)


@pytest.mark.timeout(10)
def test_a_delta_that_timed_out_but_could_not_be_re_sent_is_not_a_sample():
    box = Ledger(1.0, 8.0)
    sent_at(box, KEY, 10.0)
    assert box.due(11.0, up={0}) == [KEY]
    box.blocked(KEY, 11.0)  # the re-send did not go out; the ack is for the first copy,
    box.on_ack(KEY, "accepted", None, 11.2)  # but its send time was overwritten
    assert box.timer.srtt_s is None


@pytest.mark.timeout(10)
def test_many_deltas_timing_out_together_back_the_timer_off_once():
    keys = [(0, 1), (1, 1), (2, 1)]
    box = ledger(*keys)  # sent at 10.0, timeout 1 s
    assert box.due(11.0, up={0}) == keys  # all due: judged by the timer before the call
    assert box.timer.backoff == 1
    for key in keys:
        box.sent(key, 11.0)
    sent_at(box, (3, 1), 11.0)
    assert box.due(12.0, up={0}) == []  # 2 s for the new one; 2 s for the re-sent ones
    assert box.due(13.0, up={0}) == [*keys, (3, 1)]
    assert box.timer.backoff == 2


@pytest.mark.timeout(10)
def test_a_deferred_delta_s_re_send_does_not_back_the_timer_off():
    box = ledger()
    assert box.on_ack(KEY, "rejected", "too_many_pending", T0) == "defer"  # answered
    assert box.due(11.0, up={0}) == [KEY]
    assert box.timer.backoff == 0


# sends of the pending delta (None: not pending), outcome -> a needless re-send
NEEDLESS = [
    (1, "duplicate", False),  # pushed again after it was acked: not a re-send
    (2, "duplicate", True),  # an earlier copy was accepted
    (3, "duplicate", True),
    (2, "accepted", False),  # this copy (the first ones were lost), or a later duplicate
    (2, "rejected", False),
    (None, "duplicate", True),  # the answer to an extra copy after the first resolved it
    (None, "accepted", False),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("sends, outcome, needless", NEEDLESS)
def test_needless_re_send_table(sends, outcome, needless):
    box = ledger()
    if sends is None:
        box.on_ack(KEY, "accepted", None, T0)
    else:
        for _ in range(sends - 1):
            box.sent(KEY, T0)
    assert box.spurious(KEY, outcome) is needless


def simulate(box, latency_s: float, pushes: int) -> tuple[int, int]:
    """A shard that answers every copy `latency_s` after it is sent (the first accepted, the
    rest duplicate); one push every 2 s; 10 ms ticks. Returns (re-sends, needless ones)."""
    answers: list[tuple[float, tuple[int, int], str]] = []
    accepted: set = set()
    resent = needless = 0

    def send(key, now):
        nonlocal resent
        resent += box.sent(key, now)
        outcome = "duplicate" if key in accepted else "accepted"
        accepted.add(key)
        answers.append((now + latency_s, key, outcome))

    for tick in range(pushes * 200 + 1000):
        now = tick / 100
        if tick % 200 == 0 and tick // 200 < pushes:
            box.add((0, tick // 200), 0, [b"f"], 1, now, request=_request((0, tick // 200)))
            send((0, tick // 200), now)
        for answer in [a for a in answers if a[0] <= now]:
            answers.remove(answer)
            _, key, outcome = answer
            needless += box.spurious(key, outcome)
            if key in box:
                box.on_ack(key, outcome, None, now)
        for key in box.due(now, up={0}):
            send(key, now)
    assert len(box) == 0
    return resent, needless


@pytest.mark.timeout(20)
def test_acks_slower_than_the_initial_timeout_are_re_sent_until_measured_then_never():
    # 0.8 s acks, initial timeout 0.5 s: the first delta is re-sent (needlessly), which
    # backs the timer off to 1 s; the second is measured; no later delta is re-sent
    box = Ledger(0.5, 10.0, 0.25)
    assert simulate(box, 0.8, pushes=20) == (1, 1)
    assert box.timer.backoff == 0 and 0.8 < box.timer.base_s < 2.5


@pytest.mark.timeout(10)
def test_a_needless_re_send_teaches_the_timer_the_first_copy_s_latency():
    box = Ledger(1.0, 60.0)
    sent_at(box, (0, 1), 0.0)
    box.on_ack((0, 1), "accepted", None, 0.5)  # a valid sample: SRTT 0.5, RTTVAR 0.25
    assert box.timer.base_s == 1.5
    sent_at(box, (0, 2), 10.0)
    assert box.due(11.5, up={0}) == [(0, 2)]
    box.sent((0, 2), 11.5)
    assert box.on_ack((0, 2), "accepted", None, 12.0) == "done"  # Karn: no sample
    assert box.timer.srtt_s == 0.5 and box.timer.backoff == 1
    assert box.spurious((0, 2), "duplicate") is True  # the re-send's answer: the first copy
    # was accepted and answered first, 2 s after it was sent (RFC 4015):
    # SRTT = max(0.5, 2) = 2, RTTVAR = max(0.25, 1) = 1, no back-off
    assert (box.timer.srtt_s, box.timer.rttvar_s, box.timer.backoff) == (2.0, 1.0, 0)
    assert box.timer.base_s == 6.0
    assert box.spurious((0, 2), "duplicate") is True  # a third copy's answer: counted only
    assert box.timer.base_s == 6.0
