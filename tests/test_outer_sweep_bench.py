"""diloco-bench outer_sweep runs on a tiny grid and prints its JSON (no thresholds on figures).

Slow: the bench end to end in a subprocess, whose cost is its ~20 XLA compilations (12 s of
CPU with a cold cache, 20-60 s on a busy machine) however small the grid; a smaller grid
would drop a mode or a table this test checks.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_the_sweep_runs_a_tiny_grid_and_prints_its_tables():
    argv = [sys.executable, "-m", "bench.outer_sweep", "--modes", "sync,quorum,async",
            "--islands", "2", "--inner-steps", "3", "--lrs", "0.7", "--momenta", "0.8",
            "--async-lrs", "0.7", "--budget", "12", "--min-rounds", "1", "--push-skip", "both",
            "--batch", "2", "--seq-len", "8", "--eval-batches", "1"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert {"command", "settings", "model", "too_short", "cells", "best", "async_vs_sync",
            "quorum_vs_sync", "push_skip", "seconds"} <= set(result)  # fmt: skip
    # sync + quorum with the skip off and on + async: 4 cells, each of 2 islands x 2 rounds
    assert [(c["mode"], c["push_skip"]) for c in result["cells"]] == [
        ("sync", False),
        ("quorum", False),
        ("quorum", True),
        ("async", False),
    ]
    for cell in result["cells"]:
        assert cell["island_rounds"] == [2, 2], cell
        assert set(cell) >= {"heldout_loss", "outer_steps", "pushes", "skipped_pushes", "folds"}
    assert set(result["best"]) == {"sync", "quorum", "async"}
    assert set(result["best"]["sync"]["3"]["2"]) == {"lr", "momentum", "heldout_loss", "on_edge"}
    assert set(result["async_vs_sync"]["3"]) == {"2"}
    assert set(result["push_skip"]["3"]["2"][0]) >= {"on", "off", "on_vs_off", "skipped_pushes"}


def test_the_sweep_runs_the_shipped_defaults_from_a_first_seed():
    # --pairs default: each cell takes outer_defaults(mode, H, K), and says what was in effect
    argv = [sys.executable, "-m", "bench.outer_sweep", "--modes", "quorum", "--islands", "4",
            "--inner-steps", "3", "--pairs", "default", "--budget", "12", "--min-rounds", "1",
            "--seeds", "1", "--first-seed", "5", "--batch", "2", "--seq-len", "8",
            "--eval-batches", "1"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (cell,) = json.loads(proc.stdout)["cells"]
    assert (cell["seed"], cell["lr"], cell["momentum"]) == (5, None, None)
    # quorum at H <= 17 with 3-5 pushing islands: 1.0 / 0.3 (OUTER_DEFAULTS_TABLE)
    assert cell["outer_in_effect"] == {"lr": 1.0, "momentum": 0.3}


def test_the_sweep_compares_momentum_dtypes_cell_by_cell():
    # --momentum-dtypes float32,bfloat16: each cell runs with both, paired per seed
    argv = [sys.executable, "-m", "bench.outer_sweep", "--modes", "sync", "--islands", "2",
            "--inner-steps", "3", "--pairs", "0.7/0.8", "--budget", "12", "--min-rounds", "1",
            "--momentum-dtypes", "float32,bfloat16", "--downlink", "int8", "--batch", "2",
            "--seq-len", "8", "--eval-batches", "1"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert [c["momentum_dtype"] for c in result["cells"]] == ["float32", "bfloat16"]
    (entry,) = result["momentum_dtype"]["sync"]["3"]["2"]
    assert set(entry) >= {"float32", "bfloat16", "bfloat16_vs_float32", "bfloat16_paired"}
    assert entry["bfloat16_vs_float32"] == entry["bfloat16"] / entry["float32"] - 1
    assert result["best"]["sync"]["3"]["2"]["heldout_loss"] == entry["float32"]
