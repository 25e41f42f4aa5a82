"""A plain-JAX MLP with its own optax optimizer and data: a model that is not ours, for sessions.

The task is regression onto a fixed random teacher (a linear map through
tanh); the held-out set is a fixed batch of the same distribution.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

IN, HIDDEN, OUT = 8, 32, 4
BATCH = 32


class Layer(NamedTuple):
    w: jax.Array
    b: jax.Array


def init_mlp(seed: int = 0) -> dict:
    """Parameters as a dict holding a list of NamedTuples (a mixed pytree)."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "layers": [
            Layer(jax.random.normal(k1, (IN, HIDDEN)) / np.sqrt(IN), jnp.zeros(HIDDEN)),
            Layer(jax.random.normal(k2, (HIDDEN, OUT)) / np.sqrt(HIDDEN), jnp.zeros(OUT)),
        ]
    }


def forward(params: dict, x: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ params["layers"][0].w + params["layers"][0].b)
    return h @ params["layers"][1].w + params["layers"][1].b


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((forward(params, x) - y) ** 2)


_TEACHER = np.random.default_rng(1234).normal(size=(IN, OUT)).astype(np.float32)


def batch(rng: np.random.Generator, size: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
    """One batch (x, y) of the teacher task."""
    x = rng.normal(size=(size, IN)).astype(np.float32)
    return x, np.tanh(x @ _TEACHER).astype(np.float32)


HELDOUT = batch(np.random.default_rng(99), 256)

OPTIMIZER = optax.adam(1e-2)


@jax.jit
def train_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def heldout_loss(params) -> float:
    """Mean squared error of `params` on the held-out batch."""
    return float(loss_fn(params, *HELDOUT))
