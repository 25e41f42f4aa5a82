"""Restart-to-first-step of an island, cold and warm JAX compilation cache.

    diloco-bench restart [--model tiny] [--out runs/restart] [--timeout-s 300]

Starts a real 1-shard server (`bench.launcher.LocalCluster`) and the same
island (same id, same data dir) three times in the foreground, one after the
other, each stopped with SIGTERM after its first training step:

- cold: the first start, with an empty `<data-dir>/jax-cache`;
- warm: a restart, the cache filled by the cold run;
- uncached: a restart with `--compile-cache-dir off` (what a restart cost
  before the cache: the cluster is already initialised, as for warm).

Each is timed from the process start (`bench.child.start`) to the `wall` stamp of its
first metrics row, which the island writes right after its first step (one
inner step per round, no eval). The island's log gives two phases: the first
log line (Python and JAX imported) and its compile (warm-up) time. The OS file
cache is warm in all three runs (the shard imported JAX before), so "cold"
means an empty compilation cache, not a cold disk. Prints one JSON object with
cold_s, warm_s, ratio = warm_s / cold_s (target <= 1/3) and the phases, and
writes it to `<out>/restart.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import child, cli, outdir
from bench.common import emit_json
from bench.launcher import LaunchError, LocalCluster
from worker import compile_cache, island_files

ISLAND = "restart-0"
TARGET_RATIO = 1 / 3
_COMPILE_LINE = re.compile(r"warm-up \(compile\) took ([0-9.]+) s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `diloco-bench restart`."""
    parser.add_argument("--model", default="tiny", help="tiny | small | base (default tiny)")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=300.0,
        help="bound on each start until its first step (default 300)",
    )
    parser.add_argument(
        "--out",
        default="runs/restart",
        help="output directory (default runs/restart): new, empty or a bench's",
    )


def _log_phases(log: Path, started_wall: float) -> dict[str, float | None]:
    """Seconds from the start to the island's first log line, and its compile time.

    Args:
        log: the run's stderr (log records start with a local `asctime`).
        started_wall: `time.time()` at the process start.

    Returns:
        {"import_s": to the first log record (or None), "compile_s": the warm-up (or None)}.
    """
    text = log.read_text(errors="replace") if log.exists() else ""
    first = None
    for line in text.splitlines():
        try:
            stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
        except ValueError:
            continue
        first = stamp.timestamp() - started_wall
        break
    match = _COMPILE_LINE.search(text)
    return {
        "import_s": None if first is None else round(first, 3),
        "compile_s": float(match.group(1)) if match else None,
    }


def time_to_first_step(
    cluster: LocalCluster, data_dir: Path, log: Path, flags: tuple[str, ...], timeout_s: float
) -> dict[str, Any]:
    """Start the island, wait for its first training step, stop it (SIGTERM).

    Args:
        cluster: the running server.
        data_dir: the island's data dir (kept across runs).
        log: file for the island's stdout and stderr.
        flags: further `diloco-worker start` flags.
        timeout_s: bound on the wait for the first step.

    Returns:
        {"first_step_s", "import_s", "compile_s", "cache_entries"} of this run.

    Raises:
        LaunchError: the island exited first, or took longer than `timeout_s`.
    """
    seen = len(island_files.read_rows(data_dir))
    argv = [sys.executable, "-m", "worker.cli", "start", "--connect", cluster.connect,
            "--island", ISLAND, "--data-dir", str(data_dir), "--inner-steps", "1",
            "--eval-every", "0", *flags]  # fmt: skip
    started = time.time()
    island = child.start(argv, "island", ready_timeout_s=None, log=log)
    try:
        deadline = time.monotonic() + timeout_s
        while not (rows := [r for r in island_files.read_rows(data_dir)[seen:] if "loss" in r]):
            if (code := island.proc.poll()) is not None:
                raise LaunchError(f"the island exited with code {code}; see {log}")
            if time.monotonic() > deadline:
                raise LaunchError(f"no first step within {timeout_s:g}s; see {log}")
            time.sleep(0.05)
    finally:
        code = island.stop(60.0)  # also when the wait failed or was interrupted
    if code != 0:
        raise LaunchError(f"the island exited with code {code} after SIGTERM; see {log}")
    cache = compile_cache.resolve("", data_dir)
    return {
        "first_step_s": round(rows[0]["wall"] - started, 3),
        **_log_phases(log, started),
        "cache_entries": len(compile_cache.entries(cache)),
    }


def summarize(model: str, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The restart figures from the three runs: seconds to first step and warm / cold.

    Args:
        model: the island's model.
        results: "cold", "warm" and "uncached" -> `time_to_first_step` of that run.

    Returns:
        {"model", "cold_s", "warm_s", "uncached_s", "ratio", "target_ratio",
        "target_met" (ratio <= 1/3), "runs"}.
    """
    cold, warm = results["cold"]["first_step_s"], results["warm"]["first_step_s"]
    ratio = warm / cold
    return {
        "model": model,
        "cold_s": cold,
        "warm_s": warm,
        "uncached_s": results["uncached"]["first_step_s"],
        "ratio": round(ratio, 3),
        "target_ratio": round(TARGET_RATIO, 3),
        "target_met": ratio <= TARGET_RATIO,
        "runs": results,
    }


def run(args: argparse.Namespace) -> int:
    """Measure cold, warm and uncached restarts.

    Args:
        args: the parsed flags.

    Returns:
        0; 1 with one line when a start fails; 130 after Ctrl-C.
    """
    out = outdir.claim(Path(args.out), "restart")
    model = ("--model", args.model)
    runs = {"cold": model, "warm": model, "uncached": (*model, "--compile-cache-dir", "off")}
    results: dict[str, Any] = {}
    try:
        with LocalCluster(out, shards=1) as cluster:
            cluster.start_server()
            data_dir = cluster.island_dir(ISLAND)
            for name, flags in runs.items():
                print(f"{name} start of island {ISLAND} ...", file=sys.stderr, flush=True)
                log = out / f"{name}.log"
                results[name] = time_to_first_step(cluster, data_dir, log, flags, args.timeout_s)
                print(f"  {results[name]}", file=sys.stderr, flush=True)
    except (LaunchError, subprocess.TimeoutExpired) as exc:
        print(f"diloco-bench restart: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the island and the server are stopped by then
        print("diloco-bench restart: interrupted", file=sys.stderr)
        return 130
    summary = {
        **summarize(args.model, results),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }
    (out / "restart.json").write_text(json.dumps(summary, indent=2) + "\n")
    emit_json(summary)
    return 0


if __name__ == "__main__":
    sys.exit(cli.main(["restart", *sys.argv[1:]]))
