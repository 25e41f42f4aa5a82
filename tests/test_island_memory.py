"""`diloco-bench island-memory`: fsdp holds about 1/4 of the replicated bytes on 4 devices."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", ["island-memory", "island_memory"])
def test_fsdp_holds_a_quarter_of_replicated_parameters_and_adamw_state_per_device(command):
    done = subprocess.run(
        [sys.executable, "-m", "bench.cli", command, "--devices", "4", "--model", "tiny"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["devices"] == 4
    replicated, fsdp = report["replicated"], report["fsdp"]
    # parameters + mu + nu in fp32, at least, on every device when replicated
    assert replicated["per_device_bytes"] >= 3 * 4 * report["params"]
    assert 0.24 <= fsdp["per_device_bytes"] / replicated["per_device_bytes"] <= 0.26
    assert report["fsdp_over_replicated"] == pytest.approx(0.25, abs=0.01)
