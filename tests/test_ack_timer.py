"""The adaptive ack timeout (RFC 6298): contract tables whose values are computed by hand."""

import math

import pytest

from paramserver.client import PushRequest
from paramserver.client.ledger import AckTimer, Ledger, ack_due, smoothed

INITIAL_S, FLOOR_S, CAP_S = 5.0, 1.0, 60.0


def fed(*samples: float, floor_s: float = FLOOR_S) -> AckTimer:
    timer = AckTimer(INITIAL_S, floor_s, CAP_S)
    for s in samples:
        timer = timer.sample(s)
    return timer


# samples -> SRTT, RTTVAR, base timeout (SRTT + 4 RTTVAR within [floor, cap])
ESTIMATES = [
    ((), None, None, 5.0),  # no sample: the initial timeout
    ((2.0,), 2.0, 1.0, 6.0),  # first: SRTT = R, RTTVAR = R/2
    # RTTVAR = 3/4 * 1 + 1/4 * |2 - 1| = 1; SRTT = 7/8 * 2 + 1/8 * 1 = 1.875
    ((2.0, 1.0), 1.875, 1.0, 5.875),
    # RTTVAR = 3/4 * 1 + 1/4 * 0 = 0.75; SRTT unchanged; 1.875 + 3 = 4.875
    ((2.0, 1.0, 1.875), 1.875, 0.75, 4.875),
    # RTTVAR = 3/4 * 0.5 + 1/4 * 2 = 0.875; SRTT = 7/8 + 3/8 = 1.25; 1.25 + 3.5 = 4.75
    ((1.0, 3.0), 1.25, 0.875, 4.75),
    ((0.1,), 0.1, 0.05, 1.0),  # 0.1 + 0.2 = 0.3: raised to the floor
    ((40.0,), 40.0, 20.0, 60.0),  # 40 + 80 = 120: lowered to the cap
    ((-1.0,), 0.0, 0.0, 1.0),  # a clock step back counts as 0 s
    # constant 0.5 s: RTTVAR 0.25, 0.1875, 0.140625, 0.10546875; 0.5 + 0.421875 < floor
    ((0.5, 0.5, 0.5, 0.5), 0.5, 0.10546875, 1.0),
]


@pytest.mark.parametrize("samples, srtt, rttvar, base", ESTIMATES)
def test_estimates_table(samples, srtt, rttvar, base):
    timer = fed(*samples)
    assert (timer.srtt_s, timer.rttvar_s, timer.base_s) == (srtt, rttvar, base)
    assert timer.timeout_s() == base


def test_a_lower_floor_lets_a_steady_latency_lower_the_timeout():
    assert fed(0.5, 0.5, 0.5, 0.5, floor_s=0.25).base_s == 0.921875
    assert fed(0.0, floor_s=0.25).base_s == 0.25


def test_smoothed_is_the_rfc_6298_update():
    assert smoothed(None, None, 4.0) == (4.0, 2.0)
    # RTTVAR = 3/4 * 2 + 1/4 * |4 - 8| = 2.5; SRTT = 7/8 * 4 + 1/8 * 8 = 4.5
    assert smoothed(4.0, 2.0, 8.0) == (4.5, 2.5)


# base 2 s (SRTT 1, RTTVAR 0.25): attempt, back-off -> timeout
TIMEOUTS = [
    (0, 0, 2.0),
    (1, 0, 4.0),  # doubling per attempt
    (3, 0, 16.0),
    (5, 0, 60.0),  # 64: capped
    (1000, 0, 60.0),  # no overflow
    (0, 2, 8.0),  # backed off: every delta waits 2 doublings
    (3, 2, 16.0),  # the larger of the two, not their sum
    (0, 10_000, 60.0),
]


@pytest.mark.parametrize("attempt, backoff, timeout", TIMEOUTS)
def test_timeout_table(attempt, backoff, timeout):
    timer = AckTimer(INITIAL_S, FLOOR_S, CAP_S, srtt_s=1.0, rttvar_s=0.25, backoff=backoff)
    assert timer.base_s == 2.0
    assert timer.timeout_s(attempt) == timeout


def test_timeouts_back_off_to_the_longest_run_and_a_sample_resets():
    timer = AckTimer(INITIAL_S, FLOOR_S, CAP_S)
    assert timer.timed_out(0).backoff == 1
    assert timer.timed_out(0).timed_out(0).backoff == 1  # many deltas at once: once
    backed = timer.timed_out(2).timed_out(1)
    assert backed.backoff == 3 and backed.timeout_s() == 40.0  # 5 * 2**3
    after = backed.sample(2.0)
    assert after.backoff == 0 and after.timeout_s() == 6.0
    assert timer.backoff == 0  # immutable: every step returns a new timer


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"initial_s": 0.0}, "initial_s=0.0"),
        ({"floor_s": math.nan}, "floor_s=nan"),
        ({"cap_s": -1.0}, "cap_s=-1.0"),
        ({"cap_s": 4.0}, "cap_s=4.0: must be >= initial_s=5.0"),
        ({"floor_s": 70.0}, "must be >= initial_s=5.0 and floor_s=70.0"),
    ],
)
def test_invalid_settings_are_refused(fields, match):
    settings = {"initial_s": INITIAL_S, "floor_s": FLOOR_S, "cap_s": CAP_S, **fields}
    with pytest.raises(ValueError, match=match):
        AckTimer(**settings)


# SRTT, RTTVAR before; latency of the first copy of a needlessly re-sent delta -> after
SPURIOUS = [
    (1.0, 0.25, 2.0, 2.0, 1.0),  # both raised: max(1, 2), max(0.25, 1)
    (1.0, 0.25, 0.4, 1.0, 0.25),  # neither lowered
    (3.0, 0.25, 2.0, 3.0, 1.0),  # the deviation alone
    (None, None, 2.0, 2.0, 1.0),  # no estimate yet: a first sample
]


@pytest.mark.parametrize("srtt, rttvar, latency, srtt_after, rttvar_after", SPURIOUS)
def test_spurious_table(srtt, rttvar, latency, srtt_after, rttvar_after):
    timer = AckTimer(INITIAL_S, FLOOR_S, CAP_S, srtt_s=srtt, rttvar_s=rttvar, backoff=2)
    after = timer.spurious(latency)
    assert (after.srtt_s, after.rttvar_s, after.backoff) == (srtt_after, rttvar_after, 0)


# now, sent_at, shard's last ack (None: none / deferred), timeout, cap -> due
DUE = [
    (10.0, 7.0, None, 3.0, 60.0, True),  # 3 s since the send, no ack since: due
    (9.9, 7.0, None, 3.0, 60.0, False),
    (10.0, 7.0, 9.0, 3.0, 60.0, False),  # its shard answered 1 s ago: the timer restarted
    (12.0, 7.0, 9.0, 3.0, 60.0, True),  # 3 s of silence since that ack
    (10.0, 7.0, 5.0, 3.0, 60.0, True),  # an ack before the send does not restart it
    (67.0, 7.0, 66.0, 3.0, 60.0, True),  # passed over while the shard answered: cap since send
    (66.9, 7.0, 66.0, 3.0, 60.0, False),
]


@pytest.mark.parametrize("now, sent_at, acked_at, timeout, cap, due", DUE)
def test_ack_due_restarts_on_each_ack_of_the_shard(now, sent_at, acked_at, timeout, cap, due):
    assert ack_due(now, sent_at, acked_at, timeout, cap) is due


def _request(fragment: int, round_id: int) -> PushRequest:
    return PushRequest(fragment, round_id, 0, 1, 1, [b"x"])


def test_a_queue_behind_a_shard_that_answers_is_not_re_sent():
    """16 deltas to one shard at t=0; it acks one every 1.5 s (a long queue, no loss).

    The timer is at its floor (2 s), below the last delta's latency (24 s), yet
    the shard never stays silent 2 s: nothing is due until it stops answering.
    """
    ledger = Ledger(ack_timeout_s=2.0, ack_timeout_cap_s=60.0, ack_timeout_floor_s=2.0)
    keys = [(0, r) for r in range(16)]
    for key in keys:
        ledger.add(key, 0, [b"x"], 1, 0.0, _request(*key))
        ledger.sent(key, 0.0)
    for i, key in enumerate(keys[:8]):
        now = 1.5 * (i + 1)
        assert ledger.due(now - 0.01, {0}) == []  # the moment before each ack
        assert ledger.on_ack(key, "accepted", None, now) == "done"
    # latencies 1.5 .. 12 s raised the timer above its floor: it follows the latency
    assert ledger.timer.base_s > 12.0
    assert ledger.due(12.0 + 1.9, {0}) == []
    # the shard falls silent for good: after the timeout the rest is due, once
    quiet = 12.0 + ledger.timer.base_s
    assert ledger.due(quiet - 0.01, {0}) == []
    assert ledger.due(quiet, {0}) == keys[8:]


def test_a_delta_the_shard_passed_over_counts_from_its_send():
    """Deltas 1 and 2 to shard 0 at t=0 and t=1; the shard acks 2 (accepted) at t=1.5.

    Its acks come in send order, so 1 was dropped: the ack at 1.5 does not restart
    its timer, and it is due at 0 + 5 s (the initial timeout), not at 1.5 + base.
    """
    ledger = Ledger(ack_timeout_s=5.0, ack_timeout_cap_s=60.0, ack_timeout_floor_s=5.0)
    for key, at in (((0, 1), 0.0), ((0, 2), 1.0)):
        ledger.add(key, 0, [b"x"], 1, at, _request(*key))
        ledger.sent(key, at)
    assert ledger.on_ack((0, 2), "accepted", None, 1.5) == "done"
    assert ledger.timer.base_s == 5.0  # 0.5 + 4 * 0.25 = 1.5: raised to the floor
    assert ledger.due(4.99, {0}) == []
    assert ledger.due(5.0, {0}) == [(0, 1)]


def test_a_later_send_acked_first_on_another_connection_passes_nothing_over():
    """As above, but 1 went on flow 7 and 2 on flow 8 (two bulk connections of shard 0).

    Acks keep send order per connection only: the ack of 2 on flow 8 says nothing of
    1, which waits its turn as behind any ack of its shard (due at 1.5 + 5 s).
    """
    ledger = Ledger(ack_timeout_s=5.0, ack_timeout_cap_s=60.0, ack_timeout_floor_s=5.0)
    for key, at, flow in (((0, 1), 0.0, 7), ((0, 2), 1.0, 8)):
        ledger.add(key, 0, [b"x"], 1, at, _request(*key))
        ledger.sent(key, at, flow)
    assert ledger.on_ack((0, 2), "accepted", None, 1.5) == "done"
    assert ledger.due(6.49, {0}) == []
    assert ledger.due(6.5, {0}) == [(0, 1)]


def test_before_the_first_ack_a_step_of_its_fragment_restarts_the_timer():
    """A cold start behind other islands' deltas: no ack of ours yet, but fragment 0 steps."""
    ledger = Ledger(ack_timeout_s=5.0, ack_timeout_cap_s=60.0, ack_timeout_floor_s=5.0)
    for key in ((0, 1), (1, 1)):
        ledger.add(key, 0, [b"x"], 1, 0.0, _request(*key))
        ledger.sent(key, 0.0)
    assert ledger.on_step(0, 4.0) == []  # nothing deferred; the timer of (0, 1) restarts
    assert ledger.due(4.99, {0}) == []
    assert ledger.due(5.0, {0}) == [(1, 1)]  # fragment 1 did not step: 0 + 5 s
    ledger.sent((1, 1), 5.0)  # re-sent: next due at 5 + 10 s
    # that timeout backed the timer off (10 s): (0, 1) is due at 4 + 10 s
    assert ledger.due(13.99, {0}) == [] and ledger.due(14.0, {0}) == [(0, 1)]
