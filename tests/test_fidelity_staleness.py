"""The price of staleness in the fidelity report (`bench.fidelity_staleness`), by hand."""

from __future__ import annotations

import pytest

from bench import fidelity_report, fidelity_staleness

pytestmark = pytest.mark.timeout(30)


def test_histogram_sums_seeds_in_staleness_order_and_its_mean():
    records = [
        {"server": {"staleness_histogram": {"0": 6, "2": 1}}},
        {"server": {"staleness_histogram": {"1": 2, "0": 1}}},
        {},  # a run whose shards did not answer
    ]
    hist = fidelity_staleness.histogram(records)
    assert list(hist.items()) == [("0", 7), ("1", 2), ("2", 1)]
    assert fidelity_staleness.mean_staleness(hist) == pytest.approx((0 * 7 + 1 * 2 + 2 * 1) / 10)
    assert fidelity_staleness.mean_staleness({}) is None


def test_losses_at_equal_tokens_and_equal_wall_time_interpolate_each_curve():
    # ours: 200 tokens in 20 s; the reference: 100 tokens in 40 s
    ours = [(0.0, 0, 4.0), (10.0, 100, 3.0), (20.0, 200, 2.0)]
    ref = [(0.0, 0, 4.0), (40.0, 100, 2.5)]
    at = fidelity_staleness.at_equal(ours, ref)
    assert (at["tokens"], at["seconds"]) == (100, 20.0)
    assert at["ours_at_tokens"] == 3.0 and at["ref_at_tokens"] == 2.5
    assert at["ours_at_time"] == 2.0 and at["ref_at_time"] == pytest.approx(4.0 - 1.5 / 2)
    assert fidelity_staleness.at_equal([], ref)["ours_at_tokens"] is None


def _entry(name, mode, curves, hist=None, h=10, group="B", loss=2.0):
    return {"name": name, "mode": mode, "group": group, "inner_steps": h,
            "eval_curves": curves, "staleness_histogram": hist or {},
            "final_eval_loss": loss}  # fmt: skip


def test_price_compares_async_runs_with_their_groups_sync_of_the_same_h_and_ddp():
    ours = [(0.0, 0, 4.0), (10.0, 100, 3.0)]
    entries = {
        "k1": _entry("k1", "quorum", [ours, ours], {"0": 3, "1": 1}),
        "sync_h10": _entry("sync_h10", "sync", [[(0.0, 0, 4.0), (20.0, 100, 2.0)]] * 2, loss=2.0),
        "sync_h30": _entry("sync_h30", "sync", [[(0.0, 0, 1.0)]] * 2, h=30, loss=1.0),
        "ddp": _entry("ddp", "ddp", [[(0.0, 0, 4.0), (10.0, 100, 2.8)]] * 2),
        "other": _entry("other_ddp", "ddp", [[(0.0, 0, 9.0)]], group="A"),
    }
    (row,) = fidelity_staleness.price(entries)
    assert row["name"] == "k1" and row["mean_staleness"] == pytest.approx(0.25)
    sync, ddp = row["vs_sync"], row["vs_ddp"]
    assert sync["ref"] == "sync_h10"  # the same H, not the better sync_h30
    assert (sync["ours_at_tokens"], sync["ref_at_tokens"]) == (3.0, 2.0)
    assert (sync["ours_at_time"], sync["ref_at_time"]) == (3.0, 3.0)  # both at 10 s
    assert ddp["ref"] == "ddp" and ddp["ref_at_tokens"] == pytest.approx(2.8)
    lines = fidelity_report.staleness_table([row])
    assert any("k1" in line and "0:3 1:1" in line and "+50.00%" in line for line in lines)
