"""bench.server and bench.shard_memory run end to end at a tiny size and report every figure."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import cli


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_server_reports_every_measurement(capsys):
    args = [
        "--params", "65536", "--rt-params", "4096", "--pushes", "5", "--repeats", "1",
        "--ckpt-params", "65536", "--ckpt-fragments", "4", "--ckpt-seconds", "1",
        "--ckpt-every-s", "0.2",
    ]  # fmt: skip
    assert cli.main(["server", *args]) == 0
    result = json.loads(capsys.readouterr().out)
    merge = result["merge_step"]
    assert (merge["params"], merge["deltas_per_step"]) == (65536, 2)
    for figure in (merge["decode_gbps"], merge["merge_step_gbps"]):
        assert figure["best"] >= figure["median"] > 0  # the fastest call is at least the median
    assert merge["target_ratio"] == 0.5
    assert merge["meets_target"] == (merge["ratio_median"] >= 0.5)
    down = merge["int8_downlink"]
    assert down["float32_bytes_per_step"] == 65536 * 4
    # int8 + scales + zstd: about a byte per parameter, far below float32, above a bit each
    assert 65536 / 8 < down["published_bytes_per_step"] < 65536 * 2
    checkpoint = result["checkpoint"]
    # float32 parameters and Nesterov momentum at least, plus a little metadata
    assert 2 * 65536 * 4 <= checkpoint["checkpoint_bytes"] < 4 * 65536 * 4 + 65536
    assert checkpoint["fsync"] is True and checkpoint["restart_to_serving_s"] > 0
    for key, fsync in (("round_trip", True), ("round_trip_no_fsync", False)):
        trip = result[key]
        assert (trip["pushes"], trip["fsync"], trip["mode"], trip["delta_params"]) == (
            5, fsync, "async", 4096,
        )  # fmt: skip
        assert 4096 / 4 < trip["delta_wire_bytes"] < 4096 * 2  # int8: about a byte each
        # one figure, two units: the median rate is 1 / the median round trip
        assert trip["round_trips_per_s_median"] * trip["round_trip_ms"]["median"] == (
            pytest.approx(1000.0)
        )
        assert trip["round_trip_ms"]["p90"] >= trip["round_trip_ms"]["median"] > 0
    pending = result["pending_memory"]
    assert (pending["params"], pending["pending_deltas_per_fragment"]) == (65536, 8)
    # int8 deltas stay coded: a byte per parameter plus a float32 scale per 256
    assert pending["pending_bytes_per_param"] == 1 + 4 / 256
    assert pending["meets_target"] == (pending["rss_bytes_per_param_per_pending"] <= 1.1)
    acks = result["checkpoint_acks"]
    assert (acks["params"], acks["fragments"], acks["push_params"]) == (65536, 4, 16384)
    assert acks["checkpoints"] >= 1 and len(acks["checkpoint_s"]) == acks["checkpoints"]
    # params + momentum (float32) + int8 downlink residual (bfloat16), plus pending and metadata
    assert acks["checkpoint_bytes"] >= (4 + 4 + 2) * 65536
    quiet, during = acks["ack_ms_quiet"], acks["ack_ms_during_checkpoint"]
    assert quiet["count"] + during["count"] == acks["pushes"]
    if quiet["count"] and during["count"]:
        assert acks["ack_p99_during_vs_quiet"] == pytest.approx(during["p99"] / quiet["p99"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_shard_memory_prints_memory_and_step_figures():
    args = ["--params", "65536", "--timing-rounds", "2"]
    done = subprocess.run(
        [sys.executable, "-m", "bench.shard_memory", *args],
        capture_output=True, text=True, timeout=280, cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert (figures["params"], figures["deltas_per_step"], figures["downlink"]) == (
        65536, 2, "int8",
    )  # fmt: skip
    for key in ("step_s", "memcpy_s"):
        assert figures[key]["median"] >= figures[key]["best"] > 0
    ratio = figures["step_vs_memcpy"]["best"]
    assert ratio == pytest.approx(figures["step_s"]["best"] / figures["memcpy_s"]["best"])
    assert isinstance(figures["bytes_per_param_steady"], float)
