"""The metrics endpoint binds the shard's host (or --metrics-host), not every interface."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request

import pytest
from conftest import free_port, wait_for

from paramserver.server.config import ShardConfig

pytestmark = pytest.mark.timeout(120)


def _listening(port: int) -> set[str]:
    """The local addresses (hex, as in /proc/net/tcp*) with a socket listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            next(f)
            for line in f:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:
                    found.add(address)
    return found


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    argv = [sys.executable, "-m", "paramserver.ops.cli", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=90, env=env)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc/net/tcp")
def test_metrics_listen_on_the_shards_host_only(tmp_path):
    data_dir = tmp_path / "server"
    port, metrics_port = free_port(2), free_port()  # a shard binds ROUTER port and PUB port + 1
    started = _cli(
        "start", "--detach", "--host", "127.0.0.1", "--port", str(port),
        "--metrics-port", str(metrics_port), "--data-dir", str(data_dir), "--fsync", "false",
    )  # fmt: skip
    try:
        assert started.returncode == 0, started.stderr
        wait_for(lambda: _listening(metrics_port), "the metrics port to listen", timeout_s=60)
        assert _listening(metrics_port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0 / ::
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=30) as response:
            assert 'diloco_shard_up{shard="0"} 1.0' in response.read().decode()
    finally:
        if started.returncode == 0:
            stopped = _cli("stop", "--data-dir", str(data_dir))
            assert stopped.returncode == 0, stopped.stderr


def test_metrics_host_defaults_to_host():
    assert ShardConfig(host="127.0.0.1").metrics_bind_host == "127.0.0.1"
    wide = {"metrics_host": "127.0.0.1", "insecure": True}  # plain TCP off loopback: insecure
    assert ShardConfig(host="10.1.2.3", **wide).metrics_bind_host == "127.0.0.1"
    assert ShardConfig(host="*", insecure=True).metrics_bind_host == "0.0.0.0"
    with pytest.raises(ValueError, match="metrics_host"):
        ShardConfig(metrics_host=5)
