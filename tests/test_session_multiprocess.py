"""A 2-process x 2-CPU-device island through the public API (jax.distributed, gloo on CPU).

Each process is `tests/session_process.py`, a user's script: it initialises
`jax.distributed`, shards the MLP's parameters over the 4 devices and calls
`worker.join` / `Session.step` with its own shards; process 0 alone talks to
the shards (two `ShardServer` threads of this test, real sockets).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Cluster, free_port

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_processes_of_two_devices_train_one_island_through_the_api(tmp_path):
    # the int8 downlink: increments travel between the processes as codes (device exchange)
    cluster = Cluster(tmp_path, shards=2, mode="async", downlink="int8")
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DILOCO_", "JAX_"))}
        env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
        coordinator = f"127.0.0.1:{free_port()}"
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(HERE / "session_process.py"),
                    coordinator,
                    "2",
                    str(i),
                    cluster.connect,
                    str(tmp_path / f"p{i}.json"),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
            for i in range(2)
        ]
        outputs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
        for proc, text in zip(procs, outputs, strict=True):
            assert proc.returncode == 0, text[-3000:]
    finally:
        cluster.stop()
    leader, follower = (json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2))
    assert leader["has_client"] and not follower["has_client"]  # process 0 alone opens sockets
    assert leader["exchange"] == follower["exchange"] == "DeviceExchange"
    assert leader["rounds"] == follower["rounds"] == 8
    assert leader["version"] == follower["version"] > 0
    assert leader["folded"] == follower["folded"] > 0  # the same folds at the same steps
    assert leader["local_digest"] == follower["local_digest"]  # the same parameters everywhere
    assert leader["same_layout"] and follower["same_layout"]  # placed like the params passed in
    assert leader["global_loss"] == follower["global_loss"] < leader["initial_loss"] / 2
