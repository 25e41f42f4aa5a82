"""The DDP baseline's last metrics row: the final parameters evaluated once, last on the curve."""

from __future__ import annotations

import math
import subprocess
import sys
import threading

import pytest
from conftest import free_port

from bench.analysis import eval_curve
from bench.children import ddp_rank as ddp
from worker import island_files
from worker.config import IslandConfig


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("eval_every", [0, 2])
def test_rank0_writes_a_final_row_with_eval_global_that_ends_the_eval_curve(tmp_path, eval_every):
    port = free_port()
    reducer = subprocess.Popen(
        [sys.executable, "-m", "bench.children.ddp_reducer", "--bind", f"tcp://127.0.0.1:{port}"]
        + ["--world", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert reducer.stdout.readline().strip() == "ready", reducer.stderr.read()
        cfg = IslandConfig(
            connect=f"tcp://127.0.0.1:{port}",
            island="ddp-0",
            data_dir=str(tmp_path),
            model="tiny",
            batch_size=4,
            seq_len=32,
            inner_steps=2,
            max_rounds=2,
            warmup_steps=1,
            eval_every=eval_every,
            eval_batches=2,
        )
        assert ddp.run_rank(cfg, 0, 1, threading.Event()) == 0
    finally:
        reducer.terminate()
        assert reducer.wait(timeout=10) == 0

    rows = island_files.read_rows(tmp_path)
    final = rows[-1]
    assert final["final"] is True and final["round"] == 2
    assert final["steps"] == 4 and final["tokens"] == 4 * 4 * 32
    assert math.isfinite(final["eval_global"])
    evals = [r for r in rows[:-1] if "eval_global" in r]
    if eval_every:  # round 0 and round 2; the final row reuses round 2's evaluation
        assert [r["round"] for r in evals] == [0, 2]
        assert final["eval_global"] == evals[-1]["eval_global"]
    else:
        assert evals == []
    curve = eval_curve({"ddp-0": rows})
    assert curve[-1][1:] == (final["tokens"], final["eval_global"])
