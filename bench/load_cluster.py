"""What the load benches share: their cluster sizes, shard pids, random deltas, env, profile.

Used by `bench.load` (the push-rate bench), `bench.load_flood` (its `--flood`
mode) and `bench.scale_shard`; one home so that none imports another.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

import codec
from bench import shard_profile
from bench.launcher import LocalCluster

ISLANDS, SHARDS = 32, 4  # --islands / --shards when not given (without --flood)
FLOOD_ISLANDS, FLOOD_SHARDS = 8, 1  # and with --flood (bench.load_flood)


def shard_pids(cluster: LocalCluster) -> list[int]:
    """Pids of the cluster's shard processes (from the supervisor's ready file)."""
    info = json.loads((cluster.server_dir / "ready.json").read_text())
    return [int(p) for p in info["shard_pids"]]


def random_frames(
    plan_sizes: dict[int, int], variants: int, seed: int
) -> dict[int, list[list[Any]]]:
    """A few int8-encoded random deltas per fragment (reused: encoding is not what is measured).

    Args:
        plan_sizes: fragment -> elements.
        variants: deltas per fragment.
        seed: of the random values.

    Returns:
        fragment -> [frames of one delta (bytes each), ...].
    """
    rng = np.random.default_rng(seed)
    c = codec.int8()
    out: dict[int, list[list[Any]]] = {}
    for f, size in plan_sizes.items():
        out[f] = []
        for _ in range(variants):
            delta = (rng.standard_normal(size) * 1e-3).astype(np.float32)
            frames, _ = c.encode({"delta": delta})
            out[f].append([bytes(x) for x in frames])
    return out


@contextlib.contextmanager
def environ(extra: dict[str, str]) -> Iterator[None]:
    """Set environment variables for what starts inside (the shards), then restore them.

    Args:
        extra: variables to set.

    Yields:
        None, with them set.
    """
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def profile_report(directory: Path, index: int, server: dict[str, Any]) -> dict[str, Any]:
    """The profiled shard's seconds per part of its loop (its pstats file, once it exited).

    Args:
        directory: where `shard_profile.profile_env` had it written.
        index: the shard's index.
        server: the cluster's status (for the shard's accepted count).

    Returns:
        {"shard", "accepted", <section>: seconds, ...}, or {"shard", "error"}.
    """
    path = directory / f"shard-{index}.pstats"
    if not path.exists():
        return {"shard": index, "error": f"{path} was not written (did the shard exit cleanly?)"}
    status = next((s for s in server.get("shards", []) if s.get("shard") == index), {})
    return {"shard": index, "accepted": status.get("accepted"), **shard_profile.sections(path)}
