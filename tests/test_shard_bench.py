"""bench.server runs end to end at a tiny size and reports every figure."""

import json

import pytest

from bench import cli


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_server_reports_every_measurement(capsys):
    args = [
        "--params", "65536", "--rt-params", "4096", "--pushes", "5", "--repeats", "1",
    ]  # fmt: skip
    assert cli.main(["server", *args]) == 0
    result = json.loads(capsys.readouterr().out)
    merge = result["merge_step"]
    assert merge["decode_gbps"]["median"] > 0 and merge["merge_step_gbps"]["median"] > 0
    assert result["checkpoint"]["checkpoint_bytes"] > 65536 * 4
    assert result["checkpoint"]["restart_to_serving_s"] > 0
    for key in ("round_trip", "round_trip_no_fsync"):
        assert result[key]["pushes"] == 5 and result[key]["round_trips_per_s_median"] > 0
