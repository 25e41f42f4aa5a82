"""Merge policy: every branch of decide, grace window, arrival EMA, config validation."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paramserver.server.step.policy import (
    ArrivalStats,
    Decision,
    IslandPace,
    PendingDelta,
    PolicyConfig,
    PolicyError,
    decide,
    grace_window,
    observe,
    observe_pace,
    observe_step,
    quorum_time,
)

NO_STATS = ArrivalStats()


def pend(*pairs):
    return [PendingDelta(island, t) for island, t in pairs]


def live(*islands):
    return frozenset(islands)


# -- nothing pending / async -------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "quorum", "async"])
def test_nothing_pending_never_steps(mode):
    d = decide(10.0, [], live("a", "b"), NO_STATS, PolicyConfig(grace_rule="fraction", mode=mode))
    assert d == Decision(False, None, d.reason) and "nothing" in d.reason


def test_async_steps_on_any_pending_even_from_dead_island():
    cfg = PolicyConfig(grace_rule="fraction", mode="async")
    assert decide(1.0, pend(("a", 1.0)), live("a", "b", "c"), NO_STATS, cfg).step
    assert decide(1.0, pend(("gone", 0.5)), live("a"), NO_STATS, cfg).step


# -- sync ---------------------------------------------------------------------------------


def test_sync_waits_for_every_live_island():
    cfg = PolicyConfig(grace_rule="fraction", mode="sync")
    d = decide(5.0, pend(("a", 1.0), ("a", 2.0)), live("a", "b"), NO_STATS, cfg)
    assert not d.step and d.wake_at is None and "1 live" in d.reason
    assert decide(5.0, pend(("a", 1.0), ("b", 4.0)), live("a", "b"), NO_STATS, cfg).step


def test_sync_dead_island_no_longer_blocks_and_dead_pending_still_counts():
    cfg = PolicyConfig(grace_rule="fraction", mode="sync")
    pending = pend(("a", 1.0), ("dead", 0.5))
    assert not decide(2.0, pending, live("a", "b"), NO_STATS, cfg).step
    # b dies: everyone live is pending now.
    assert decide(3.0, pending, live("a"), NO_STATS, cfg).step
    # Only a dead island's delta is pending and nobody is live: still step.
    assert decide(3.0, pend(("dead", 0.5)), live(), NO_STATS, cfg).step


# -- quorum -------------------------------------------------------------------------------


def test_quorum_below_quorum_waits_for_arrivals():
    cfg = PolicyConfig(grace_rule="fraction", mode="quorum", quorum=2)
    d = decide(100.0, pend(("a", 1.0), ("a", 2.0)), live("a", "b", "c"), NO_STATS, cfg)
    assert not d.step and d.wake_at is None and "1 of 2" in d.reason


def test_quorum_grace_window_starts_when_quorum_reached():
    cfg = PolicyConfig(grace_rule="fraction", mode="quorum", quorum=2, grace_min_s=0.5)
    pending = pend(("a", 1.0), ("b", 3.0), ("a", 4.0))
    lv = live("a", "b", "c")
    d = decide(3.2, pending, lv, NO_STATS, cfg)
    assert d == Decision(False, 3.5, d.reason)
    assert decide(3.5, pending, lv, NO_STATS, cfg).step
    assert decide(1000.0, pending, lv, NO_STATS, cfg).step


def test_quorum_reached_at_uses_first_arrival_of_each_island():
    cfg = PolicyConfig(grace_rule="fraction", mode="quorum", quorum=2, grace_min_s=1.0)
    # b first arrives at 2.0; its second delta at 5.0 does not move the deadline.
    pending = pend(("a", 1.0), ("b", 5.0), ("b", 2.0))
    d = decide(2.5, pending, live("a", "b", "c"), NO_STATS, cfg)
    assert d.wake_at == 3.0


def test_quorum_grace_follows_ema_and_is_clamped():
    cfg = PolicyConfig(
        grace_rule="fraction",
        mode="quorum",
        quorum=2,
        grace_fraction=0.5,
        grace_min_s=0.1,
        grace_max_s=4.0,
    )
    pending = pend(("a", 0.0), ("b", 10.0))
    lv = live("a", "b", "c")
    assert decide(10.0, pending, lv, ArrivalStats(2.0, 10.0, 5), cfg).wake_at == 11.0
    assert decide(10.0, pending, lv, ArrivalStats(100.0, 10.0, 5), cfg).wake_at == 14.0
    assert decide(10.0, pending, lv, ArrivalStats(0.01, 10.0, 5), cfg).wake_at == 10.1
    assert decide(10.0, pending, lv, NO_STATS, cfg).wake_at == 10.1


def test_quorum_steps_at_once_when_every_live_island_is_pending():
    cfg = PolicyConfig(grace_rule="fraction", mode="quorum", quorum=2, grace_min_s=5.0)
    d = decide(1.0, pend(("a", 1.0), ("b", 1.0)), live("a", "b"), NO_STATS, cfg)
    assert d.step and d.wake_at is None


def test_quorum_shrinks_to_live_islands_when_islands_die():
    cfg = PolicyConfig(grace_rule="fraction", mode="quorum", quorum=3, grace_min_s=1.0)
    # Only a is live and pending: it is everyone, step now.
    assert decide(1.0, pend(("a", 1.0)), live("a"), NO_STATS, cfg).step
    # Two live islands, quorum 3 -> needs 2; a dead island's delta counts toward it.
    d = decide(2.0, pend(("a", 1.0), ("dead", 1.5)), live("a", "b"), NO_STATS, cfg)
    assert not d.step and d.wake_at == 2.5
    # Nobody is live: needed = 1, and all (zero) live islands are pending.
    assert decide(2.0, pend(("dead", 1.5)), live(), NO_STATS, cfg).step


def test_quorum_of_one_is_a_grace_window_after_the_first_delta():
    cfg = PolicyConfig(grace_rule="fraction", mode="quorum", quorum=1, grace_min_s=0.2)
    pending = pend(("a", 1.0))
    lv = live("a", "b")
    assert decide(1.1, pending, lv, NO_STATS, cfg).wake_at == pytest.approx(1.2)
    assert decide(1.2, pending, lv, NO_STATS, cfg).step


def test_clock_before_arrival_waits_until_deadline():
    # A now earlier than the arrivals (clock skew between threads) just waits.
    cfg = PolicyConfig(grace_rule="fraction", mode="quorum", quorum=2, grace_min_s=0.5)
    d = decide(0.0, pend(("a", 1.0), ("b", 2.0)), live("a", "b", "c"), NO_STATS, cfg)
    assert not d.step and d.wake_at == 2.5


def test_zero_grace_steps_as_soon_as_quorum_is_reached():
    cfg = PolicyConfig(
        grace_rule="fraction", mode="quorum", quorum=2, grace_min_s=0.0, grace_max_s=0.0
    )
    assert decide(2.0, pend(("a", 1.0), ("b", 2.0)), live("a", "b", "c"), NO_STATS, cfg).step


@settings(max_examples=200, deadline=None)
@given(
    mode=st.sampled_from(["sync", "quorum", "async"]),
    quorum=st.integers(1, 4),
    arrivals=st.lists(
        st.tuples(st.sampled_from("abcde"), st.floats(0, 100, allow_nan=False)), max_size=8
    ),
    alive=st.sets(st.sampled_from("abcde")),
    ema=st.one_of(st.none(), st.floats(0, 200, allow_nan=False)),
    now=st.floats(0, 200, allow_nan=False),
    later=st.floats(0, 1000, allow_nan=False),
)
def test_once_due_stays_due_and_wake_at_is_when_it_becomes_due(
    mode, quorum, arrivals, alive, ema, now, later
):
    cfg = PolicyConfig(
        grace_rule="fraction", mode=mode, quorum=quorum, grace_min_s=0.05, grace_max_s=30.0
    )
    stats = ArrivalStats(ema, None, 0)
    pending = pend(*arrivals)
    d = decide(now, pending, frozenset(alive), stats, cfg)
    if d.step:
        assert decide(now + later, pending, frozenset(alive), stats, cfg).step
    elif d.wake_at is not None:
        assert d.wake_at > now
        assert decide(d.wake_at, pending, frozenset(alive), stats, cfg).step
    if not pending:
        assert not d.step


def test_decide_rejects_bad_times():
    cfg = PolicyConfig(grace_rule="fraction")
    with pytest.raises(PolicyError, match="now=nan"):
        decide(math.nan, pend(("a", 1.0)), live("a"), NO_STATS, cfg)
    with pytest.raises(PolicyError, match="arrival"):
        decide(1.0, pend(("a", math.inf)), live("a"), NO_STATS, cfg)


# -- arrival statistics -------------------------------------------------------------------


def test_observe_builds_ema_of_interarrival_times():
    s = observe(ArrivalStats(), 10.0, alpha=0.5)
    assert s == ArrivalStats(None, 10.0, 1)
    s = observe(s, 12.0, alpha=0.5)
    assert s == ArrivalStats(2.0, 12.0, 2)
    s = observe(s, 16.0, alpha=0.5)
    assert s == ArrivalStats(3.0, 16.0, 3)


def test_observe_is_pure_and_treats_clock_going_back_as_zero_gap():
    s0 = ArrivalStats(2.0, 10.0, 2)
    s1 = observe(s0, 9.0, alpha=0.5)
    assert s0 == ArrivalStats(2.0, 10.0, 2)
    assert s1 == ArrivalStats(1.0, 10.0, 3)


def test_observe_validates():
    with pytest.raises(PolicyError, match="alpha=0"):
        observe(ArrivalStats(), 1.0, alpha=0)
    with pytest.raises(PolicyError, match="now=inf"):
        observe(ArrivalStats(), math.inf)


def test_grace_window_before_and_after_ema():
    cfg = PolicyConfig(grace_rule="fraction", grace_fraction=0.25, grace_min_s=0.5, grace_max_s=2.0)
    assert grace_window(ArrivalStats(), cfg) == 0.5
    assert grace_window(ArrivalStats(4.0, 1.0, 3), cfg) == 1.0
    assert grace_window(ArrivalStats(40.0, 1.0, 3), cfg) == 2.0


# -- config -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mode": "eventual"}, "mode='eventual'"),
        ({"quorum": 0}, "quorum=0"),
        ({"quorum": 2.0}, "quorum=2.0"),
        ({"grace_fraction": -1.0}, "grace_fraction=-1.0"),
        ({"grace_min_s": math.nan}, "grace_min_s=nan"),
        ({"grace_min_s": 5.0, "grace_max_s": 1.0}, "grace_max_s=1.0: must be >= grace_min_s=5.0"),
        ({"ema_alpha": 0.0}, "ema_alpha=0.0"),
        ({"ema_alpha": 1.5}, "ema_alpha=1.5"),
    ],
)
def test_policy_config_validation(kwargs, match):
    with pytest.raises(PolicyError, match=match):
        PolicyConfig(grace_rule="fraction", **kwargs)


def test_policy_config_defaults_and_is_frozen():
    cfg = PolicyConfig(grace_rule="fraction")
    assert (cfg.mode, cfg.quorum, cfg.grace_fraction) == ("quorum", 2, 0.5)
    with pytest.raises(AttributeError):
        cfg.quorum = 3


# -- eq3 grace rule (Decoupled DiLoCo Eq. 3) ---------------------------------------------
EQ3 = PolicyConfig(mode="quorum", quorum=1, grace_rule="eq3", grace_gamma=0.5, grace_min_s=0.0)


def test_eq3_window_spends_gamma_of_the_slack():
    stats = ArrivalStats(ema_quorum_s=1.0, ema_sync_s=0.5)
    # 0.5 * (tau * t_step - 1.0 - 0.5), tau * t_step = 10 s: 4.25
    assert grace_window(stats, EQ3, overlap_s=10.0) == pytest.approx(4.25)
    # no slack left: clamped to the lower bound
    assert grace_window(stats, EQ3, overlap_s=1.0) == 0.0
    capped = PolicyConfig(quorum=1, grace_rule="eq3", grace_max_s=2.0, grace_min_s=0.1)
    assert grace_window(stats, capped, overlap_s=10.0) == 2.0
    # unmeasured EMAs count as 0; without any pace the window is grace_min_s
    assert grace_window(ArrivalStats(), EQ3, overlap_s=10.0) == pytest.approx(5.0)
    assert grace_window(stats, capped, overlap_s=None) == 0.1


def test_eq3_tau_is_the_overlap_one_inner_step_by_default_not_h():
    assert EQ3.grace_overlap_steps == 1
    paces = {"a": IslandPace(0.4, 50)}  # 0.4 s per inner step, H = 50 (a 20-s round)
    stats = ArrivalStats(ema_quorum_s=0.05, ema_sync_s=0.05)
    alive = live("a", "b")
    # tau = 1: 0.5 * (1 * 0.4 - 0.05 - 0.05) = 0.15 s (tau = H gave 0.5 * 19.9 = 9.95 s)
    d = decide(10.0, pend(("a", 10.0)), alive, stats, EQ3, paces)
    assert d.wake_at == pytest.approx(10.15)
    # configurable: tau = 5 inner steps: 0.5 * (2.0 - 0.1) = 0.95 s
    five = PolicyConfig(mode="quorum", quorum=1, grace_rule="eq3", grace_min_s=0.0,
                        grace_overlap_steps=5)  # fmt: skip
    assert decide(10.0, pend(("a", 10.0)), alive, stats, five, paces).wake_at == pytest.approx(
        10.95
    )
    with pytest.raises(PolicyError, match="grace_overlap_steps"):
        PolicyConfig(grace_overlap_steps=0)


def test_eq3_decide_uses_the_fastest_quorum_island_and_waits_for_a_second():
    # tau = 4 inner steps: overlaps 0.4 s and 0.8 s
    cfg = PolicyConfig(mode="quorum", quorum=1, grace_rule="eq3", grace_gamma=0.5,
                       grace_min_s=0.0, grace_overlap_steps=4)  # fmt: skip
    paces = {"fast": IslandPace(0.1, 20), "slow": IslandPace(0.2, 20)}
    pending = pend(("fast", 10.0))
    alive = live("fast", "slow")
    # quorum of 1 reached at 10.0 by "fast": grace 0.5 * 0.4 = 0.2, so wait until 10.2
    d = decide(10.1, pending, alive, ArrivalStats(), cfg, paces)
    assert not d.step and d.wake_at == pytest.approx(10.2)
    assert decide(10.2, pending, alive, ArrivalStats(), cfg, paces).step
    # the slow island arriving inside the window completes the set: step at once
    both = pend(("fast", 10.0), ("slow", 10.15))
    assert decide(10.15, both, alive, ArrivalStats(), cfg, paces).step
    # no reported pace: grace_min_s (0 here), step at once
    assert decide(10.0, pending, alive, ArrivalStats(), cfg, {}).step


def test_fraction_rule_ignores_paces():
    cfg = PolicyConfig(grace_rule="fraction", mode="quorum", quorum=1, grace_min_s=0.2)
    paces = {"a": IslandPace(1.0, 100)}
    d = decide(0.0, pend(("a", 0.0)), live("a", "b"), ArrivalStats(), cfg, paces)
    assert d.wake_at == pytest.approx(0.2)


def test_observe_step_and_pace_are_emas():
    s = observe_step(ArrivalStats(), 2.0, 0.4, alpha=0.5)
    assert (s.ema_quorum_s, s.ema_sync_s) == (2.0, 0.4)
    s = observe_step(s, None, 0.2, alpha=0.5)  # no quorum sample: quorum EMA unchanged
    assert (s.ema_quorum_s, s.ema_sync_s) == (2.0, pytest.approx(0.3))
    s = observe_step(s, -1.0, 0.0, alpha=0.5)  # negative counts as 0
    assert s.ema_quorum_s == pytest.approx(1.0)
    p = observe_pace(None, 0.2, 30, alpha=0.5)
    assert p == IslandPace(0.2, 30) and p.round_s == pytest.approx(6.0)
    p = observe_pace(p, 0.4, None, alpha=0.5)  # a heartbeat: step time only
    assert p == IslandPace(pytest.approx(0.3), 30)
    assert observe_pace(p, None, 10) == IslandPace(p.step_s, 10)
    assert observe_pace(None, None, 10) is None
    assert IslandPace(0.5).round_s is None
    with pytest.raises(PolicyError):
        observe_pace(None, float("inf"), 1)


def test_quorum_time_is_first_arrival_to_quorum():
    cfg = PolicyConfig(grace_rule="fraction", mode="quorum", quorum=2)
    pending = pend(("a", 1.0), ("a", 1.5), ("b", 3.5), ("c", 4.0))
    assert quorum_time(pending, live("a", "b", "c"), cfg) == pytest.approx(2.5)
    assert quorum_time(pend(("a", 1.0)), live("a", "b"), cfg) is None


@pytest.mark.parametrize("kw", [{"grace_rule": "median"}, {"grace_gamma": 1.0},
                                {"grace_gamma": 0.0}, {"grace_gamma": float("nan")}])  # fmt: skip
def test_bad_grace_settings_are_refused(kw):
    with pytest.raises(PolicyError, match=next(iter(kw))):
        PolicyConfig(**kw)
