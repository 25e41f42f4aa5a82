"""worker.cpu_dispatch: run inline, the train step's scratch is reused where it was taken.

The figure it serves is the island's RSS slope in an hour's soak (issue 37). Here a
fresh process runs the `tiny` train step and reads its RSS. Each thread that runs the
step keeps a copy of its ~16.8 MB scratch in its own malloc arena. By default XLA runs
the step on its worker threads, and RSS moves among levels ~16 MB apart (jax 0.10.2,
450 steps: in 2 of 3 runs; it held one level in the third, so the default is no
reliable control). Inline, the calling thread runs it and RSS stays put. The control,
where the figure falls every time: the same inline steps, handed to a second thread
from step 251 on, take a second copy (measured: +15.9, +31.7, +15.8 MB).
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

# argv[1]: "one-thread" (the island daemon's case) or "two-threads" (steps 251-450 on a
# second thread). Prints the RSS in MiB every 25 steps from step 150 (the first steps still
# grow the heap) to step 450.
STEPS = """
import json, os, sys, threading
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
def run(first, last):
    for step in range(first, last + 1):
        trainer.step(rng.integers(0, 256, size=(8, 65), dtype=np.int32))
        if step >= 150 and step % 25 == 0:
            held.append(round(rss_mib(), 1))
run(1, 250)
second = threading.Thread(target=run, args=(251, 450)) if sys.argv[1] == "two-threads" else None
if second is None:
    run(251, 450)
else:
    second.start()
    second.join()
print(json.dumps(held))
"""


@glibc_linux
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_inline_dispatch_keeps_the_train_steps_rss_level_where_a_second_stepping_thread_moves_it():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = {
        mode: subprocess.Popen(
            [sys.executable, "-c", STEPS, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for mode in ("one-thread", "two-threads")
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
    one, two = held["one-thread"], held["two-threads"]
    # one stepping thread: one arena holds the scratch and reuses it (measured: within 1 MB,
    # steps 250-3,000)
    assert max(one) - min(one) <= 4, one
    # the control, where the figure falls: a second thread's arena takes its own copy
    assert max(two) - min(two) >= 12, two
