"""Your own model as an island: a plain-JAX MLP with its own optax optimizer and data.

Two islands (two threads of this process) train the same MLP, each on its own
stream of a regression task, against a local 2-shard parameter server that this
script starts and stops (or the server of --connect). Each island keeps its own
training loop; `session.step` after every inner step is all it adds. At the end
`worker.global_model` reads the global model from the shards, once they merged
every delta they acked, as the same dict of arrays, and prints its held-out loss.

    python examples/own_mlp.py [--steps 100] [--inner-steps 10] [--json]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from local_server import (
    cluster,
    example_parser,
    interrupts,
    join,
    print_summary,
    raise_if_interrupted,
)

import worker

IN, HIDDEN, OUT, BATCH = 16, 64, 4, 64
TEACHER = np.random.default_rng(0).normal(size=(IN, OUT)).astype(np.float32) / np.sqrt(IN)
OPTIMIZER = optax.adam(1e-2)


def init_mlp(seed: int) -> dict[str, jax.Array]:
    """The MLP's parameters: a dict of float32 arrays (any pytree of floating arrays works)."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w1": jax.random.normal(k1, (IN, HIDDEN)) / np.sqrt(IN),
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, OUT)) / np.sqrt(HIDDEN),
        "b2": jnp.zeros(OUT),
    }


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] + params["b2"] - y) ** 2)


def batch(rng: np.random.Generator, size: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets of the task: y = sin(x W) for a fixed teacher W."""
    x = rng.normal(size=(size, IN)).astype(np.float32)
    return x, np.sin(x @ TEACHER).astype(np.float32)


HELDOUT = batch(np.random.default_rng(12345), 1024)


@jax.jit
def train_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def heldout_loss(params: Any) -> float:
    return float(loss_fn(params, *HELDOUT))


def run_island(
    name: str, seed: int, connect: str, args: argparse.Namespace, out: Any, stop: threading.Event
) -> dict:
    """One island: the user's own loop, plus `worker.join` and `session.step`."""
    rng = np.random.default_rng(seed)  # this island's own data stream
    with worker.join(connect, island=name, params=init_mlp(0), inner_steps=args.inner_steps,
                     data_dir=out / name, stop=stop) as session:  # fmt: skip
        params = session.params  # the global model (the first island to join initialises it)
        opt_state = OPTIMIZER.init(params)
        loss = float("nan")
        for _ in range(args.steps):
            if session.stopping:  # `stop` was set (Ctrl-C in the main thread)
                break
            x, y = batch(rng)
            params, opt_state, loss = train_step(params, opt_state, x, y)
            params = session.step(params, tokens=len(x))  # push / fold in when due
        stats = session.stats
        version = session.version
    return {"train_loss": float(loss), "version": version, "pushes": stats.get("pushes")}


def main() -> None:
    args = example_parser(__doc__, steps=100).parse_args()
    stop = interrupts()  # set by Ctrl-C, even where Python swallows its KeyboardInterrupt
    initial = heldout_loss(init_mlp(0))
    with cluster(args) as (connect, out):
        results: dict[str, Any] = {}

        def island(name: str, seed: int) -> None:
            try:
                results[name] = run_island(name, seed, connect, args, out, stop)
            except BaseException as exc:  # reported below, in the main thread
                results[name] = exc

        threads = [threading.Thread(target=island, args=(n, s)) for n, s in (("a", 1), ("b", 2))]
        for thread in threads:
            thread.start()
        try:
            join(threads)  # (a join that wakes: a Ctrl-C is handled at once, see its docstring)
            raise_if_interrupted()  # a Ctrl-C the islands saw, the main thread did not
        finally:  # on Ctrl-C: the islands close (flush, bye) before the server stops
            stop.set()
            join(threads)
        for name, result in sorted(results.items()):
            if isinstance(result, BaseException):
                raise SystemExit(f"island {name} failed: {result}")
            print(f"island {name}: {args.steps} steps, last train loss "
                  f"{result['train_loss']:.4f}, {result['pushes']} pushes", flush=True)  # fmt: skip
        params, version = worker.global_model(connect, like=init_mlp(0))  # the final model
        final = heldout_loss(params)
    print_summary(
        {"initial_loss": initial, "global_loss": final, "global_version": version},
        args.json,
        f"global model: held-out loss {initial:.4f} at start -> {final:.4f} (version {version})",
    )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the islands kept their unacked deltas, the server stopped:
        traceback.print_exc()  # exit now, skipping the interpreter's slow teardown of JAX
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(130)
