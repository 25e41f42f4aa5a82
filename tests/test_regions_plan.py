"""The regions bench's pure parts: the scaling rule, the RTT check, the default table, flags."""

from __future__ import annotations

import pytest

from bench import regions_plan
from bench.children.wan_relay import chunk_loss_probability
from bench.regions_plan import LINKS, REGIONS, Link, rescale


def test_every_link_held_keeps_the_scale() -> None:
    configured = {(0, 1): 20.0, (0, 2): 50.0}
    achieved = {(0, 1): 19.0, (0, 2): 45.0}  # 95% and 90%: both at or above 90%
    decision = rescale(0.01, configured, achieved)
    assert decision.scale == 0.01
    assert decision.factor == 1.0
    assert decision.short == ()


def test_the_worst_short_link_scales_every_link() -> None:
    configured = {(0, 1): 20.0, (0, 2): 50.0, (1, 2): 40.0}
    # 0-1 carries 95%, 0-2 carries 40/50 = 80%, 1-2 carries 34/40 = 85%
    achieved = {(0, 1): 19.0, (0, 2): 40.0, (1, 2): 34.0}
    decision = rescale(0.01, configured, achieved)
    assert decision.factor == pytest.approx(0.8)
    assert decision.scale == pytest.approx(
        0.008
    )  # 0.01 x 0.8: every rate is now Gbit/s x 1000 x 0.008
    assert [(a, b) for a, b, _ in decision.short] == [(0, 2), (1, 2)]  # worst first
    assert decision.short[0][2] == pytest.approx(0.8)
    assert decision.short[1][2] == pytest.approx(0.85)


def test_emulated_rate_is_real_rate_times_scale() -> None:
    # 2 Gbit/s at scale 0.01 is 20 Mbit/s; the RTT is not scaled
    link = Link(0, 2, 2.0, 80.0)
    assert regions_plan.emulated_mbit(link, 0.01) == pytest.approx(20.0)
    assert regions_plan.emulated_mbit(link, 0.008) == pytest.approx(16.0)


def test_rtt_check_is_ten_percent_both_ways() -> None:
    assert regions_plan.rtt_within(40.0, 43.9)
    assert regions_plan.rtt_within(40.0, 36.1)
    assert not regions_plan.rtt_within(40.0, 44.5)
    assert not regions_plan.rtt_within(40.0, 35.5)


def test_default_table() -> None:
    assert len(REGIONS) == 4
    assert sorted(r.island_speed for r in REGIONS) == [0.55, 0.55, 1.0, 1.0]
    assert len(LINKS) == 6  # every pair of 4 regions
    assert {(ln.a, ln.b) for ln in LINKS} == {(a, b) for a in range(4) for b in range(a + 1, 4)}
    assert all(30.0 <= ln.rtt_ms <= 80.0 for ln in LINKS)
    assert all(2.0 <= ln.gbit <= 5.0 for ln in LINKS)
    assert [ln.loss for ln in LINKS if ln.loss] == [0.001]


def test_shard_regions_flag() -> None:
    assert regions_plan.parse_regions_list("0", 4) == [0]
    assert regions_plan.parse_regions_list("us-west,0,2", 4) == [2, 0]
    with pytest.raises(ValueError):
        regions_plan.parse_regions_list("3", 3)
    with pytest.raises(ValueError):
        regions_plan.parse_regions_list("mars", 4)


def test_chunk_loss_probability() -> None:
    # one packet: p itself; two packets (1449 bytes): 1 - (1 - p)^2
    assert chunk_loss_probability(100, 0.01) == pytest.approx(0.01)
    assert chunk_loss_probability(1449, 0.01) == pytest.approx(1 - 0.99**2)
    assert chunk_loss_probability(10_000, 0.0) == 0.0


def test_island_report_against_bytes_over_bandwidth() -> None:
    from bench.regions_run import island_report

    link = Link(0, 2, 2.0, 80.0)  # at scale 0.01: 20 Mbit/s
    result = {
        "island": "island-us-west",
        "speed": 1.0,
        "rounds": [
            # 1,000,000 bytes over 20 Mbit/s = 0.4 s, plus one RTT 0.08 s = 0.48 s
            {"round": 0, "seconds": 0.6, "bytes_sent": 1_000_000, "ack_latency_s": [0.5, 0.59]},
        ],
        "status_rtt": [
            {"at": 1.0, "seconds": 0.2, "in_transfer": True},
            {"at": 2.0, "seconds": 6.0, "in_transfer": True},
            {"at": 3.0, "seconds": 0.09, "in_transfer": False},
        ],
        "client": {},
        "failed": "",
    }
    report = island_report(result, 2, [0], [link], 0.01)
    (line,) = report["rounds"]
    assert line["bytes_over_bandwidth_s"] == pytest.approx(0.48)
    assert line["ratio"] == pytest.approx(0.6 / 0.48)  # 1.25
    assert line["ack_latency_s_max"] == pytest.approx(0.59)
    control = report["control_latency_s"]
    assert control["in_transfer"]["n"] == 2
    assert control["in_transfer"]["max"] == pytest.approx(6.0)
    assert control["idle"]["p50"] == pytest.approx(0.09)
    assert control["liveness_interval_s"] == 5.0  # 1 s heartbeats x liveness 5
    assert control["max_under_liveness"] is False  # 6 s > 5 s
    assert report["links_to_shards"] == [{"link": "us-east-us-west", "mbit": 20.0, "rtt_ms": 80.0}]
    # the island of the shard's own region has no link: no bandwidth figure
    local = island_report({**result, "island": "island-us-east"}, 0, [0], [link], 0.01)
    assert local["rounds"][0]["ratio"] is None
    assert local["links_to_shards"] == []


def test_bytes_over_bandwidth_with_spread_shards() -> None:
    from bench.regions_run import bytes_over_bandwidth_s

    links = [Link(0, 1, 5.0, 30.0), Link(0, 2, 2.0, 80.0), Link(1, 2, 3.0, 50.0)]
    # island in us-central, shards in us-east and us-west, scale 0.01: 50 and 30 Mbit/s.
    # 3,000,000 bytes, half to each: 1.5e6 x 8 / 50e6 = 0.24 s, 1.5e6 x 8 / 30e6 = 0.4 s;
    # the slower sets the time, plus the larger RTT (50 ms): 0.45 s
    assert bytes_over_bandwidth_s(3_000_000, 1, [0, 2], links, 0.01) == pytest.approx(0.45)
    # island in us-east: its own shard costs nothing, the other half goes at 20 Mbit/s
    # (1.5e6 x 8 / 20e6 = 0.6 s) plus 80 ms
    assert bytes_over_bandwidth_s(3_000_000, 0, [0, 2], links, 0.01) == pytest.approx(0.68)
    assert bytes_over_bandwidth_s(3_000_000, 0, [0], links, 0.01) is None
