"""A small island process for the cluster page's browser test: numpy regression via `worker.join`.

    python tests/page_island.py CONNECT ISLAND READY_FILE

Joins with a 2-leaf linear model as numpy arrays (the host exchange: nothing to
compile), trains it by plain gradient steps on its own stream of a fixed noisy
regression task (its loss falls towards NOISE**2), passes each step's loss to `session.step`, and writes
READY_FILE once joined. Runs until SIGTERM, then closes the session.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import numpy as np

import worker

IN, OUT, BATCH, LR, NOISE = 8, 2, 32, 0.01, 0.5


def main() -> None:
    connect, island, ready = sys.argv[1:4]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    rng = np.random.default_rng(abs(hash(island)) % 1000)
    teacher = np.linspace(-1, 1, IN * OUT, dtype=np.float32).reshape(IN, OUT)
    params = {"w": np.zeros((IN, OUT), np.float32), "b": np.zeros(OUT, np.float32)}
    with worker.join(
        connect, island=island, params=params, inner_steps=4, stop=stop, heartbeat_interval_s=0.5
    ) as session:
        Path(ready).write_text("joined\n")
        params = session.params
        while not stop.is_set():
            x = rng.standard_normal((BATCH, IN)).astype(np.float32)
            y = x @ teacher + NOISE * rng.standard_normal((BATCH, OUT)).astype(np.float32)
            err = x @ params["w"] + params["b"] - y
            loss = float(np.mean(err**2))
            grads = {"w": 2 * x.T @ err / BATCH, "b": 2 * err.mean(axis=0)}
            params = {k: (v - LR * grads[k]).astype(np.float32) for k, v in params.items()}
            params = session.step(params, tokens=BATCH, loss=loss)
            stop.wait(0.02)


if __name__ == "__main__":
    main()
