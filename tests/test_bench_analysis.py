"""Pure pieces of `diloco-bench report`: byte accounting, uptime, time to target, claims."""

from __future__ import annotations

import pytest

from bench import analysis, claims


def row(wall, round_, tokens, sent=0, received=0, time_s=None, **extra):
    return {
        "wall": wall,
        "time_s": wall - 100.0 if time_s is None else time_s,
        "round": round_,
        "tokens": tokens,
        "steps": tokens // 10,
        "bytes_sent": sent,
        "bytes_received": received,
        **extra,
    }


@pytest.mark.timeout(10)
def test_island_bytes_separates_the_join_from_the_steady_state():
    # join: 1000 B received once; then 100 B up and 50 B down per round
    rows = [
        {"wall": 100.0, "time_s": 0.0, "round": 0, "tokens": 0, "eval_global": 5.0},
        row(101, 1, 10, sent=100, received=1050),
        row(102, 2, 20, sent=200, received=1100),
        row(103, 3, 30, sent=300, received=1150),
    ]
    got = analysis.island_bytes(rows)
    assert got["up_per_round"] == 100
    assert got["down_per_round"] == 50
    assert got["join_bytes"] == 1000
    assert (got["rounds"], got["tokens"], got["bytes_sent"], got["bytes_received"]) == (
        3,
        30,
        300,
        1150,
    )
    assert analysis.bytes_per_token(rows) == (300 + 1150) / 30


@pytest.mark.timeout(10)
def test_island_bytes_without_rounds_is_zero():
    assert analysis.island_bytes([])["rounds"] == 0
    assert analysis.bytes_per_token([]) == 0.0


@pytest.mark.timeout(10)
def test_eval_curve_sums_tokens_over_islands_at_each_evaluation():
    a = [row(99.0, 0, 0, time_s=0.0, eval_global=5.0), row(110, 1, 100, eval_global=4.0)]
    b = [row(105, 1, 100), row(115, 2, 200, eval_global=3.0)]
    curve = analysis.eval_curve({"a": a, "b": b})
    # training started at wall 100 (wall - time_s of the round rows); round 0's eval clamps to 0
    assert curve == [(0.0, 0, 5.0), (10.0, 200, 4.0), (15.0, 300, 3.0)]


@pytest.mark.timeout(10)
def test_first_reach_interpolates_and_reports_never():
    curve = [(0.0, 0, 5.0), (10.0, 100, 4.0), (20.0, 200, 2.0)]
    assert analysis.first_reach(curve, 3.0) == (15.0, 150.0)
    assert analysis.first_reach(curve, 5.0) == (0.0, 0.0)
    assert analysis.first_reach(curve, 1.0) is None
    assert analysis.loss_at_tokens(curve, 150) == 3.0
    assert analysis.loss_at_tokens(curve, 1000) == 2.0


@pytest.mark.timeout(10)
def test_uptime_counts_windows_in_which_a_version_advanced():
    # versions advance at 1, 2 and 7 seconds: windows [0,2) [2,4) [4,6) [6,8) -> 3 of 4... at
    # window ends 2, 4, 6, 8 the sum is 2, 2, 2, 3 -> windows 1 and 4 advanced (sampled sums)
    timeline = [(0.0, 0), (1.0, 1), (2.0, 2), (7.0, 3)]
    assert analysis.uptime(timeline, 2.0, 0.0, 8.0) == 0.5
    assert analysis.uptime(timeline, 1.0, 0.0, 2.0) == 1.0
    assert analysis.uptime(timeline, 10.0, 0.0, 8.0) is None
    with pytest.raises(ValueError, match="window_s > 0"):
        analysis.uptime(timeline, 0.0, 0.0, 8.0)


def test_uptime_outside_excluded_spans():
    # windows [0,2) [2,4) [4,6) [6,8) advanced: yes, no, no, yes. Excluding (2.5, 5) drops
    # [2,4) and [4,6): 2 of 2. Excluding (2.5, 3) drops [2,4) only: 2 of 3 (it still falls).
    # (1, 2) drops [0,2) but not [2,4), which starts where it ends: 1 of 3.
    timeline = [(0.0, 0), (1.0, 1), (2.0, 2), (7.0, 3)]
    assert analysis.uptime(timeline, 2.0, 0.0, 8.0, exclude=[(2.5, 5.0)]) == 1.0
    assert analysis.uptime(timeline, 2.0, 0.0, 8.0, exclude=[(2.5, 3.0)]) == pytest.approx(2 / 3)
    assert analysis.uptime(timeline, 2.0, 0.0, 8.0, exclude=[(1.0, 2.0)]) == pytest.approx(1 / 3)
    assert analysis.uptime(timeline, 2.0, 0.0, 8.0, exclude=[(-1.0, 9.0)]) is None


def record(method, finals, islands, curve=(), **extra):
    return {
        "method": method,
        "eval_final": finals,
        "eval_curve": [list(p) for p in curve],
        "islands": islands,
        **extra,
    }


def island(tokens, sent, received, rounds=2, up=0.0, down=0.0, steps=None, step_s=None):
    return {
        "tokens": tokens,
        "steps": tokens // 100 if steps is None else steps,
        "rounds": rounds,
        "bytes_sent": sent,
        "bytes_received": received,
        "up_per_round": up,
        "down_per_round": down,
        "bytes_per_token": (sent + received) / tokens,
        "goodput": 0.9,
        "step_s": step_s,
    }


@pytest.mark.timeout(10)
def test_claims_compare_bytes_and_loss_with_ddp_at_equal_tokens():
    records = {
        "ddp": record(
            "ddp",
            2.0,
            {"a": island(1000, 400_000, 400_000)},
            curve=[(0, 0, 5.0), (10, 1000, 2.0)],
        ),
        "ddp-wan": record(
            "ddp",
            5.0,
            {"a": island(100, 80_000, 80_000, steps=1, step_s=10.0)},
            curve=[(0, 0, 5.0)],
        ),
        "quorum": record(
            "quorum",
            2.01,
            {"a": island(1000, 300, 500, rounds=2, up=100, down=200)},
            curve=[(0, 0, 5.0), (5, 1000, 2.01)],
        ),
    }
    out = claims.evaluate(records)
    q = out["runs"]["quorum"]
    assert q["ddp_over_this"] == pytest.approx(800_000 / 800)
    assert q["ddp_over_this_steady"] == pytest.approx(400_000 / 300)
    assert q["loss_vs_ddp"] == pytest.approx(0.005)
    assert out["target_loss"] == 2.01
    # ddp-wan never got there: 1000 tokens at 100 tokens per 10 s step
    wan = out["runs"]["ddp-wan"]
    assert wan["time_to_target_extrapolated"]
    assert wan["time_to_target_s"] == pytest.approx((1000 - 1000 * 0.01 / 3.0) / 10.0, rel=1e-3)
    names = [c["claim"] for c in out["claims"]]
    assert any(n.startswith("bytes vs DDP") for n in names)
    assert any(n.startswith("time to target") for n in names)
    assert next(c for c in out["claims"] if c["claim"].startswith("bytes"))["met"] is True


@pytest.mark.timeout(10)
def test_claims_skip_what_was_not_run():
    out = claims.evaluate({"quorum": record("quorum", 2.0, {"a": island(100, 1, 1)})})
    assert out["claims"] == []
    assert out["target_loss"] == 2.0


def test_credited_tokens_sum_over_shards_and_final_goodput_can_fall():
    server = {
        "shards": [
            {"credited_tokens": {"a": 300.0, "b": 100.0}},
            {"credited_tokens": {"a": 200.0}},
            {"error": "no reply"},
        ]
    }
    credited = analysis.credited_tokens(server)
    assert credited == {"a": 500.0, "b": 100.0}
    rows = [{"capacity_tokens": 400.0}, {"capacity_tokens": 1000.0, "final": True}]
    assert analysis.final_goodput(rows, credited["a"]) == 0.5
    assert analysis.final_goodput(rows, 0.0) == 0.0  # nothing merged: no goodput
    assert analysis.final_goodput([{"round": 1}], 10.0) is None  # no capacity measured
