"""JAX's persistent compilation cache of an island: filled on the first start, hit on a restart,
absent with `--compile-cache-dir off`. Real worker processes; a real shard in a thread."""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Cluster

from bench.restart import _log_phases, summarize
from worker import compile_cache, island_files

FAST = ("--model", "tiny", "--batch-size", "2", "--seq-len", "16", "--eval-every", "0")
FEW = ("--inner-steps", "2", "--max-rounds", "1", "--heartbeat-interval-s", "0.2")


def run_island(connect: str, island: str, data_dir: Path, *extra: str) -> None:
    """Run one island process for one short round; fail the test with its output if it fails."""
    argv = [sys.executable, "-m", "worker.cli", "start", "--connect", connect,
            "--island", island, "--data-dir", str(data_dir), *FAST, *FEW, *extra]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_setting_resolves_to_the_data_dir_a_shared_dir_or_none(tmp_path):
    assert compile_cache.resolve("", tmp_path) == tmp_path / "jax-cache"
    assert compile_cache.resolve(str(tmp_path / "shared"), tmp_path) == tmp_path / "shared"
    assert compile_cache.resolve("off", tmp_path) is None
    assert compile_cache.resolve("OFF", tmp_path) is None
    assert compile_cache.entries(tmp_path / "missing") == []


def test_an_unusable_cache_dir_is_one_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(compile_cache.CompileCacheError, match="--compile-cache-dir"):
        compile_cache.enable(str(blocker / "cache"), tmp_path)


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

        off_dir = tmp_path / "island-off"
        run_island(cluster.connect, "isl-off", off_dir, "--compile-cache-dir", "off")
        assert not (off_dir / compile_cache.DEFAULT_SUBDIR).exists()
        assert island_files.metrics_path(off_dir).exists()  # it did train
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
