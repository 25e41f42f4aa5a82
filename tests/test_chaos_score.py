"""Pure scoring of a chaos run (`bench.chaos_score`): goodput's terms and the time lost per fault."""

from __future__ import annotations

import pytest

from bench import chaos_score


def rows(points, start_round=1):
    """Metrics rows from (wall, round_s, tokens) of one process's rounds."""
    return [
        {"wall": w, "round": start_round + k, "round_s": s, "tokens": n}
        for k, (w, s, n) in enumerate(points)
    ]


# Island "a": 100 tokens per 1-s round over [0, 10], except a slow round of 3 s (the
# machine's noise: the median round is 1 s, the mean 12/10 s).
A = rows([(1.0, 1.0, 100), (2.0, 1.0, 200), (5.0, 3.0, 300)] + [(5.0 + k, 1.0, 300 + 100 * k) for k in range(1, 6)] + [(11.0, 1.0, 900)])  # fmt: skip
# Island "b": the same pace (100 per 1-s round), killed after its round ending at 4, back
# with a new process whose first round (compiling) ends at 8; then rounds to 10.
B = rows([(k, 1.0, 100 * k) for k in (1.0, 2.0, 3.0, 4.0)]) + rows(
    [(8.0, 2.0, 100), (9.0, 1.0, 200), (10.0, 1.0, 300)]
)


@pytest.mark.timeout(10)
def test_round_helpers_follow_restarts():
    assert chaos_score.cumulative_tokens(B)[-3:] == [(8.0, 500.0), (9.0, 600.0), (10.0, 700.0)]
    # each process's first round compiles: not a training round
    assert chaos_score.training_rounds(B) == [  # rows without work_s: the whole round is work
        (2.0, 1.0, 100.0, 1.0), (3.0, 1.0, 100.0, 1.0), (4.0, 1.0, 100.0, 1.0),
        (9.0, 1.0, 100.0, 1.0), (10.0, 1.0, 100.0, 1.0),
    ]  # fmt: skip
    assert chaos_score.round_ends(B)[4] == (8.0, 2.0)


@pytest.mark.timeout(10)
def test_goodput_terms_count_the_mean_pace_and_the_time_a_fault_took():
    # window [0, 10] (a stops at 11: its capacity runs to 11); b's kill spans (4.5, 8.0)
    credited = {"a": 900.0, "b": 700.0}
    got = chaos_score.lost_time({"a": A, "b": B}, credited, 0.0, 10.0, [(4.5, 8.0)])
    # a's training rounds clear of the span end at 2, 9, 10, 11 (its rounds over (2, 5),
    # (5, 6), (6, 7), (7, 8) overlap it): 400 tokens in 4 s; b's at 2, 3, 4, 9, 10: 500 in
    # 5 s. Capacity: a 100/s x 11 s + b 100/s x 10 s.
    assert got["rates"] == {"a": 100.0, "b": 100.0}
    assert got["capacity_tokens"] == pytest.approx(2100.0)
    assert got["useful_tokens"] == pytest.approx(1600.0)
    assert got["trained_tokens"] == pytest.approx(1600.0)
    # lost: a 11 s - 900/100 = 2 s, b 10 s - 700/100 = 3 s. In the span (3.5 s): a trained
    # 600 - 200 (its tokens at 8.0 and at 4.5) = 4 s of work: -0.5 s; b 500 - 400: 2.5 s.
    assert got["total"] == pytest.approx(5.0)
    assert got["faults"] == [pytest.approx(-0.5 + 2.5)]
    assert got["not_credited"] == 0.0
    # without spans a's pace is its mean over every round: 800 tokens in 10 s (the median
    # round would say 100/s); b's last 300 tokens never credited are lost too (3 s)
    less = chaos_score.lost_time({"a": A, "b": B}, {**credited, "b": 400.0}, 0.0, 10.0, [])
    assert less["rates"]["a"] == pytest.approx(80.0)
    assert less["capacity_tokens"] == pytest.approx(80.0 * 11 + 100.0 * 10)
    assert less["useful_tokens"] == pytest.approx(1300.0)
    assert less["not_credited"] == pytest.approx(3.0)
    # tokens trained before the window's start (200 by t = 2) are not the window's, nor is
    # the pace of its rounds: from t = 2, 700 tokens in 9 s of rounds, so goodput 1
    late = chaos_score.lost_time({"a": A}, {"a": 900.0}, 2.0, 10.0, [])
    assert late["useful_tokens"] == pytest.approx(700.0)
    assert late["rates"]["a"] == pytest.approx(700.0 / 9, abs=0.05)  # rounded to 0.1
    assert late["capacity_tokens"] == pytest.approx(700.0)


@pytest.mark.timeout(10)
def test_the_pace_of_an_island_follows_the_machine_around_a_fault():
    # 1-s rounds of 100 tokens to t = 40 (100/s), then the machine slows: 2-s rounds to 70
    # (50/s); a 10-s pause; 2-s rounds from 84 to 100. Over the run: 6400 tokens in 88 s.
    clean = [(float(k), 1.0, 100.0) for k in range(1, 41)]
    clean += [(float(k), 2.0, 100.0) for k in range(42, 71, 2)]
    clean += [(float(k), 2.0, 100.0) for k in range(84, 101, 2)]
    pace = chaos_score.Pace(clean, window_s=15.0)
    assert pace.overall == pytest.approx(6400.0 / 88.0)  # 40 + 15 + 9 rounds, 40 + 48 s
    assert pace.at(10.0) == 100.0  # rounds ending in [-5, 25]: 1-s rounds only
    # around the pause (rounds ending in [60, 90]: 62..70 and 84..90, all 2-s): 50/s, so a
    # 10-s pause there cost 500 tokens, not the run's mean of 727
    assert pace.at(75.0) == 50.0
    assert pace.tokens_between(70.0, 80.0) == pytest.approx(500.0)
    # fewer than PACE_MIN_ROUNDS rounds around a time: the pace over the whole run
    narrow = chaos_score.Pace(clean, window_s=3.0)
    assert narrow.at(75.0) == pytest.approx(6400.0 / 88.0)  # no round ends in [72, 78]
    assert narrow.at(20.0) == 100.0


@pytest.mark.timeout(10)
def test_time_inside_step_is_lost_not_pace():
    # 1-s rounds of 100 tokens over [0, 10], of which the island's loop trained 0.8 s and
    # the session held 0.2 s (exchange, outbox, a back-pressure wait): cumulative work_s
    # 0.8 per round. A second process (restart at t = 6) counts work_s from 0 again.
    first = [{"wall": float(k), "round": k, "round_s": 1.0, "tokens": 100 * k, "work_s": 0.8 * k}
             for k in range(1, 6)]  # fmt: skip
    second = [{"wall": 6.0 + k, "round": k, "round_s": 1.0, "tokens": 100 * k, "work_s": 0.8 * k}
              for k in range(1, 5)]  # fmt: skip
    rounds = chaos_score.training_rounds(first + second)
    assert [r[3] for r in rounds] == pytest.approx([0.8] * 4 + [0.8] * 3)
    got = chaos_score.lost_time({"a": first + second}, {"a": 900.0}, 0.0, 10.0, [])
    # pace 100 tokens per 0.8 s of training = 125/s; capacity 125 x 10 s; every trained
    # token credited (900), yet goodput 900 / 1250 = 0.72: the session's 0.2 s a round and
    # the restart's lost second are lost time
    assert got["rates"]["a"] == pytest.approx(125.0)
    assert got["capacity_tokens"] == pytest.approx(1250.0)
    assert got["useful_tokens"] / got["capacity_tokens"] == pytest.approx(0.72)
    assert got["total"] == pytest.approx(10.0 - 900.0 / 125.0)


SETUP = type("Setup", (), {"shards": 1, "duration_s": 15.0})()  # a run's shape: 1 shard, 15 s


def _raw(round_s: float, final_loss: float) -> dict:
    """A run's raw material: one island's ten rounds of `round_s`, nothing acked."""
    points = [(round_s * k, round_s, 100 * k) for k in range(1, 11)]
    return {"relay": {}, "t0": 0.0, "status": [{"accepted": 0}], "rows": {"a": rows(points)},
            "final_eval_loss": final_loss, "events": [], "resources": {}}  # fmt: skip


@pytest.mark.timeout(10)
def test_a_faulted_only_report_has_no_comparison_and_times_its_window_on_its_own_rounds():
    both = chaos_score.report(_raw(1.0, 2.0), _raw(1.5, 2.5), [], SETUP)
    assert sorted(both["runs"]) == ["fault_free", "faulted"]
    assert both["uptime_window_s"] == 2.0  # two of the fault-free run's 1-s rounds
    assert both["final_loss_ratio"] == pytest.approx(1.25)  # 2.5 / 2.0
    assert both["targets"]["final_loss_within_1pct"] is False
    assert both["targets"]["fault_free_goodput_at_least_0.98"] is not None
    alone = chaos_score.report(None, _raw(1.5, 2.5), [], SETUP)
    assert sorted(alone["runs"]) == ["faulted"]
    assert alone["uptime_window_s"] == 3.0  # two of its own 1.5-s rounds
    assert alone["final_loss_ratio"] is None
    assert alone["targets"]["final_loss_within_1pct"] is None
    assert alone["targets"]["fault_free_goodput_at_least_0.98"] is None
    assert alone["targets"]["acked_equals_applied"] is True  # 0 acked, 0 applied
    assert alone["runs"]["faulted"] == both["runs"]["faulted"]  # the same run, scored alike


@pytest.mark.timeout(10)
def test_acked_equals_applied_falls_on_a_double_application_and_on_a_lost_delta():
    # three deltas acked, one of them twice (a re-sent push acked again: one key); each
    # entry is (island, fragment, round, time) as the relay records it
    acks = [["a", 0, 1, 1.0], ["a", 1, 1, 1.5], ["a", 0, 2, 2.0], ["a", 0, 2, 2.5]]

    def summary(accepted_by_shard):
        raw = _raw(1.0, 2.0)
        raw["relay"] = {"acked_by_shard": acks}
        raw["status"] = [{"accepted": n} for n in accepted_by_shard]
        return chaos_score.summarize(raw, [], SETUP, window_s=2.0)

    held = summary([2, 1])  # the shards' accepted counts sum over shards: 3 = 3
    assert (held["deltas_acked"], held["deltas_applied"]) == (3, 3)
    assert held["acked_equals_applied"] is True
    twice = summary([3, 1])  # one delta applied twice
    assert (twice["deltas_applied"], twice["acked_equals_applied"]) == (4, False)
    lost = summary([1, 1])  # an acked delta never applied
    assert (lost["deltas_applied"], lost["acked_equals_applied"]) == (2, False)
