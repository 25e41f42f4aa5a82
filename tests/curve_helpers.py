"""Helpers of the CURVE tests: a live CURVE shard on real ports, and polling."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import RunningShard, free_port

from paramserver.server.config import ShardConfig
from paramserver.server.shard import ShardServer

SLOW_HB = {"heartbeat_interval_s": 5.0, "liveness": 20}


def curve_shard(
    tmp_path: Path, server_secret: str, allow_dir: str, allow_map: str = ""
) -> RunningShard:
    """A CURVE shard (async, no fsync) whose welcome lists its real ports (islands reach its PUB)."""
    router, pub = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    cfg = ShardConfig(
        data_dir=str(tmp_path / "server"),
        fsync=False,
        mode="async",
        curve_secret_key_file=server_secret,
        curve_allow_dir=allow_dir,
        curve_allow_map=allow_map,
        **SLOW_HB,
    )
    return RunningShard(ShardServer(cfg, 0, [(router, pub)], router, pub))


def wait_for(predicate: Callable[[], Any], timeout_s: float = 20.0) -> Any:
    """Poll `predicate` until it returns a truthy value (returned); fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"condition not met within {timeout_s}s")


def free_port_pair() -> int:
    """A port P on 127.0.0.1 with P and P + 1 free a moment ago (a shard's ROUTER and PUB)."""
    for _ in range(50):
        port = free_port()
        if port < 65535 and _free(port + 1):
            return port
    raise AssertionError("no two consecutive free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
