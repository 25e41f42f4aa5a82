"""The island exchange per round, on the device against on the host, vs a device memcpy.

For each model preset (`--models`, default small and base: worker/model.py)
and each exchange (`device`, `host`) one island joins a fresh local cluster
(real shard daemons, sync mode, int8 downlink, so every published update is
an int8 increment) with the model's parameters as JAX arrays, and runs
`--rounds` rounds of one inner step each (a jitted perturbation of the
parameters, not a training step: the exchange is what is measured). Every
round pushes an int8 delta, waits for its merge and folds the published
increment. From `Session.stats` it reads, per round after the first (the
compiles), `exchange_s` (delta, quantize, encode, fold, placement; no network
waits) and `host_device_bytes`. The baselines are measured in the same run:
a jitted device copy of the parameters (`memcpy_ms`) and a host copy of their
float32 bytes (`host_memcpy_ms`).

Prints one JSON object: per preset `exchange_ms` and
`host_device_bytes_per_param` of each exchange, `device_vs_host` (exchange
time, device over host; target <= 0.33) and each exchange over the device
memcpy.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import outdir
from bench.launcher import LocalCluster

EXCHANGES = ("device", "host")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `diloco-bench island_exchange`."""
    parser.add_argument(
        "--models",
        nargs="+",
        default=["small", "base"],
        help="model presets to measure (default small base)",
    )
    parser.add_argument("--rounds", type=int, default=6, help="rounds per run (default 6)")
    parser.add_argument("--codec", default="int8", help="delta codec: int8 (default) or int4")
    parser.add_argument(
        "--out",
        default="runs/island-exchange",
        help="output directory (default runs/island-exchange): new, empty or a bench's",
    )


def _median_ms(samples: list[float]) -> float:
    return round(float(np.median(samples)) * 1e3, 3)


def _memcpy_ms(params: Any, repeats: int = 5) -> tuple[float, float]:
    """Median ms of a device copy of the parameters, and of a host copy of their fp32 bytes."""
    import jax
    import jax.numpy as jnp

    copy = jax.jit(lambda tree: jax.tree_util.tree_map(jnp.copy, tree))
    jax.block_until_ready(copy(params))
    device = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(copy(params))
        device.append(time.perf_counter() - t0)
    host = np.concatenate(
        [np.asarray(leaf, np.float32).ravel() for leaf in jax.tree_util.tree_leaves(params)]
    )
    out = np.empty_like(host)
    hosts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(out, host)
        hosts.append(time.perf_counter() - t0)
    return _median_ms(device), _median_ms(hosts)


def _measure(connect: str, preset: str, exchange: str, args: argparse.Namespace) -> dict:
    import jax

    from worker import model
    from worker.session import Session
    from worker.session_config import session_config

    params = model.init_params(model.model_config(preset), 0)
    cfg = session_config(
        connect, f"{preset}-{exchange}", 1, None, {"exchange": exchange, "codec": args.codec}
    )
    nudge = jax.jit(lambda tree, k: jax.tree_util.tree_map(lambda x: x + 1e-3 * k, tree))
    seconds, moved = [], []
    with Session(cfg, params) as session:
        params = session.params
        for k in range(args.rounds):
            params = jax.block_until_ready(nudge(params, float(k % 3) - 1.0))
            before = session.stats
            params = session.step(params, tokens=1)
            jax.block_until_ready(params)
            after = session.stats
            seconds.append(after["exchange_s"] - before["exchange_s"])
            moved.append(after["host_device_bytes"] - before["host_device_bytes"])
        elements = sum(session.sizes)
        kind = type(session.exchange).__name__
        memcpy = _memcpy_ms(params)
    return {
        "exchange": kind,
        "params": elements,
        "exchange_ms": _median_ms(seconds[1:]),
        "host_device_bytes_per_param": round(float(np.median(moved[1:])) / elements, 3),
        "rounds_timed": len(seconds) - 1,
        "memcpy": memcpy,
    }


def run(args: argparse.Namespace) -> int:
    """Measure every preset with both exchanges and print the JSON.

    Args:
        args: the parsed flags.

    Returns:
        0.
    """
    out = outdir.claim(Path(args.out), "island_exchange")
    result: dict[str, Any] = {"rounds": args.rounds, "codec": args.codec}
    for preset in args.models:
        runs: dict[str, dict] = {}
        for exchange in EXCHANGES:
            server = ("--mode", "sync", "--downlink", "int8")
            with LocalCluster(
                out / f"{preset}-{exchange}", shards=2, server_args=server
            ) as cluster:
                cluster.start_server()
                runs[exchange] = _measure(cluster.connect, preset, exchange, args)
        memcpy_ms, host_memcpy_ms = runs["device"].pop("memcpy")
        runs["host"].pop("memcpy")
        result[preset] = {
            **runs,
            "memcpy_ms": memcpy_ms,
            "host_memcpy_ms": host_memcpy_ms,
            "device_vs_host": round(runs["device"]["exchange_ms"] / runs["host"]["exchange_ms"], 3),
            "device_vs_memcpy": round(runs["device"]["exchange_ms"] / memcpy_ms, 2),
            "host_vs_memcpy": round(runs["host"]["exchange_ms"] / memcpy_ms, 2),
        }
    (out / "island_exchange.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, sort_keys=True))
    return 0
