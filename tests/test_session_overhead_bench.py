"""diloco-bench session_overhead: what Session.step costs, per call and per round (real daemons)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(60)
def test_an_unknown_model_is_one_line_and_exit_2(tmp_path):
    argv = [sys.executable, "-m", "bench.cli", "session_overhead", "--models", "tiny,huge",
            "--out", str(tmp_path / "o")]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "session_overhead: models ['tiny', 'huge'] must be of ('tiny', 'small', 'base')"
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_bench_times_every_call_and_says_whether_a_round_end_costs_more(tmp_path):
    argv = [sys.executable, "-m", "bench.cli", "session_overhead", "--rounds", "2",
            "--inner-steps", "5", "--hidden", "64", "--batch", "16", "--stages",
            "--out", str(tmp_path / "o")]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["inner_steps"], result["rounds"]) == (5, 2)
    for loop in ("mlp", "daemon_loop_tiny"):
        row = result[loop]
        # 10 steps: 2 end a round; the first 5 samples of each kind are warm-up (1 round call kept)
        assert (row["calls_timed"], row["rounds_timed"]) == (3, 1), row
        # both loops join with placed jax arrays, as the daemon does: the device exchange
        assert row["exchange"] == "DeviceExchange", row
        assert row["calls_alone_timed"] == 8, row  # 10 calls back to back, 2 of them round ends
        # the ratios are rounded to 5 / 6 decimals: tiny ones differ by up to half of that
        assert row["call_over_step"] == pytest.approx(
            row["call_us"] / row["step_us"], rel=0.01, abs=6e-6
        )
        assert row["call_alone_over_step"] == pytest.approx(
            row["call_alone_us"] / row["step_us"], rel=0.01, abs=6e-7
        )
        # that a round end costs more than a call alone is the bench's figure, not checked here
        assert row["round_end_costs_more"] in (True, False), row
        # --stages: the round-end call split into the session's pieces (medians, us); _take and
        # _push show only when the timed round pushed (quorum mode holds a fragment back while
        # its previous push has no outcome yet)
        stages = row["round_end_stages_us"]
        assert {"_fold", "_round_row", "_report_training", "unaccounted"} <= set(stages), stages
