"""The island's inner training: the AdamW optimizer and a jit-compiled train/eval step.

This module owns the inner optimizer configuration and the `InnerTrainer`, which holds
the island's current parameters and optimizer state on its devices and advances them one
batch at a time. It knows nothing of the network: the worker reads `numpy_params()` to
compute deltas and calls `set_params()` when a new global version is merged in.

Learning-rate schedule: linear warm-up, then either constant (the default, because
rounds go on indefinitely and the outer optimizer sets the pace) or a cosine decay to
`final_lr_fraction * lr` over `decay_steps`, constant at that floor afterwards. The step
count lives in the optimizer state, so it carries across `set_params()`.

Devices: the island may drive several devices, of one process or (after
`jax.distributed.initialize`, see `worker.process_group`) of several. They form a 1-D mesh
("data"); each batch is split along its first axis, every process placing only the rows
of its own devices. Parameters and AdamW state are replicated over the mesh, or with
``param_sharding="fsdp"`` cut over it (`worker.device_layout`); XLA inserts the gradient
all-reduce and the gathers. The default is every device of JAX's default backend, so the
same code runs on CPU, GPU or TPU.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from paramserver.plumbing.validate import Checks
from worker import device_layout, model
from worker.config import IslandConfig

logger = logging.getLogger(__name__)

_DECAYS = ("constant", "cosine")


class InnerConfigError(ValueError):
    """An inner-training setting or input is invalid."""


@dataclasses.dataclass(frozen=True)
class InnerConfig:
    """Inner (per-island) AdamW training settings."""

    # the island's defaults (worker.config, the one source): peak rate after warm-up (on tiny
    # 3e-3 ~ 6e-3 > 1e-3 at 300 steps), and linear warm-up from 0 over this many steps (0: none)
    lr: float = IslandConfig.lr
    warmup_steps: int = IslandConfig.warmup_steps
    decay: str = "constant"  # after warm-up: "constant" or "cosine" (to the floor, then flat)
    decay_steps: int = 10_000  # cosine: steps from the end of warm-up to the floor
    final_lr_fraction: float = 0.1  # cosine: floor as a fraction of lr
    weight_decay: float = 0.1  # decoupled weight decay on matrices (not LayerNorm)
    b1: float = 0.9  # AdamW first-moment decay
    b2: float = 0.95  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW denominator epsilon
    grad_clip: float = 1.0  # clip the global gradient norm to this (0: no clipping)
    batch_size: int = IslandConfig.batch_size  # global batch B (split over the island's devices)
    seq_len: int = IslandConfig.seq_len  # context length T (windows hold T+1 bytes)

    def __post_init__(self) -> None:
        check = Checks("InnerConfig", InnerConfigError)
        check.number("lr", self.lr, above=0.0)
        for field in ("weight_decay", "grad_clip", "eps"):
            check.number(field, getattr(self, field), low=0.0)
        check.number("final_lr_fraction", self.final_lr_fraction, low=0.0, high=1.0)
        for field in ("b1", "b2"):
            check.number(field, getattr(self, field), low=0.0, below=1.0)
        for field, minimum in (("warmup_steps", 0), ("decay_steps", 1), ("batch_size", 1)):
            check.integer(field, getattr(self, field), minimum)
        check.integer("seq_len", self.seq_len, 1)
        check.choice("decay", self.decay, _DECAYS)


def make_schedule(cfg: InnerConfig) -> optax.Schedule:
    """The learning-rate schedule described in the module docstring.

    Args:
        cfg: inner settings.

    Returns:
        An optax schedule: step -> learning rate.
    """
    if cfg.decay == "cosine":
        after = optax.cosine_decay_schedule(cfg.lr, cfg.decay_steps, alpha=cfg.final_lr_fraction)
    else:
        after = optax.constant_schedule(cfg.lr)
    if cfg.warmup_steps == 0:
        return after
    warmup = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
    return optax.join_schedules([warmup, after], boundaries=[cfg.warmup_steps])


def make_inner_optimizer(cfg: InnerConfig) -> optax.GradientTransformation:
    """AdamW with warm-up/decay schedule and global-norm clipping.

    Args:
        cfg: inner settings.

    Returns:
        An optax transformation; weight decay skips LayerNorm scales and biases.
    """
    adamw = optax.adamw(
        learning_rate=make_schedule(cfg),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=model.weight_decay_mask,
    )
    if cfg.grad_clip == 0:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)


def _resolve_devices(devices: Sequence[jax.Device] | int | None) -> list[jax.Device]:
    available = jax.devices()
    if devices is None:
        return list(available)
    if isinstance(devices, int) and not isinstance(devices, bool):
        if not 1 <= devices <= len(available):
            raise InnerConfigError(
                f"devices={devices} but the default backend has {len(available)} device(s)"
            )
        return list(available[:devices])
    chosen = list(devices)
    if not chosen:
        raise InnerConfigError("devices must not be empty")
    return chosen


def _placed_like(leaf: Any, sharding: NamedSharding) -> bool:
    return (
        isinstance(leaf, jax.Array)
        and leaf.dtype == np.float32
        and leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    )


class InnerTrainer:
    """Holds an island's parameters and AdamW state and runs jitted train/eval steps.

    Buffers are donated to each step, so a `params` tree read before `step()` is invalid
    afterwards; use `numpy_params()` for a snapshot that survives.
    """

    def __init__(
        self,
        model_cfg: model.ModelConfig,
        inner_cfg: InnerConfig,
        params: dict,
        devices: Sequence[jax.Device] | int | None = None,
        param_sharding: str = "replicated",
    ) -> None:
        """Place parameters on the devices and initialise the optimizer.

        Args:
            model_cfg: model shape.
            inner_cfg: inner optimizer settings.
            params: initial parameter tree (numpy or jax); copied, not consumed.
            devices: None for every default-backend device, an int for the first n of
                them, or an explicit list of devices (in a multi-process island: all
                processes' devices, the same list everywhere).
            param_sharding: "replicated" or "fsdp" (`worker.device_layout`).
        """
        self.model_cfg = model_cfg
        self.inner_cfg = inner_cfg
        self.devices = _resolve_devices(devices)
        self.param_sharding = param_sharding
        self.mesh = mesh = Mesh(np.asarray(self.devices), (device_layout.AXIS,))
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._batch_sharding = NamedSharding(mesh, PartitionSpec(device_layout.AXIS))
        self._tx = make_inner_optimizer(inner_cfg)
        self._treedef = jax.tree_util.tree_structure(params)
        self._shapes = [np.shape(leaf) for leaf in jax.tree_util.tree_leaves(params)]
        self._leaf_shardings = jax.tree_util.tree_leaves(
            device_layout.tree_shardings(params, mesh, param_sharding)
        )
        self._params = self._place(params)
        p_shard = jax.tree_util.tree_unflatten(self._treedef, self._leaf_shardings)
        o_shard = device_layout.tree_shardings(
            jax.eval_shape(self._tx.init, self._params), mesh, param_sharding
        )
        self._opt_state = jax.jit(self._tx.init, out_shardings=o_shard)(self._params)
        self._steps_done = 0
        self._tokens_done = 0

        def train_step(params: dict, opt_state: optax.OptState, tokens_BxT1: jax.Array):
            loss, grads = jax.value_and_grad(model.loss_fn)(params, tokens_BxT1, model_cfg)
            updates, opt_state = self._tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        rep, shard = self._replicated, self._batch_sharding
        self._train_step = jax.jit(
            train_step,
            in_shardings=(p_shard, o_shard, shard),
            out_shardings=(p_shard, o_shard, rep),
            donate_argnums=(0, 1),
        )
        self._eval_step = jax.jit(
            lambda params, tokens_BxT1: model.loss_fn(params, tokens_BxT1, model_cfg),
            in_shardings=(p_shard, shard),
            out_shardings=rep,
        )
        logger.info(
            "inner trainer: %d params on %d device(s) (%s), %s",
            model.count_params(params),
            len(self.devices),
            self.devices[0].platform,
            param_sharding,
        )

    def _place(self, tree: dict) -> dict:
        treedef = jax.tree_util.tree_structure(tree)
        if treedef != self._treedef:
            raise InnerConfigError(
                f"parameter tree structure {treedef} != expected {self._treedef}"
            )
        leaves = jax.tree_util.tree_leaves(tree)
        for leaf, shape in zip(leaves, self._shapes, strict=True):
            if np.shape(leaf) != shape:
                raise InnerConfigError(f"parameter of shape {np.shape(leaf)} != expected {shape}")
        # A fresh copy, so donation never frees a buffer the caller still holds: on the
        # devices for a float32 leaf already placed like ours (a device exchange's fold),
        # else through a float32 host copy, each process placing only its own devices' slices.
        placed = []
        for leaf, sharding in zip(leaves, self._leaf_shardings, strict=True):
            if _placed_like(leaf, sharding):
                placed.append(jax.device_put(leaf, sharding, may_alias=False))
                continue
            h = np.array(leaf, dtype=np.float32, copy=True)
            placed.append(jax.make_array_from_callback(h.shape, sharding, lambda i, h=h: h[i]))
        return jax.tree_util.tree_unflatten(self._treedef, placed)

    def _put_batch(self, tokens_BxT1: np.ndarray) -> jax.Array:
        shape = np.shape(tokens_BxT1)
        if len(shape) != 2 or shape[1] < 2:
            raise InnerConfigError(f"batch must have shape [B, T+1] with T >= 1, got {shape}")
        if shape[0] % len(self.devices):
            raise InnerConfigError(
                f"batch size {shape[0]} is not divisible by the {len(self.devices)} device(s)"
            )
        host = np.asarray(tokens_BxT1, dtype=np.int32)
        return jax.make_array_from_callback(host.shape, self._batch_sharding, lambda i: host[i])

    def step(self, tokens_BxT1: np.ndarray) -> float:
        """One AdamW step on one batch.

        Args:
            tokens_BxT1: int array [B, T+1]; B must be divisible by the device count.

        Returns:
            The batch's mean loss (nats/byte) before the update.
        """
        batch = self._put_batch(tokens_BxT1)
        self._params, self._opt_state, loss = self._train_step(self._params, self._opt_state, batch)
        self._steps_done += 1
        self._tokens_done += batch.shape[0] * (batch.shape[1] - 1)
        return float(loss)

    def warmup(self) -> float:
        """Compile the train and eval steps now, leaving the trainer's state untouched.

        Runs the jitted train step twice on device copies of the parameters and
        optimizer state (they are donated; the second call takes the first call's
        outputs, so both input signatures a real run meets are compiled) and the eval
        step once, on a zero batch of shape [batch_size, seq_len + 1]. Parameters,
        optimizer state, `steps_done` and `tokens_done` are unchanged, bit for bit,
        so a later `step()` gives exactly what it would have given without this;
        it just no longer pays the compile. Call it before timing anything (before
        a start barrier), so compile time is neither padded by a speed factor nor
        charged to round 1.

        Returns:
            Seconds the warm-up took (compiles plus the throw-away steps).
        """
        t0 = time.monotonic()
        cfg = self.inner_cfg
        batch = self._put_batch(np.zeros((cfg.batch_size, cfg.seq_len + 1), np.int32))
        params, opt_state = jax.tree_util.tree_map(
            lambda x: x.copy(), (self._params, self._opt_state)
        )
        for _ in range(2):
            params, opt_state, loss = self._train_step(params, opt_state, batch)
        jax.block_until_ready(loss)
        jax.block_until_ready(self._eval_step(self._params, batch))
        del params, opt_state
        seconds = time.monotonic() - t0
        logger.info("inner trainer warm-up (compile) took %.2f s", seconds)
        return seconds

    def evaluate(self, batches: Sequence[np.ndarray], params: dict | None = None) -> float:
        """Mean loss over evaluation batches, weighted by batch size; no update.

        Args:
            batches: int arrays [B, T+1] (e.g. from `worker.data.eval_batches`).
            params: evaluate this tree (same structure, e.g. the global parameters)
                instead of the trainer's own parameters.

        Returns:
            Mean loss in nats/byte.
        """
        if not batches:
            raise InnerConfigError("evaluate needs at least one batch")
        placed = self._params if params is None else self._place(params)
        total, count = 0.0, 0
        for tokens_BxT1 in batches:
            batch = self._put_batch(tokens_BxT1)
            total += float(self._eval_step(placed, batch)) * batch.shape[0]
            count += batch.shape[0]
        return total / count

    @property
    def params(self) -> dict:
        """The current parameters (jax arrays, replicated); invalidated by the next step."""
        return self._params

    def set_params(self, tree: dict) -> None:
        """Replace the parameters, keeping the optimizer state (moments and step count).

        Args:
            tree: numpy or jax tree with the same structure and shapes; copied.
        """
        self._params = self._place(tree)

    def numpy_params(self) -> dict:
        """A host snapshot of the parameters (gathered from every device).

        In a multi-process island with sharded parameters this is a collective:
        every process must call it at the same point.

        Returns:
            Nested dict of float32 numpy arrays, owned by the caller.
        """

        def to_host(x: jax.Array) -> np.ndarray:
            if not (x.is_fully_addressable or x.is_fully_replicated):
                x = multihost_utils.process_allgather(x, tiled=True)
            return np.array(x, dtype=np.float32, copy=True)

        return jax.tree_util.tree_map(to_host, self._params)

    def bytes_per_device(self) -> dict[str, int]:
        """Bytes of parameters plus optimizer state held on each of this process's devices."""
        return device_layout.bytes_per_device(self._params, self._opt_state)

    @property
    def steps_done(self) -> int:
        """Number of `step()` calls so far."""
        return self._steps_done

    @property
    def tokens_done(self) -> int:
        """Number of predicted tokens (B*T summed over steps) so far."""
        return self._tokens_done
