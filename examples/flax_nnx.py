"""A Flax NNX model as an island: `nnx.split` the model, step the state, `nnx.merge` it back.

The session sees only the model's `nnx.State` of parameters (a pytree of floating
arrays); the graph definition stays with the user. The island trains a small NNX MLP
on a classification task against a local 2-shard server that this script starts and
stops (or the server of --connect), then prints the global model's held-out loss.
Needs flax: pip install 'decoupled-diloco[examples]'.

    python examples/flax_nnx.py [--steps 100] [--inner-steps 10] [--json]
"""

from __future__ import annotations

import sys

try:
    from flax import nnx
except ImportError:  # flax is an optional extra
    print(
        "examples/flax_nnx.py skipped: flax is not installed "
        "(pip install 'decoupled-diloco[examples]')"
    )
    sys.exit(0)

import jax
import numpy as np
import optax
from local_server import cluster, example_parser, global_model, print_summary

import worker

IN, HIDDEN, CLASSES, BATCH = 8, 32, 3, 64
CENTERS = np.random.default_rng(0).normal(size=(CLASSES, IN)).astype(np.float32)


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(IN, HIDDEN, rngs=rngs)
        self.out = nnx.Linear(HIDDEN, CLASSES, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.gelu(self.hidden(x)))


def batch(rng: np.random.Generator, size: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
    """Points around one of CLASSES centres, and the centre's label."""
    labels = rng.integers(0, CLASSES, size)
    x = CENTERS[labels] + rng.normal(scale=0.8, size=(size, IN)).astype(np.float32)
    return x, labels


HELDOUT = batch(np.random.default_rng(999), 1024)
OPTIMIZER = optax.adamw(1e-2)
GRAPHDEF, INIT_STATE = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)


def loss_fn(state: nnx.State, x: jax.Array, labels: jax.Array) -> jax.Array:
    model = nnx.merge(GRAPHDEF, state)
    return optax.softmax_cross_entropy_with_integer_labels(model(x), labels).mean()


@jax.jit
def train_step(state, opt_state, x, labels):
    loss, grads = jax.value_and_grad(loss_fn)(state, x, labels)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, state)
    return optax.apply_updates(state, updates), opt_state, loss


def main() -> None:
    args = example_parser(__doc__, steps=100).parse_args()
    initial = float(loss_fn(INIT_STATE, *HELDOUT))
    rng = np.random.default_rng(1)
    with cluster(args) as (connect, out):
        with worker.join(connect, island="nnx", params=INIT_STATE, inner_steps=args.inner_steps,
                         data_dir=out / "nnx") as session:  # fmt: skip
            state = session.params  # an nnx.State again: the global model to start from
            opt_state = OPTIMIZER.init(state)
            for _ in range(args.steps):
                x, labels = batch(rng)
                state, opt_state, loss = train_step(state, opt_state, x, labels)
                state = session.step(state, tokens=len(x))
            pushes = session.stats.get("pushes")
        print(f"island nnx: {args.steps} steps, last train loss {float(loss):.4f}, "
              f"{pushes} pushes", flush=True)  # fmt: skip
        params, version = global_model(connect, like=INIT_STATE)
        model = nnx.merge(GRAPHDEF, params)  # back to a module, e.g. to serve it
        final = float(loss_fn(nnx.state(model, nnx.Param), *HELDOUT))
        accuracy = float((model(HELDOUT[0]).argmax(-1) == HELDOUT[1]).mean())
    print_summary(
        {"initial_loss": initial, "global_loss": final, "global_accuracy": accuracy,
         "global_version": version},
        args.json,
        f"global model: held-out loss {initial:.4f} at start -> {final:.4f}, "
        f"accuracy {accuracy:.2f} (version {version})",
    )  # fmt: skip


if __name__ == "__main__":
    main()
