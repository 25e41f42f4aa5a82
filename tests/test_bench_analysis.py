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


# Step uptime. Islands "a" and "b" with uneven rounds (0.5 to 2 s, as on a loaded machine);
# each round end pushes the fragment, which then steps before the next poll.
UNEVEN = {"a": [(1.0, 1.0), (3.0, 2.0)], "b": [(1.5, 1.5), (2.0, 0.5)]}
UNEVEN_ROUNDS = sorted(UNEVEN["a"] + UNEVEN["b"])
UNEVEN_PUSHES = {"a": [1.0, 3.0], "b": [1.5, 2.0]}
UNEVEN_POLLS = [(0.5, 0), (1.2, 1), (1.7, 2), (2.2, 3), (2.9, 3), (3.2, 4), (4.0, 4)]


@pytest.mark.timeout(10)
def test_step_uptime_of_uneven_fault_free_rounds_is_one():
    # typical round: median of 0.5, 1.0, 1.5, 2.0 = 1.25 s; a step is due 2 x 1.25 s after
    # the next push. Each advance follows a push within one poll: nothing stuck.
    assert analysis.typical_round_s(UNEVEN_ROUNDS, 2.0) == 1.25
    assert analysis.stuck_spans(UNEVEN_POLLS, UNEVEN_PUSHES, UNEVEN_ROUNDS) == []
    polls = {0: UNEVEN_POLLS, 1: UNEVEN_POLLS}
    pushes = {0: UNEVEN_PUSHES, 1: UNEVEN_PUSHES}
    assert analysis.step_uptime(polls, pushes, UNEVEN_ROUNDS, 0.5, 4.0) == 1.0
    # the old fixed-window uptime reads these same uneven steps as downtime
    assert analysis.uptime(UNEVEN_POLLS, 0.5, 0.5, 4.0) == pytest.approx(4 / 7)


def _polls(down=None):
    """Polls every 0.5 s over [0, 20): version = pushes (a at 1, 2, .., b at 1.5, 2.5, ..)
    before t - 0.1; within `down` = (from, to) the shard does not answer (None)."""
    ends = [float(k) for k in range(1, 21)] + [k + 0.5 for k in range(1, 20)]
    out = []
    for i in range(40):
        t = i * 0.5
        answered = not down or not down[0] <= t < down[1]
        out.append((t, sum(e <= t - 0.1 for e in ends) if answered else None))
    return out


STEADY = {"a": [float(k) for k in range(1, 21)], "b": [k + 0.5 for k in range(1, 20)]}
STEADY_ROUNDS = sorted((e, 1.0) for ends in STEADY.values() for e in ends)


@pytest.mark.timeout(10)
def test_step_uptime_falls_by_a_shard_outage_less_the_allowance():
    up_shard, down_shard = _polls(), _polls(down=(8.0, 13.0))
    # fragment 1's shard is down over [8, 13) while both islands keep pushing every 1 s
    # (0.5 s apart). Its last advance before the outage is seen at 7.5; the next push is
    # a's at 8.0, so its step is due at 8.0 + 2 x 1.0 (typical round) = 10.0. The next
    # advance is seen at 13.0, so it was stuck at least until the poll before, 12.5:
    # (10.0, 12.5), 2.5 s of the 5-s outage (less the 2-s allowance and the 0.5-s poll).
    assert analysis.stuck_spans(up_shard, STEADY, STEADY_ROUNDS) == []
    assert analysis.stuck_spans(down_shard, STEADY, STEADY_ROUNDS) == [(10.0, 12.5)]
    polls, pushes = {0: up_shard, 1: down_shard}, {0: STEADY, 1: STEADY}
    up = analysis.step_uptime(polls, pushes, STEADY_ROUNDS, 0.0, 20.0)
    assert up == pytest.approx(1 - 2.5 / 20)
    # left out, the outage costs nothing: 20 - 5 counted seconds, none stuck
    out = [(8.0, 13.0)]
    assert analysis.step_uptime(polls, pushes, STEADY_ROUNDS, 0.0, 20.0, exclude=out) == 1.0
    # a quorum of 2 makes the step due at b's next push (8.5) + 2.0: stuck (10.5, 12.5)
    assert analysis.stuck_spans(down_shard, STEADY, STEADY_ROUNDS, quorum=2) == [(10.5, 12.5)]
    # islands that stopped pushing make no step due: their fault is not the servers'
    silent = {"a": STEADY["a"][:7], "b": STEADY["b"][:6]}  # last pushes at 7.0 and 6.5
    assert analysis.stuck_spans(down_shard, silent, STEADY_ROUNDS) == []
    assert analysis.step_uptime({}, pushes, STEADY_ROUNDS, 0.0, 20.0) is None
    assert analysis.step_uptime(polls, {}, STEADY_ROUNDS, 0.0, 20.0) is None


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
