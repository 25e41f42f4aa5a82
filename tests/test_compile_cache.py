"""JAX's persistent compilation cache of an island: filled on the first start, hit on a restart
(absent with `--compile-cache-dir off`: tests/test_multihost_island.py, whose islands all run
with it). Real worker processes; a real shard in a thread."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Cluster
from jax_cache import SHARED_ENV

from bench.restart import _log_phases, summarize
from worker import compile_cache

FAST = ("--model", "tiny", "--batch-size", "2", "--seq-len", "16", "--eval-every", "0")
FEW = ("--inner-steps", "2", "--max-rounds", "1", "--heartbeat-interval-s", "0.2")


def run_island(connect: str, island: str, data_dir: Path, *extra: str) -> None:
    """Run one island process for one short round; fail the test with its output if it fails.

    Its cache is the island's own default (`<data_dir>/jax-cache`), not the suite's shared one.
    """
    argv = [sys.executable, "-m", "worker.cli", "start", "--connect", connect,
            "--island", island, "--data-dir", str(data_dir), *FAST, *FEW, *extra]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != SHARED_ENV}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_setting_resolves_to_the_data_dir_a_shared_dir_or_none(tmp_path):
    assert compile_cache.resolve("", tmp_path) == tmp_path / "jax-cache"
    assert compile_cache.resolve(str(tmp_path / "shared"), tmp_path) == tmp_path / "shared"
    assert compile_cache.resolve("off", tmp_path) is None
    assert compile_cache.resolve("OFF", tmp_path) is None
    assert compile_cache.entries(tmp_path / "missing") == []


def in_a_fresh_process(code: str, *args: str) -> subprocess.CompletedProcess:
    """Run `code` in a new interpreter (a process whose cache nothing has set yet)."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=240)  # fmt: skip


def test_an_unusable_cache_dir_is_one_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code = (
        "import sys; from worker import compile_cache\n"
        "try:\n    compile_cache.enable(sys.argv[1], sys.argv[2])\n"
        "except compile_cache.CompileCacheError as exc:\n    print(exc)\n"
    )
    proc = in_a_fresh_process(code, str(blocker / "cache"), str(tmp_path))
    assert "--compile-cache-dir" in proc.stdout, proc


THREADS = """
import logging, sys, threading, warnings
import jax, jax.numpy as jnp
from worker import compile_cache
logging.basicConfig(level=logging.DEBUG, format="%(name)s %(message)s", stream=sys.stdout)
for name in ("jax", "jax._src"):
    logging.getLogger(name).setLevel(logging.WARNING)
warnings.simplefilter("always")
first, second = sys.argv[1], sys.argv[2]
used = {}
def island(name, setting):
    for _ in range(2):
        used.setdefault(name, compile_cache.enable(setting, "unused"))
    for n in range(6):  # each thread compiles, the other reads and writes the same cache
        jax.jit(lambda x, n=n: jnp.sin(x) * n + len(name))(jnp.ones(n + 3)).block_until_ready()
a = threading.Thread(target=island, args=("a", first)); a.start(); a.join()
threads = [threading.Thread(target=island, args=(n, s)) for n, s in (("b", second), ("c", second))]
for t in threads: t.start()
for t in threads: t.join()
print("USED", used["a"], used["b"], used["c"])
"""


def test_threads_of_one_process_share_the_first_cache_without_a_warning(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    proc = in_a_fresh_process(THREADS, str(first), str(second))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"USED {first} {first} {first}" in proc.stdout, proc.stdout
    told = [line for line in proc.stdout.splitlines() if "this process keeps" in line]
    assert len(told) == 1 and str(second) in told[0], proc.stdout  # said once, at DEBUG
    assert not second.exists()  # the later setting created nothing
    assert len(compile_cache.entries(first)) >= 6  # both threads' programs in the one cache
    assert "Warning" not in proc.stderr and "Error" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_island_fills_its_cache_and_a_restart_compiles_nothing_new(tmp_path):
    cluster = Cluster(tmp_path, shards=1)
    try:
        data_dir = tmp_path / "island"
        run_island(cluster.connect, "isl", data_dir)
        cache = data_dir / compile_cache.DEFAULT_SUBDIR
        first = compile_cache.entries(cache)
        assert len(first) >= 2, f"expected the train and eval steps cached, got {first}"
        run_island(cluster.connect, "isl", data_dir)  # a restart with the same data dir
        assert compile_cache.entries(cache) == first, "the restart compiled something again"
        # `--compile-cache-dir off` (no cache dir, and the island trains) is checked on the
        # islands of tests/test_multihost_island.py, which all train with it: a third island
        # start here (an uncached compile) would check it again
    finally:
        cluster.stop()


def test_the_restart_bench_reads_the_phases_from_an_island_log(tmp_path):
    log = tmp_path / "run.log"
    log.write_text(
        "warning without a stamp\n"
        "2026-11-30 17:00:02,500 INFO worker.island: waiting for the server\n"
        "2026-11-30 17:00:09,000 INFO worker.train: inner trainer warm-up (compile) took 6.25 s\n"
    )
    started = datetime.datetime(2026, 11, 30, 17, 0, 1).timestamp()
    assert _log_phases(log, started) == {"import_s": 1.5, "compile_s": 6.25}
    assert _log_phases(tmp_path / "none.log", started) == {"import_s": None, "compile_s": None}


def test_the_restart_figures_by_hand():
    runs = {"cold": {"first_step_s": 9.0}, "warm": {"first_step_s": 2.7},
            "uncached": {"first_step_s": 8.0}}  # fmt: skip
    fast = summarize("tiny", runs)  # 2.7 / 9 = 0.3 <= 1/3: met
    assert (fast["cold_s"], fast["warm_s"], fast["uncached_s"]) == (9.0, 2.7, 8.0)
    assert (fast["ratio"], fast["target_ratio"], fast["target_met"]) == (0.3, 0.333, True)
    slow = summarize("tiny", {**runs, "warm": {"first_step_s": 4.5}})  # 4.5 / 9 = 0.5: missed
    assert (slow["ratio"], slow["target_met"]) == (0.5, False)
