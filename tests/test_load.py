"""`diloco-bench load`: a small version against real shard daemons, and its pure helpers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.load_meters import milliseconds, percentile, rates, spread


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def test_spread_and_milliseconds_by_hand():
    assert spread([3.0, 1.0, 2.0, 10.0]) == {"min": 1.0, "p50": 2.5, "max": 10.0}
    assert spread([]) is None
    assert milliseconds(0.0123456) == 12.35 and milliseconds(None) is None


def test_rates_by_hand():
    # 96 pushes in 2 s = 48/s; fsyncs (100 + 300) / 2 = 200/s; 48 / 200 = 0.24 pushes per fsync
    assert rates(96, 2.0, 100.0, 300.0) == {
        "pushes_per_s": 48.0,
        "fsync_per_s": 200.0,
        "pushes_per_fsync": 0.24,
    }
    assert rates(96, 0.0, 100.0, 300.0)["pushes_per_s"] is None
    assert rates(96, 2.0, 0.0, 0.0)["pushes_per_fsync"] is None


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_small_load_run_acks_every_push_within_memory_bound(tmp_path):
    proc = subprocess.run(
        [
            sys.executable, "-m", "bench.cli", "load", "--islands", "8", "--shards", "2",
            "--rounds", "3", "--params", "65536", "--max-rss-mb", "1024", "--timeout", "120",
            "--out", str(tmp_path), "--profile-shard", "1",
        ],
        capture_output=True,
        text=True,
        timeout=220,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["pushes"] == 8 * 3 * 4
    assert report["acked"] == report["shard_accepted"] == report["pushes"]
    assert all(report["checks"].values()), report["checks"]
    assert report["ack_latency_p50_ms"] is not None and report["pushes_per_s"] > 0
    assert 0 <= report["spurious_resends"] <= report["resent"]
    assert report["fsync_per_s"] > 0 and report["fsync_write_bytes"] > 1000
    # the rates are over the measured window (their arithmetic: test_rates_by_hand)
    assert report["pushes_per_s"] * report["elapsed_s"] == pytest.approx(report["pushes"], rel=0.01)
    before, after = report["fsync_per_s_before_after"]
    assert min(before, after) - 0.1 <= report["fsync_per_s"] <= max(before, after) + 0.1
    assert report["pushes_per_fsync"] > 0
    assert set(report["cpu_cores_busy"]) == {"cores", "machine_busy", "shard_0", "shard_1", "load"}
    assert report["ack_timeout_s"]["min"] > 0
    profile = report["shard_profile"]  # shard 1 ran under cProfile
    assert profile["shard"] == 1 and profile["accepted"] > 0, profile
    seconds = profile["cumulative_s"]
    assert seconds["serve"] >= seconds["turn"] >= seconds["handle"] >= seconds["push_submit"] > 0
    assert seconds["push_decode"] > 0 and seconds["step"] > 0 and profile["top_own_s"]
    assert json.loads((tmp_path / "load.json").read_text()) == report
