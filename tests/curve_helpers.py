"""Helpers of the CURVE tests: a live CURVE shard on real ports."""

from __future__ import annotations

from pathlib import Path

from conftest import RunningShard, free_port

from paramserver.server.config import ShardConfig
from paramserver.server.shard import ShardServer

SLOW_HB = {"heartbeat_interval_s": 5.0, "liveness": 20}


def curve_shard(
    tmp_path: Path, server_secret: str, allow_dir: str, allow_map: str = ""
) -> RunningShard:
    """A CURVE shard (async, no fsync) whose welcome lists its real ports (islands reach its PUB)."""
    base = free_port(2)
    router, pub = f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"
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
