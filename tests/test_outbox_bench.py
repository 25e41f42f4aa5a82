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


@pytest.mark.timeout(200)
def test_one_delta_is_framed_persisted_and_pushed_and_a_12b_round_is_computed(tmp_path):
    proc = bench(tmp_path, "--params", "1e5", "--repeats", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"filesystem", "cpus", "load_1m_before", "load_1m_after"} <= set(result)
    delta = result["delta"]
    # 100,000 int8 codes and ceil(100000 / 256) = 391 float32 scales, plus the codec's header
    assert delta["params"] == 100_000 and delta["block"] == 256 and delta["repeats"] == 2
    assert delta["wire_bytes"] > 100_000 + 4 * 391
    wall = {"frame_s", "persist_s", "record_s", "write_s", "fsync_s", "push_loopback_s"}
    stages = wall | {k.replace("_s", "_cpu_s") for k in wall}  # wall and CPU seconds
    assert set(delta["measured_s"]) == stages == set(delta["ns_per_byte"])
    assert [set(row) for row in delta["measured_s_each"]] == [stages, stages]
    # the computed push at the link: wire bytes * 8 / 2 Gbit/s
    assert delta["push_at_link_s_computed"] == round(delta["wire_bytes"] * 8 / 2e9, 4)
    assert {"persist_over_push_at_link", "persist_over_push_loopback"} <= set(delta)
    assert {"frame_s", "persist_s", "fsync_s", "push_at_link_s", "push_loopback_s"} <= set(
        delta["round_12b_computed"]
    )
    assert not list((tmp_path / "o").glob("data-*"))  # the outbox data dirs were removed


@pytest.mark.timeout(60)
def test_a_bad_delta_size_is_one_line_and_exit_2(tmp_path):
    proc = bench(tmp_path, "--params", "1.5")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "outbox_cost: --params 1.5 must be a whole number >= 1, --repeats 3 >= 1 and "
        "--link-gbit 2 > 0"
    ]
