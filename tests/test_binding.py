"""paramserver.server.admission.gate: which connection may act as an island id (pure rules, explicit time)."""

import pytest

from paramserver.server.admission.gate import (
    IN_USE,
    OWN,
    SAY_HELLO,
    Binding,
    Bindings,
    may_take_over,
)

A, B = b"\x00conn-a", b"\x00conn-b"


@pytest.mark.parametrize(
    ("bound", "conn", "session", "now", "allowed"),
    [
        (None, B, None, 100.0, True),  # a free id
        (Binding(A, None, 99.9), A, None, 100.0, True),  # the same connection again
        (Binding(A, "s1", 99.9), B, "s1", 100.0, True),  # the same client on a new socket
        (Binding(A, "s1", 99.9), B, "s2", 100.0, False),  # another process, heard just now
        (Binding(A, None, 99.9), B, None, 100.0, False),  # no session: the silence decides
        (Binding(A, None, 98.0), B, None, 100.0, False),  # silent exactly quiet_s
        (Binding(A, None, 97.9), B, None, 100.0, True),  # silent longer than quiet_s
        (Binding(A, None, 97.9), B, "s1", 100.0, True),
    ],
)
def test_may_take_over(bound, conn, session, now, allowed):
    assert may_take_over(now, bound, conn, session, quiet_s=2.0) is allowed


def test_quiet_time_is_two_intervals_or_the_whole_liveness_budget_if_shorter():
    assert Bindings(0.5, 5).quiet_s == 1.0
    assert Bindings(0.5, 1).quiet_s == 0.5


def test_verdicts_follow_the_bound_connection_and_its_silence():
    b = Bindings(1.0, 5)  # quiet after 2 s
    assert b.verdict("x", A, 10.0) == OWN  # unbound ids are served as before
    b.bind("x", Binding(A, None, 10.0))
    assert b.verdict("x", B, 11.5) == IN_USE
    assert b.verdict("x", A, 11.9) == OWN  # refreshes the binding
    assert b.verdict("x", B, 13.5) == IN_USE  # 1.6 s after A was last heard
    assert b.verdict("x", B, 14.0) == SAY_HELLO  # A silent > 2 s: hello takes it over
    assert not b.may_bind("x", B, None, 13.0) and b.may_bind("x", B, None, 14.0)
    b.bind("x", Binding(B, None, 14.0))
    assert b.verdict("x", A, 14.1) == IN_USE
    detail = b.in_use_detail("x", 14.1)
    assert "'x'" in detail and "another connection" in detail and "2 s" in detail


def test_forget_and_prune():
    b = Bindings(1.0, 5)
    for island in ("x", "y", "z"):
        b.bind(island, Binding(A, None, 0.0))
    b.forget("x")
    assert b.verdict("x", B, 0.1) == OWN and len(b) == 2
    b.prune({"z"})
    assert len(b) == 1 and b.verdict("y", B, 0.1) == OWN and b.verdict("z", B, 0.1) == IN_USE


def test_an_id_under_a_session_needs_its_token_until_the_island_is_dead():
    bound = Binding(A, "s1", 90.0)
    # silent 4 s: past quiet_s (2) but within expire_s (5): only the token takes it
    assert not may_take_over(94.0, bound, B, None, quiet_s=2.0, expire_s=5.0)
    assert not may_take_over(94.0, bound, B, "s2", quiet_s=2.0, expire_s=5.0)
    assert may_take_over(94.0, bound, B, "s1", quiet_s=2.0, expire_s=5.0)
    assert may_take_over(95.1, bound, B, None, quiet_s=2.0, expire_s=5.0)  # dead: expired
    b = Bindings(1.0, 5)
    b.bind("x", bound)
    assert b.expire_s == 5.0 and not b.may_bind("x", B, None, 94.0)
    assert "session token" in b.in_use_detail("x", 94.0)


C = b"\x00conn-c"


def test_an_attached_connection_acts_as_the_island_until_a_hello_moves_the_id():
    b = Bindings(1.0, 5)  # quiet after 2 s
    assert b.attach_refusal("x", "s1") == "unknown_island"  # nothing bound: plain hello first
    b.bind("x", Binding(A, "s1", 10.0))
    assert b.attach_refusal("x", "s2") == "island_in_use"
    assert b.attach_refusal("x", None) == "island_in_use"
    assert b.attach_refusal("x", "s1") is None
    assert b.attach("x", B, 10.5) is None
    assert b.verdict("x", B, 11.0) == OWN and b.verdict("x", A, 11.0) == OWN
    assert b.verdict("x", C, 11.0) == IN_USE
    # heard on the attached connection only (the bound one busy or quiet): still held
    assert b.verdict("x", B, 12.8) == OWN and b.verdict("x", C, 13.5) == IN_USE
    b.bind("x", Binding(A, "s1", 14.0))  # hello again on the bound connection: B stays
    assert b.verdict("x", B, 14.1) == OWN
    b.bind("x", Binding(C, "s1", 15.0))  # a hello that moves the id lets B go
    assert b.verdict("x", B, 15.1) == IN_USE and b.verdict("x", A, 15.1) == IN_USE


def test_an_unbound_id_is_never_taken_by_an_attach_and_a_session_less_one_cannot_attach():
    b = Bindings(1.0, 5)
    b.bind("x", Binding(A, None, 0.0))
    assert b.attach_refusal("x", None) == "island_in_use"
    assert b.attach_refusal("y", "s1") == "unknown_island"


def test_at_most_max_attached_connections_the_least_recently_heard_goes():
    from paramserver.server.admission.gate import MAX_ATTACHED

    b = Bindings(1.0, 5)
    b.bind("x", Binding(A, "s", 0.0))
    conns = [bytes([0, i]) for i in range(MAX_ATTACHED + 1)]
    for i, conn in enumerate(conns[:MAX_ATTACHED]):
        assert b.attach("x", conn, float(i)) is None
    b.verdict("x", conns[0], 100.0)  # heard lately: the second one is the oldest now
    assert b.attach("x", conns[-1], 101.0) == conns[1]
    assert b.verdict("x", conns[0], 101.0) == OWN and b.verdict("x", conns[1], 101.0) == IN_USE


def test_a_throttle_charges_every_connection_of_an_island_to_it():
    from paramserver.server.admission.gate import Limits, Throttle

    t = Throttle(Limits(rate=1.0, burst=1, answers_per_s=0.0))
    t.bind(A, "x")
    t.attach(B, "x")
    assert t.key(A) == "x" and t.key(B) == "x"
    t.bind(C, "x")  # moved: A and B are charged to themselves again
    assert t.key(A) == A and t.key(B) == B and t.key(C) == "x"
    t.attach(B, "x")
    t.detach(B)
    assert t.key(B) == B
    t.attach(A, "x")
    t.unbind("x")
    assert t.key(A) == A and t.key(C) == C
