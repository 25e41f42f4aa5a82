"""bench/outbox_cost.py: what persisting each push batch costs a round (real daemons)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from model_helpers import tiny_params


def bench(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "bench.outbox_cost", *flags, "--out", str(tmp_path / "o")]
    return subprocess.run(argv, capture_output=True, text=True, timeout=280)


@pytest.mark.timeout(60)
def test_a_bad_flag_is_one_line_and_exit_2(tmp_path):
    proc = bench(tmp_path, "--models", "tiny,huge")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "outbox_cost: --models 'tiny,huge' must name models of ('tiny', 'small', 'base'), and "
        "--rounds 30 / --inner-steps 2 must be >= 1"
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_bench_times_the_outbox_against_the_exchange_and_the_file_stays_bounded(tmp_path):
    proc = bench(tmp_path, "--models", "tiny", "--rounds", "12")
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])["tiny"]
    assert row["rounds"] == 12 and row["params"] == tiny_params()
    assert row["persist_ms"] > 0 and row["exchange_ms"] > 0  # every round pushed, persisted
    # every round's delta is written once (~1 B per parameter, int8) ...
    assert row["bytes_written_per_round"] > row["params"] // 2
    # ... and acked rounds are dropped: the file stays near worker.outbox.COMPACT_MIN_BYTES
    # (~7 rounds of tiny), far below all 14 rounds (2 of warm-up)
    assert row["outbox_max_bytes"] < 10 * row["bytes_written_per_round"]
    assert row["compactions"] >= 2
