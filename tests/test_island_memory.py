"""`diloco-bench island-memory`: fsdp holds about 1/4 of the replicated bytes on 4 devices."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fsdp_holds_a_quarter_of_replicated_parameters_and_adamw_state_per_device():
    done = subprocess.run(
        [sys.executable, "-m", "bench.cli", "island-memory", "--devices", "4", "--model", "tiny"],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["devices"] == 4
    replicated, fsdp = report["replicated"], report["fsdp"]
    # parameters + mu + nu in fp32, at least, on every device when replicated
    assert replicated["per_device_bytes"] >= 3 * 4 * report["params"]
    assert 0.24 <= fsdp["per_device_bytes"] / replicated["per_device_bytes"] <= 0.26
    assert report["fsdp_over_replicated"] == pytest.approx(0.25, abs=0.01)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_island_memory_and_island_hyphen_memory_are_one_command():
    def help_of(command: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "bench.cli", command, "--help"],
            capture_output=True,
            text=True,
            timeout=50,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    text = help_of("island_memory")
    assert "--devices" in text and text == help_of("island-memory")
