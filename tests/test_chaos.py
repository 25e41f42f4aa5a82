"""`diloco-bench chaos --quick` as a slow smoke test: real daemons, a relay, faults as data.

The schedule is a pure function of the seed (tests/test_faults.py); seed 9 with
these kinds gives duplicate, corrupt, pause_island, then kill_shard, so every
fault meets islands that are pushing. The faulted run alone (`--faulted-only`):
the fault-free run is the same `ChaosRun` with an empty schedule, and the report
that compares the two is tested on recorded runs (tests/test_chaos_score.py);
running it here too doubled this serial test's time. Asserted: the exactness
target (every delta the shards acked is applied, none twice), that each fault
fired and left its trace (duplicate acks, checksum rejections), and that the
report carries its fields. Goodput, uptime and loss are reported, not asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

KINDS = "duplicate,corrupt,pause_island,kill_shard"


@pytest.mark.slow
@pytest.mark.serial  # faults fire at wall-clock times and must meet islands that are pushing
@pytest.mark.timeout(420)
def test_quick_chaos_run_loses_nothing_acked_and_every_fault_fires(tmp_path):
    proc = subprocess.run(
        [
            sys.executable, "-m", "bench.cli", "chaos", "--quick", "--faults", "4",
            "--seed", "9", "--kinds", KINDS, "--out", str(tmp_path), "--faulted-only",
            # 28 s: each fault lasts 2.75 s, so a window sees pushes even when an island
            # waits for its last delta's merge before the next push (worker.session)
            "--duration", "28",
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert [f["kind"] for f in report["schedule"]] == KINDS.split(",")
    for name, run in report["runs"].items():
        for field in (
            "goodput",
            "uptime",
            "uptime_outside_shard_outages",
            "uptime_windowed",
            "deltas_acked",
            "deltas_applied",
            "final_eval_loss",
            "lost_island_s",
        ):
            assert field in run, (name, field)
        # the soak figures: every daemon's RSS and both shards' directories were sampled
        assert set(run["soak"]["rss"]) == {"shard-0", "shard-1", "island-0", "island-1"}, name
        assert set(run["soak"]["dirs"]) == {"shard-0", "shard-1"}, name
        assert all(d["checkpoints_max"] >= 1 for d in run["soak"]["dirs"].values()), name
        assert run["deltas_acked"] > 0, name
        assert run["deltas_acked"] == run["deltas_applied"], (name, run)
        assert run["final_eval_loss"] is not None, (name, run["errors"])
    assert set(report["runs"]) == {"faulted"} and report["faulted_only"]
    chaos = report["runs"]["faulted"]
    assert all(f["fired"] for f in chaos["faults"]), chaos["faults"]
    assert chaos["shard_duplicates"] > 0  # the duplicated pushes were acked "duplicate"
    assert chaos["shard_rejected"].get("codec_error", 0) > 0  # corruption caught by checksum
    assert json.loads((tmp_path / "chaos.json").read_text()) == report
