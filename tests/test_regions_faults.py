"""The regions bench's fault scoring (pure), with hand-computed inputs where each "met" flag falls.

Times are made up seconds on one clock; every expected figure is worked out
in the comments.
"""

from __future__ import annotations

import pytest

from bench import regions_faults as rf
from bench.regions_faults import FaultWindow, Round

NAMES = {0: "east", 1: "west"}


def _rounds(starts_and_seconds: list[tuple[float, float]], fragments: int = 2) -> list[Round]:
    return [Round(k, s, s + d, fragments, fragments) for k, (s, d) in enumerate(starts_and_seconds)]


def test_recovery_met_and_fallen() -> None:
    # medians: before 1.0 (of 0.9, 1.0, 1.2), after 1.5 (of 1.4, 1.5, 1.6): 1.5 <= 1.5 x 1.0 + 0.1
    met = rf.recovery([0.9, 1.0, 1.2], [1.4, 1.5, 1.6])
    assert met["before_s"] == 1.0 and met["after_s"] == 1.5 and met["ratio"] == 1.5
    assert met["met"] is True
    # after 1.7 > 1.6: falls
    assert rf.recovery([0.9, 1.0, 1.2], [1.7, 1.7]) ["met"] is False  # fmt: skip
    # a 10 ms round that doubles stays within the 0.1 s slack: 0.02 <= 1.5 x 0.01 + 0.1
    assert rf.recovery([0.01], [0.02])["met"] is True
    # without a figure on one side: unknown
    assert rf.recovery([], [1.0])["met"] is None


def test_span_ends_at_the_affected_islands_first_round_after_the_fault() -> None:
    w = FaultWindow("partition", 1, start=10.0, end=20.0)
    # rounds of west end at 5, 25, 31: the first at or after 20 is 25
    west = _rounds([(3.0, 2.0), (22.0, 3.0), (30.0, 1.0)])
    assert rf.span_end(w, west, run_end=40.0) == 25.0
    assert rf.span_end(w, west[:1], run_end=40.0) == 40.0


def _two_island_run() -> dict[int, list[Round]]:
    # east: 1 s rounds every 2 s, starting at 0, 2, ..., 38 (ends at 1, 3, ..., 39)
    east = _rounds([(2.0 * k, 1.0) for k in range(20)])
    # west: 2 s rounds at 0, 4, 8 (ends 2, 6, 10), a 12 s one at 12 (ends 24: the fault),
    # then 2 s rounds at 26, 30, 34 (ends 28, 32, 36)
    west = _rounds([(0.0, 2.0), (4.0, 2.0), (8.0, 2.0), (12.0, 12.0),
                    (26.0, 2.0), (30.0, 2.0), (34.0, 2.0)])  # fmt: skip
    return {0: east, 1: west}


def test_score_faults_training_during_and_recovery() -> None:
    rounds = _two_island_run()
    w = FaultWindow("cut_link", 1, start=12.0, end=22.0)
    (f,) = rf.score_faults([w], rounds, NAMES, t0=0.0, run_end=40.0)
    # span: west's first round ending at or after 22 ends at 24
    assert f["span_end_s"] == 24.0 and f["recovery_s"] == 2.0
    # east settles rounds ending at 13, 15, ..., 23 inside [12, 24]: 6
    assert f["rounds_during"] == {"east": 6}
    assert f["trained_during"] is True
    # west: before (ended before 12): 2, 2, 2 -> 2; after (started at/after 24): 2, 2, 2 -> 2
    assert f["recovery"]["west"]["before_s"] == 2.0
    assert f["recovery"]["west"]["after_s"] == 2.0
    # east: before: ends 1..11 (6 rounds of 1 s); after: starts 24..38 (8 rounds of 1 s)
    assert f["recovery"]["east"]["n_before"] == 6 and f["recovery"]["east"]["n_after"] == 8
    assert f["recovered"] is True


def test_score_faults_flags_fall() -> None:
    rounds = _two_island_run()
    # east stops settling rounds during the fault: no round of east ends in [12, 24]
    rounds[0] = [r for r in rounds[0] if not 12.0 <= r.ended <= 24.0]
    # west's rounds after the fault take 3.2 s: 3.2 > 1.5 x 2 + 0.1 = 3.1
    rounds[1] = [
        Round(r.round, r.started, r.started + 3.2, r.acked, r.fragments) if r.started >= 26 else r
        for r in rounds[1]
    ]
    w = FaultWindow("cut_link", 1, start=12.0, end=22.0)
    (f,) = rf.score_faults([w], rounds, NAMES, t0=0.0, run_end=40.0)
    assert f["rounds_during"] == {"east": 0}
    assert f["trained_during"] is False
    assert f["recovery"]["west"]["after_s"] == pytest.approx(3.2)
    assert f["recovery"]["west"]["met"] is False
    assert f["recovered"] is False


def test_before_rounds_start_after_the_previous_fault_span() -> None:
    rounds = _two_island_run()
    first = FaultWindow("kill_island", 1, start=12.0, end=14.0)  # span to 24 (west's round)
    second = FaultWindow("partition", 1, start=29.0, end=29.5)  # west's next: ends 32
    f1, f2 = rf.score_faults([first, second], rounds, NAMES, t0=0.0, run_end=40.0)
    # the first fault's "after" stops at the second's start: west's rounds at 26 (ends 28)
    assert f1["recovery"]["west"]["n_after"] == 1
    # the second's "before": west's rounds ending in [24, 29): the one of 12 s ending at 24,
    # and the one ending at 28 -> median (12 + 2) / 2 = 7
    assert f2["recovery"]["west"]["n_before"] == 2
    assert f2["recovery"]["west"]["before_s"] == 7.0
    assert f2["span_end_s"] == 32.0


def test_acked_equals_applied_and_a_double_application_falls() -> None:
    # west settled round 0 and 1 (2 fragments each) and round 1 again after a restart
    west = [Round(0, 0, 1, 2, 2), Round(1, 2, 3, 2, 2), Round(1, 5, 6, 2, 2)]
    east = [Round(0, 0, 1, 2, 2)]
    rounds = {0: east, 1: west}
    names = {0: "island-east", 1: "island-west"}
    ok = rf.acked_vs_applied(rounds, names, {"island-east": 2, "island-west": 4}, duplicates=2)
    assert ok["per_island"]["island-west"] == {"acked": 4, "applied": 4}  # round 1 counts once
    assert ok["acked"] == 6 and ok["applied"] == 6
    assert ok["acked_equals_applied"] is True
    # a delta applied twice (5 accepted for 4 distinct acked): falls
    bad = rf.acked_vs_applied(rounds, names, {"island-east": 2, "island-west": 5}, duplicates=2)
    assert bad["acked_equals_applied"] is False
    # an acked delta lost (3 accepted): falls
    lost = rf.acked_vs_applied(rounds, names, {"island-east": 2, "island-west": 3}, duplicates=0)
    assert lost["acked_equals_applied"] is False


def test_region_goodput() -> None:
    # compute 1 s per round; rounds start pushing at 1, 4, 10 (ends 2, 5, 11); the second
    # round has one fragment of two unacked: useful = 2 rounds x 1 s; wall from 1 - 1 = 0 to 11
    rounds = [Round(0, 1.0, 2.0, 2, 2), Round(1, 4.0, 5.0, 1, 2), Round(2, 10.0, 11.0, 2, 2)]
    g = rf.region_goodput(rounds, compute_s=1.0)
    assert g == {"useful_s": 2.0, "wall_s": 11.0, "goodput": round(2.0 / 11.0, 4)}
    # until 6: rounds 0 and 1 (1 useful s) over 0..6
    assert rf.region_goodput(rounds, 1.0, until=6.0)["goodput"] == round(1.0 / 6.0, 4)
    assert rf.region_goodput([], 1.0)["goodput"] is None


def test_link_utilisation_from_counters_and_rate_changes() -> None:
    from types import SimpleNamespace

    from bench import netns
    from bench.regions_run import LinkSampler

    topo = SimpleNamespace(links=[netns.LinkShape(0, 1, mbit=10.0, rtt_ms=30.0)])
    sampler = LinkSampler(topo)  # type: ignore[arg-type]  (only its links are read)
    # the link at 10 Mbit/s from t = 0, cut to 1 Mbit/s at t = 1.5
    sampler.rates = [(0.0, {(0, 1): 10.0}), (1.5, {(0, 1): 1.0})]
    # towards region 0: 1,250,000 B in [0, 1] = 10 Mbit/s; then 125,000 B per second = 1 Mbit/s
    sampler.samples = [
        (0.0, {(0, 1): 0, (1, 0): 0}),
        (1.0, {(0, 1): 1_250_000, (1, 0): 0}),
        (2.0, {(0, 1): 1_375_000, (1, 0): 0}),
        (3.0, {(0, 1): 1_500_000, (1, 0): 0}),
    ]
    rows = {row["towards"]: row for row in sampler.utilisation(t0=0.0)}
    east = rows["us-east"]
    assert east["link"] == "us-east-us-central" and east["mbit"] == 10.0
    # [0, 1]: 10 of 10 Mbit/s; [1, 2] spans the change: against the larger rate, 1 of 10;
    # [2, 3]: 1 of 1
    assert east["points"] == [[1.0, 10.0, 1.0], [2.0, 1.0, 0.1], [3.0, 1.0, 1.0]]
    assert [p[1] for p in rows["us-central"]["points"]] == [0.0, 0.0, 0.0]
