"""What persisting before sending costs an island: outbox writes per round against its exchange.

Since issue 23 an island writes every push batch to ``<data_dir>/outbox.bin``
(one fsync per batch) before the deltas leave (`worker.outbox`). For each
model (default: tiny and base) a `Session` with a data dir joins a fresh local
2-shard cluster (real daemons, 127.0.0.1, mode async: every delta is pushed,
none skipped while its predecessor waits for a merge), and every round moves every
parameter a little and ends with a push; per round it reads the session's
`exchange_s` (delta, quantize, encode, fold) and the outbox's `persist_s`
(write, fsync, compaction); the first two rounds (compilation) are left
out. Prints one JSON object: per model the medians in
milliseconds, `persist_over_exchange` (median over rounds of persist /
exchange, and the ratio of the sums), the bytes written per round and the
file's largest and final size over the run (bounded: `worker.outbox`
compacts it once resolved records dominate).

    diloco-bench outbox_cost [--rounds 30] [--models tiny,base] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench import outdir
from bench.common import progress
from bench.launcher import LocalCluster

WARMUP_ROUNDS = 2  # rounds run first and left out of the figures (the exchange compiles)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the bench."""
    parser.add_argument("--rounds", type=int, default=30, help="rounds per model (default 30)")
    parser.add_argument("--inner-steps", type=int, default=2, help="steps per round (default 2)")
    parser.add_argument(
        "--models", default="tiny,base", help="comma-separated models (default tiny,base)"
    )
    parser.add_argument(
        "--out",
        default="runs/outbox-cost",
        help="output directory (default runs/outbox-cost): new, empty or a bench's",
    )


def filesystem(path: Path) -> str:
    """The type of the file system holding `path` (from /proc/mounts; "?" elsewhere)."""
    best, kind = "", "?"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    where = str(path.resolve())
    for line in mounts:
        fields = line.split()
        if len(fields) > 2 and where.startswith(fields[1]) and len(fields[1]) > len(best):
            best, kind = fields[1], fields[2]
    return kind


def _measure(connect: str, name: str, args: argparse.Namespace, data_dir: Path, tick) -> dict:
    import jax

    from worker import model
    from worker.session import Session
    from worker.session_config import session_config

    params = model.init_params(model.model_config(name), 0)

    @jax.jit
    def move(tree, key):  # noise: deltas that do not compress away, as trained ones
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        keys = jax.random.split(key, len(leaves))
        moved = [
            x + 1e-3 * jax.random.normal(k, x.shape, x.dtype)
            for x, k in zip(leaves, keys, strict=True)
        ]
        return jax.tree_util.tree_unflatten(treedef, moved)

    cfg = session_config(connect, f"outbox-{name}", args.inner_steps, str(data_dir), {})
    exchange, persist, sizes = [], [], []
    with Session(cfg, params) as s:
        assert s.outbox is not None
        p = s.params
        for _ in range(args.rounds + WARMUP_ROUNDS):
            ex0, pe0 = s.exchange_s, s.outbox.persist_s
            for _ in range(args.inner_steps):
                p = s.step(jax.block_until_ready(move(p, jax.random.key(s.steps))), tokens=1)
            exchange.append(s.exchange_s - ex0)
            persist.append(s.outbox.persist_s - pe0)
            sizes.append(s.outbox.size)
            tick()
        written, compactions = s.outbox.bytes_written, s.outbox.compactions
        n_params = sum(s.sizes)
    exchange, persist = exchange[WARMUP_ROUNDS:], persist[WARMUP_ROUNDS:]  # compile: left out
    ratio = np.asarray(persist) / np.maximum(np.asarray(exchange), 1e-9)
    return {
        "params": n_params,
        "rounds": args.rounds,
        "exchange_ms": round(float(np.median(exchange)) * 1e3, 3),
        "persist_ms": round(float(np.median(persist)) * 1e3, 3),
        "persist_ms_max": round(float(np.max(persist)) * 1e3, 3),
        "persist_over_exchange": round(float(np.median(ratio)), 4),
        "persist_over_exchange_sum": round(float(np.sum(persist) / np.sum(exchange)), 4),
        "bytes_written_per_round": int(written / (args.rounds + WARMUP_ROUNDS)),
        "outbox_max_bytes": int(max(sizes)),
        "outbox_bytes_after_round": sizes[-5:],
        "compactions": compactions,
    }


def run(args: argparse.Namespace) -> int:
    """Measure each model and print the JSON.

    Args:
        args: the parsed flags.

    Returns:
        0, or 2 for a bad flag (one line on stderr).
    """
    models = [m for m in args.models.split(",") if m]
    from worker.config import MODEL_NAMES

    bad = [m for m in models if m not in MODEL_NAMES]
    if bad or args.rounds < 1 or args.inner_steps < 1 or not models:
        print(
            f"outbox_cost: --models {args.models!r} must name models of {MODEL_NAMES}, and "
            f"--rounds {args.rounds} / --inner-steps {args.inner_steps} must be >= 1",
            file=sys.stderr,
        )
        return 2
    out = outdir.claim(Path(args.out), "outbox_cost")
    result: dict[str, Any] = {
        "inner_steps": args.inner_steps,
        "filesystem": filesystem(out),
        "cpus": os.cpu_count(),
        "load_1m": round(os.getloadavg()[0], 2),
    }
    with progress() as bar:
        for name in models:
            task = bar.add_task(f"{name}: rounds", total=args.rounds + WARMUP_ROUNDS)
            with LocalCluster(out / name, shards=2, server_args=("--mode", "async")) as cluster:
                cluster.start_server()
                result[name] = _measure(
                    cluster.connect,
                    name,
                    args,
                    out / name / "island",
                    lambda t=task: bar.advance(t),
                )
    (out / "outbox_cost.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, sort_keys=True))
    return 0


def main() -> int:
    """`python -m bench.outbox_cost`."""
    parser = argparse.ArgumentParser(prog="python -m bench.outbox_cost", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
