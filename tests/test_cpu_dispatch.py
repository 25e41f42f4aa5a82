"""worker.cpu_dispatch: run inline, the train step's scratch is reused where it was taken.

The figure it serves is the island's RSS slope in an hour's soak (issue 37). Here a
fresh process runs the `tiny` train step and reads its RSS; by default (the control)
XLA's worker threads each keep a copy of the ~16.8 MB scratch in their own malloc
arena and RSS moves among levels ~16 MB apart; inline it stays put.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import glibc_linux

REPO = Path(__file__).resolve().parents[1]

# argv[1]: "inline" (the island daemon's setting) or "default". Prints the RSS in MiB
# every 25 steps from step 150 (the first steps still grow the heap) to step 450.
STEPS = """
import json, os, sys
if sys.argv[1] == "inline":
    from worker import cpu_dispatch
    assert cpu_dispatch.configure() == "inline"
import jax
import numpy as np
from worker import model
from worker.train import InnerConfig, InnerTrainer
page = os.sysconf("SC_PAGE_SIZE")
rss_mib = lambda: int(open("/proc/self/statm").read().split()[1]) * page / (1 << 20)
cfg = model.model_config("tiny")
trainer = InnerTrainer(cfg, InnerConfig(), jax.device_get(model.init_params(cfg, 0)))
trainer.warmup()
rng = np.random.default_rng(0)
held = []
for step in range(1, 451):
    trainer.step(rng.integers(0, 256, size=(8, 65), dtype=np.int32))
    if step >= 150 and step % 25 == 0:
        held.append(round(rss_mib(), 1))
print(json.dumps(held))
"""


@glibc_linux
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_inline_dispatch_keeps_the_train_steps_rss_level_where_the_default_moves_it():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = {
        mode: subprocess.Popen(
            [sys.executable, "-c", STEPS, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for mode in ("inline", "default")
    }
    held = {}
    try:
        for mode, proc in procs.items():
            out, err = proc.communicate(timeout=200)
            assert proc.returncode == 0, err[-2000:]
            held[mode] = json.loads(out.split("\n")[-2])
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    inline, default = held["inline"], held["default"]
    # inline: one arena holds the scratch and reuses it (measured: within 1 MB, steps 250-3,000)
    assert max(inline) - min(inline) <= 4, inline
    # the control, the case that falls without `configure`: at least one 16 MB level change
    # (measured: 47-95 MB of swing in 450-3,000 steps, a change by step 250 every time)
    assert max(default) - min(default) >= 12, default
