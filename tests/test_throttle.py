"""The shard's request limits as pure rules: token buckets, the verdicts, one island's byte budget.

Every expected value below is worked out by hand from the rule in the
docstring of `paramserver.server.admission.gate` (rate 10/s, bucket of 5, 2 answers
a second unless a test says otherwise).
"""

import pytest

from paramserver.server.admission import outcomes
from paramserver.server.admission.gate import (
    ADMIT,
    ANSWER,
    CONTENTION_S,
    DROP,
    PRUNE_AT,
    Bucket,
    Limits,
    Throttle,
    contended,
    decide,
    heard,
    refill,
    rekey,
)

pytestmark = pytest.mark.timeout(30)

LIM = Limits(rate=10.0, burst=5, answers_per_s=2.0)


def test_refill_adds_rate_times_elapsed_up_to_the_size():
    assert refill(None, 7.0, 10.0, 5) == Bucket(5.0, 7.0)  # fresh: full
    assert refill(Bucket(0.0, 1.0), 1.25, 10.0, 5) == Bucket(2.5, 1.25)
    assert refill(Bucket(0.0, 1.0), 9.0, 10.0, 5) == Bucket(5.0, 9.0)  # capped
    assert refill(Bucket(3.0, 2.0), 1.0, 10.0, 5) == Bucket(3.0, 2.0)  # time going back: nothing


def test_a_burst_is_admitted_then_throttled_answered_then_dropped_while_others_are_served():
    req, ans = None, None
    for left in (4.0, 3.0, 2.0, 1.0, 0.0):  # the bucket of 5, one token each
        req, ans, verdict, retry = decide(req, ans, 100.0, LIM, shared=True)
        assert (verdict, retry, req) == (ADMIT, 0.0, Bucket(left, 100.0))
    # empty: (1 - 0) / 10 = 0.1 s to the next token; the answers bucket (2) answers two
    for expected in (ANSWER, ANSWER, DROP):
        req, ans, verdict, retry = decide(req, ans, 100.0, LIM, shared=True)
        assert (verdict, retry) == (expected, pytest.approx(0.1))
    assert ans == Bucket(0.0, 100.0)
    # 0.05 s later: 0.5 request tokens (0.05 s to the next), 0.1 answer tokens: dropped
    req, ans, verdict, retry = decide(req, ans, 100.05, LIM, shared=True)
    assert (verdict, retry) == (DROP, pytest.approx(0.05))
    assert req.tokens == pytest.approx(0.5) and ans.tokens == pytest.approx(0.1)
    # alone on the shard it delays nobody: admitted although the bucket is empty, no token taken
    req2, _, verdict, _ = decide(req, ans, 100.05, LIM, shared=False)
    assert verdict == ADMIT and req2.tokens == pytest.approx(0.5)
    # 0.15 s after the burst: 0.5 + 10 * 0.1 = 1.5 tokens: one admitted, 0.5 left
    req, ans, verdict, _ = decide(req, ans, 100.15, LIM, shared=True)
    assert verdict == ADMIT and req.tokens == pytest.approx(0.5)


def test_the_shard_is_shared_while_another_key_was_heard_within_a_second():
    assert CONTENTION_S == 1.0
    last = heard((), "a", 10.0)
    assert last == (("a", 10.0),) and not contended(last, "a", 10.5)  # a alone
    last = heard(last, "b", 10.2)
    assert last == (("b", 10.2), ("a", 10.0))
    assert contended(last, "a", 11.2)  # b, 1.0 s ago
    assert not contended(last, "a", 11.25)  # b, 1.05 s ago
    assert contended(last, "b", 11.0) and not contended(last, "b", 11.01)  # a, 1.0 / 1.01 s
    last = heard(last, "b", 10.9)  # b again: a stays the newest other key
    assert last == (("b", 10.9), ("a", 10.0))
    last = heard(last, "c", 11.0)
    assert last == (("c", 11.0), ("b", 10.9), ("a", 10.0))  # LAST_KEYS = 3
    assert heard(last, "d", 11.1) == (("d", 11.1), ("c", 11.0), ("b", 10.9))


def test_a_key_alone_is_never_throttled_one_that_shares_is():
    t = Throttle(LIM)
    assert [t.admit(0.0, b"solo")[0] for _ in range(50)] == [ADMIT] * 50  # a benchmark's client
    assert t.admit(0.1, b"other")[0] == ADMIT
    # solo's bucket emptied at 0.0 (no token was taken past it); 0.2 s at 10/s: 2 tokens
    assert [t.admit(0.2, b"solo")[0] for _ in range(2)] == [ADMIT, ADMIT]
    assert t.admit(0.2, b"solo") == (ANSWER, pytest.approx(0.1))  # other was heard 0.1 s ago


def test_rate_zero_admits_everything_and_keeps_no_state():
    off = Limits(rate=0.0, burst=5, answers_per_s=2.0)
    for _ in range(100):
        req, ans, verdict, retry = decide(None, None, 1.0, off, shared=True)
        assert (req, ans, verdict, retry) == (None, None, ADMIT, 0.0)


def test_answers_zero_answers_every_refusal():
    all_answered = Limits(rate=10.0, burst=1, answers_per_s=0.0)
    req, ans, _, _ = decide(None, None, 0.0, all_answered, shared=True)
    for _ in range(50):
        req, ans, verdict, _ = decide(req, ans, 0.0, all_answered, shared=True)
        assert verdict == ANSWER


def test_a_connection_is_charged_to_its_island_after_hello_and_a_reconnect_keeps_the_bucket():
    t = Throttle(LIM)
    t.admit(0.0, b"someone else")  # the shard is shared from now on
    t.bind(b"c1", "a")
    for _ in range(5):
        assert t.admit(0.0, b"c1")[0] == ADMIT
    assert t.admit(0.0, b"c1")[0] == ANSWER
    assert t.admit(0.0, b"c2")[0] == ADMIT  # another connection, before its hello: its own
    t.bind(b"c2", "a")  # island a reconnected on c2: the same, empty bucket
    assert t.admit(0.0, b"c2")[0] == ANSWER
    assert t.key(b"c1") == b"c1"  # the old connection is charged to itself again
    t.unbind("a")
    assert t.key(b"c2") == b"c2"


def test_an_islands_own_hello_does_not_make_it_contended():
    # the hello is charged to the connection (the island is not known yet); once bound, the
    # connection's entry is the island's: no other key was heard, so no limit applies
    t = Throttle(LIM)
    assert t.admit(0.0, b"c1")[0] == ADMIT  # the hello
    t.bind(b"c1", "a")
    assert [t.admit(0.1, b"c1")[0] for _ in range(50)] == [ADMIT] * 50  # a benchmark's pushes
    # by hand: the entries of the old key become the new one's, each key kept once (newest)
    assert rekey(((b"c1", 2.0), ("b", 1.0)), b"c1", "a") == (("a", 2.0), ("b", 1.0))
    assert rekey((("a", 3.0), (b"c1", 2.0)), b"c1", "a") == (("a", 3.0),)
    assert rekey((("b", 3.0),), b"c1", "a") == (("b", 3.0),)


def test_a_connection_rebinding_to_another_island_forgets_the_first():
    t = Throttle(LIM)
    t.bind(b"c", "a")
    t.bind(b"c", "b")
    assert t.key(b"c") == "b"
    t.bind(b"d", "a")  # a's id, now on d, does not take c back
    assert t.key(b"c") == "b" and t.key(b"d") == "a"


def test_undecodable_requests_are_answered_at_the_answers_rate():
    t = Throttle(LIM)
    assert [t.may_answer(0.0, b"x") for _ in range(3)] == [True, True, False]
    assert t.may_answer(0.5, b"x")  # 0.5 s at 2/s: one token
    assert not t.may_answer(0.5, b"x")
    assert t.may_answer(0.0, b"y")  # another connection has its own


def test_full_buckets_are_forgotten_when_many_keys_were_seen():
    t = Throttle(LIM)
    for i in range(PRUNE_AT):
        t.admit(0.0, b"k%d" % i)  # each key: 4 tokens left
    assert len(t) == PRUNE_AT
    t.admit(1.0, b"late")  # 1 s later every earlier bucket is full again: forgotten
    assert len(t) == 1


def test_the_throttled_refusal_names_the_limit_and_rounds_the_wait_up():
    out = outcomes.throttled(0.0123, 10.0, 5)
    assert (out.status, out.reason, out.retry_after_s) == ("rejected", "throttled", 0.013)
    assert "max_requests_per_s=10" in out.detail and "request_burst=5" in out.detail
    assert outcomes.throttled(1e-6, 10.0, 5).retry_after_s == 0.001
    header = {"kind": "push", "id": 4, "round": 2, "fragment": 1}
    ack = outcomes.render(header, out, version=3)
    assert (ack["kind"], ack["outcome"], ack["reason"]) == ("ack", "rejected", "throttled")
    assert (ack["retry_after_s"], ack["id"], ack["round"]) == (0.013, 4, 2)
    other = outcomes.render({"kind": "heartbeat", "id": 5}, out, version=0)
    assert (other["kind"], other["retry_after_s"], other["id"]) == ("rejected", 0.013, 5)


@pytest.mark.parametrize(
    ("mine", "incoming", "limit", "refused"),
    [
        (0, 500, 100, False),  # nothing of the island pending: its lone delta is admitted
        (60, 40, 100, False),  # 60 + 40 = 100 fits
        (60, 41, 100, True),  # 101 does not
        (99, None, 100, False),  # before decoding: only an island already at its limit
        (100, None, 100, True),
    ],
)
def test_one_island_pending_byte_budget(mine, incoming, limit, refused):
    out = outcomes.island_budget_refusal("a", mine, incoming, limit)
    if not refused:
        assert out is None
        return
    assert (out.status, out.reason) == ("rejected", "too_many_pending")
    assert f"max_pending_bytes_per_island={limit}" in out.detail


def test_pushes_acked_in_order_are_free_a_rejected_one_puts_the_island_under_its_bucket():
    t = Throttle(LIM)
    t.admit(0.0, b"someone else")  # the shard is shared from now on
    t.bind(b"c1", "a")
    assert t.admit(0.0, b"c1", payload=True)[0] == ADMIT  # its first push takes a token
    t.pushed("a", acked=True)
    # 120 fragments pushed at once: none charged, none refused (the bucket holds 5)
    assert all(t.admit(0.0, b"c1", payload=True) == (ADMIT, 0.0) for _ in range(120))
    for _ in range(4):  # requests without payload still take tokens: 4 left of 5
        assert t.admit(0.0, b"c1")[0] == ADMIT
    assert t.admit(0.0, b"c1")[0] == ANSWER
    t.pushed("a", acked=False)  # a rejected push: charged again
    assert t.admit(0.0, b"c1", payload=True)[0] == ANSWER
    t.pushed("a", acked=True)
    assert t.admit(0.0, b"c1", payload=True)[0] == ADMIT
    assert t.admit(0.0, b"c2", payload=True)[0] == ADMIT  # another connection: its own bucket
    t.unbind("a")  # after a bye its connection is charged to itself
    assert t.admit(0.0, b"c1", payload=True)[0] == ADMIT  # c1's own fresh bucket
    assert t.key(b"c1") == b"c1"


def test_an_in_order_islands_connection_is_not_forgotten_with_its_full_bucket():
    t = Throttle(LIM)
    t.bind(b"c1", "a")
    t.pushed("a", acked=True)
    for i in range(PRUNE_AT + 1):  # many keys seen: full buckets are pruned
        t.admit(100.0, f"k{i}".encode())
    assert t.key(b"c1") == "a"  # still charged to (and free as) island a
    assert t.admit(100.0, b"c1", payload=True) == (ADMIT, 0.0)
