"""docs/protocol.md is enough to write a client: one that imports nothing of ours joins a real cluster.

`tests/outside_client.py` (pyzmq, msgpack, numpy, zstandard; the project's
packages blocked) runs in its own isolated interpreter (`python -I`) against
a 2-shard cluster started here with `diloco-server start --detach`: it
computes the plan, initialises both shards, joins, pushes, decodes the
published updates and compares them with snapshots (see its docstring).
This file starts and stops the cluster through the CLI only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port
from test_server_cli import run_cli

pytestmark = pytest.mark.timeout(60)

CLIENT = Path(__file__).with_name("outside_client.py")
CMD_TIMEOUT_S = 30
LR = 0.5


@pytest.fixture
def cluster(tmp_path):
    """start(downlink) -> the first ROUTER of a fresh 2-shard cluster; stopped at teardown."""
    data_dirs: list[Path] = []

    def start(downlink: str) -> str:
        data_dir = tmp_path / f"server-{downlink}"
        data_dirs.append(data_dir)
        port = free_port(4)
        proc = run_cli(
            "start", "--detach", "--shards", "2", "--fragments", "4",
            "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data_dir),
            "--mode", "async", "--outer-optimizer", "sgd", "--outer-lr", str(LR),
            "--downlink", downlink, "--heartbeat-interval-s", "0.5",
            # its hostile cases go back to back (some read raw, not retried when throttled)
            "--request-burst", "256",
            timeout=CMD_TIMEOUT_S,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return f"tcp://127.0.0.1:{port}"

    yield start
    for data_dir in data_dirs:
        stopped = run_cli("stop", "--data-dir", str(data_dir), timeout=CMD_TIMEOUT_S)
        assert stopped.returncode == 0 or "no diloco-server is running" in stopped.stderr, (
            stopped.stderr
        )


@pytest.mark.parametrize("downlink", ["int8", pytest.param("float32", marks=pytest.mark.slow)])
def test_outside_client_inits_joins_pushes_and_follows(cluster, downlink):
    connect = cluster(downlink)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    proc = subprocess.run(
        [sys.executable, "-I", str(CLIENT), "--connect", connect]
        + ["--downlink", downlink, "--lr", str(LR)],
        capture_output=True,
        text=True,
        timeout=40,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["updates_bit_exact"] is True
    assert summary["forbidden_modules"] == []
    spec = (Path(__file__).parents[1] / "docs" / "protocol.md").read_text()
    for digest in summary["doc_hashes"]:  # the spec's worked examples, recomputed by the client
        assert digest in spec
    assert summary["bounds"] == [0, 23, 47, 70, 93]  # 46.5 rounds up to 47
    assert {owner for _, owner, _ in summary["owners"]} == {0, 1}
    rejected = {k: v for counts in summary["rejected"].values() for k, v in counts.items()}
    for reason in ("plan_mismatch", "codec_error", "bad_shape", "non_finite", "island_in_use"):
        assert rejected.get(reason, 0) >= 1, rejected
    assert rejected["bad_version"] >= 3 and rejected["malformed"] >= 4, rejected  # strict headers
    assert summary["req_socket"] == ["welcome", "heartbeat", "status_reply", "bye_ok"]
