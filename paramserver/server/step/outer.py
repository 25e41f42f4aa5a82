"""The outer optimizer of one fragment: optax transformations, the donated step, state <-> arrays.

This module owns the outer update rule, its state and the whole-fragment
jitted step that applies it (`DonatingStep`; `FragmentOptimizer.step` is a
copying wrapper around it). A rule (`outer_rule`) leaves lr and momentum
open: the shard's steps take them as arguments of one compiled step, so they
can follow the island count step by step, with the bits of the transformation
that has them as constants (`make_outer_optimizer`). A shard applies the same
transformation in place, chunk by chunk (`paramserver.server.step.fragment_step`),
bit for bit equal to it. Sign convention: the merged delta is the pseudo-gradient (global params an
island started from minus its local params), fed to optax as the gradient, so
plain SGD with lr=1 and one island moves the global params exactly onto that
island's params.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.dlpack
import jax.numpy as jnp
import numpy as np
import optax

from paramserver.server.config import MOMENTUM_DTYPES, OUTER_OPTIMIZERS


class OuterError(ValueError):
    """Bad outer-optimizer settings, or arrays that do not fit the optimizer state."""


def momentum_dtype(name: str) -> Any:
    """The JAX dtype a momentum buffer is kept in, by its setting (`ShardConfig.momentum_dtype`).

    Args:
        name: "float32" or "bfloat16".

    Returns:
        jnp.float32 or jnp.bfloat16.

    Raises:
        OuterError: another name.
    """
    if name not in MOMENTUM_DTYPES:
        raise OuterError(f"momentum dtype {name!r} is unknown; choose one of {MOMENTUM_DTYPES}")
    return jnp.bfloat16 if name == "bfloat16" else jnp.float32


def _widen(m: jax.Array) -> jax.Array:
    """A kept momentum as float32 (exact: a bfloat16 is a float32 with its low 16 bits zero)."""
    return m.astype(jnp.float32) if m.dtype != jnp.float32 else m


def _keep(m: jax.Array, dtype: Any) -> jax.Array:
    """A float32 momentum as it is kept: rounded to nearest even into `dtype` (float32: as is)."""
    return m.astype(dtype) if dtype != jnp.float32 else m


class DelayedNesterovState(NamedTuple):
    """State of `delayed_nesterov`: contributions since the last momentum update, buffers."""

    count: jax.Array  # int32 scalar, in [0, delay)
    momentum: Any  # tree like params
    accumulator: Any  # tree like params: sum of pseudo-gradients since the last momentum update


def delayed_nesterov(
    lr: float, momentum: float, delay: int, kept: str = "float32"
) -> optax.GradientTransformation:
    """Delayed Nesterov momentum for fully asynchronous merging (arXiv 2401.09135).

    With pseudo-gradient g, momentum buffer m, accumulator a, counter c, lr and
    beta = momentum, each call does::

        a <- a + g;  c <- c + 1
        if c == delay:   m <- beta * m + a / delay
                         update = -lr * (beta * m + g / delay)
                         a <- 0;  c <- 0
        else:            update = -lr * g / delay

    so each group of `delay` contributions g_1..g_N moves the parameters by
    exactly one Nesterov step on their mean: m' = beta * m + mean(g) and, in
    total, -lr * (beta * m' + mean(g)). Momentum moves once per group; the
    first N-1 contributions take their share of the plain step at once. With
    delay=1 this equals `optax.sgd(lr, momentum, nesterov=True)`.

    Args:
        lr: outer learning rate.
        momentum: momentum decay in [0, 1).
        delay: contributions between momentum updates, >= 1.
        kept: the dtype of the momentum buffer, "float32" or "bfloat16" (the
            update computes in float32; the new m is rounded to nearest even
            when kept in bfloat16; the accumulator stays float32).

    Returns:
        The optax transformation (state: DelayedNesterovState).
    """
    dtype = momentum_dtype(kept)

    def init_fn(params: Any) -> DelayedNesterovState:
        return DelayedNesterovState(
            count=jnp.zeros([], jnp.int32),
            momentum=optax.tree.zeros_like(params, dtype=dtype),
            accumulator=optax.tree.zeros_like(params),
        )

    def update_fn(
        updates: Any, state: DelayedNesterovState, params: Any = None
    ) -> tuple[Any, DelayedNesterovState]:
        del params
        count = state.count + 1
        due = count >= delay
        acc = jax.tree.map(lambda a, g: a + g, state.accumulator, updates)
        mom = jax.tree.map(
            lambda m, a: jnp.where(due, momentum * _widen(m) + a / delay, _widen(m)),
            state.momentum,
            acc,
        )
        out = jax.tree.map(
            lambda g, m: jnp.where(due, -lr * (momentum * m + g / delay), -lr * (g / delay)),
            updates,
            mom,
        )
        acc = jax.tree.map(lambda a: jnp.where(due, jnp.zeros_like(a), a), acc)
        count = jnp.where(due, jnp.zeros_like(count), count)
        mom = jax.tree.map(lambda m: _keep(m, dtype), mom)
        return out, DelayedNesterovState(count=count, momentum=mom, accumulator=acc)

    return optax.GradientTransformation(init_fn, update_fn)


ROUND_TOL = 1e-4  # shares summing to within this of 1 complete a round (1/3 + 1/3 + 1/3)


class RoundNesterovState(NamedTuple):
    """State of `round_nesterov`: this step's share of a round, the round so far, momentum."""

    share: jax.Array  # float32 scalar in (0, 1]: set by the caller before each step
    phase: jax.Array  # float32 scalar: shares summed since the momentum last moved
    momentum: Any  # tree like params, float32 or bfloat16 (`ShardConfig.momentum_dtype`)


def round_nesterov(
    lr: float, momentum: float, kept: str = "float32"
) -> optax.GradientTransformation:
    """Nesterov momentum that moves once per round, however many steps the round takes.

    A step carries `share`, its share of a round (`weighting.round_share`,
    already applied to the pseudo-gradient g it is given). With momentum
    buffer m and phase p (the shares summed so far this round)::

        m <- beta * m + g  on the round's first step (p = 0), else  m <- m + g
        p <- p + share
        if p >= 1:   update = -lr * (g + beta * m);  p <- 0     (the round is complete)
        else:        update = -lr * g

    so the steps g_1..g_n of one round (shares summing to 1) move the
    parameters by exactly one Nesterov step on their sum G: m' = beta * m + G
    and, in total, -lr * (G + beta * m'). With share 1 on every step (sync, or
    a quorum step of every live island) it is `optax.sgd(lr, momentum,
    nesterov=True)` bit for bit; it is Async Local-SGD's delayed Nesterov with
    the delay counted in rounds of the live islands rather than in deltas.

    The momentum may be kept in bfloat16 (`kept`; 2 B/param instead of 4):
    the step reads it as float32 (exact), computes as above in float32 (the
    update uses that float32 m'), and stores m' rounded to nearest even into
    bfloat16. With float32 it is the rule above, bit for bit.

    Args:
        lr: outer learning rate.
        momentum: momentum decay beta in [0, 1).
        kept: the momentum buffer's dtype, "float32" or "bfloat16".

    Returns:
        The optax transformation (state: RoundNesterovState, share 1 at init).
    """
    dtype = momentum_dtype(kept)

    def init_fn(params: Any) -> RoundNesterovState:
        one, zero = jnp.ones([], jnp.float32), jnp.zeros([], jnp.float32)
        return RoundNesterovState(one, zero, optax.tree.zeros_like(params, dtype=dtype))

    def update_fn(
        updates: Any, state: RoundNesterovState, params: Any = None
    ) -> tuple[Any, RoundNesterovState]:
        del params
        fresh = state.phase <= 0
        phase = state.phase + state.share
        due = phase >= 1 - ROUND_TOL
        mom = jax.tree.map(
            lambda m, g: jnp.where(fresh, g + momentum * _widen(m), _widen(m) + g),
            state.momentum,
            updates,
        )
        out = jax.tree.map(
            lambda g, m: jnp.where(due, -lr * (g + momentum * m), -lr * g), updates, mom
        )
        phase = jnp.where(due, jnp.zeros_like(phase), phase)
        mom = jax.tree.map(lambda m: _keep(m, dtype), mom)
        return out, RoundNesterovState(state.share, phase, mom)

    return optax.GradientTransformation(init_fn, update_fn)


def set_round_share(state: Any, share: float) -> None:
    """Tell a host-buffer optimizer state the share of a round its next step is.

    Args:
        state: a fragment's optimizer state (numpy leaves, `fragment_step.host_state`).
        share: in (0, 1]; a state without a share (sgd, delayed Nesterov) is left alone.
    """
    if isinstance(state, RoundNesterovState):
        np.copyto(state.share, np.float32(share))


OuterRule = Callable[[Any, Any], optax.GradientTransformation]
"""An outer update rule as a function of (lr, momentum): Python floats give a transformation
with them as constants, JAX scalars (inside a jit) one whose lr and momentum are arguments."""


def check_outer_settings(lr: float, momentum: float) -> None:
    """Refuse an outer lr or momentum the rules cannot take.

    Args:
        lr: outer learning rate, finite and > 0.
        momentum: momentum decay in [0, 1).

    Raises:
        OuterError: either is out of range (or not a real number).
    """
    if not (isinstance(lr, numbers.Real) and np.isfinite(lr) and lr > 0):
        raise OuterError(f"outer lr={lr!r} must be a finite number > 0")
    if not (isinstance(momentum, numbers.Real) and 0 <= momentum < 1):
        raise OuterError(f"outer momentum={momentum!r} must be in [0, 1)")


def outer_rule(name: str = "nesterov", delay: int = 1, kept: str = "float32") -> OuterRule:
    """The outer update rule of a name, with lr and momentum left open.

    The shard's steps call it inside their jit with the lr and momentum of
    each step as traced float32 scalars, so changing them between steps
    compiles nothing new; called with Python floats it is
    `make_outer_optimizer`'s transformation.

    Args:
        name: "nesterov" (`round_nesterov`; delayed Nesterov when delay > 1),
            "sgd" (plain, momentum ignored; delay must be 1) or "delayed-nesterov".
        delay: contributions between momentum updates, >= 1.
        kept: the dtype the momentum buffer is kept in, "float32" or
            "bfloat16" (`round_nesterov`; sgd keeps none).

    Returns:
        rule(lr, momentum) -> optax.GradientTransformation; its `init` does not
        depend on lr or momentum.

    Raises:
        OuterError: an unknown name or momentum dtype, a bad delay, or sgd with a delay.
    """
    momentum_dtype(kept)  # refuses an unknown one
    if name not in OUTER_OPTIMIZERS:
        raise OuterError(f"unknown outer optimizer {name!r}; choose one of {OUTER_OPTIMIZERS}")
    if isinstance(delay, bool) or not isinstance(delay, int) or delay < 1:
        raise OuterError(f"outer delay={delay!r} must be an int >= 1")
    if name == "sgd":
        if delay != 1:
            raise OuterError(f"delay={delay} needs momentum: use 'delayed-nesterov', not 'sgd'")
        return lambda lr, momentum: optax.sgd(lr)
    if name == "nesterov" and delay == 1:
        return lambda lr, momentum: round_nesterov(lr, momentum, kept)
    return lambda lr, momentum: delayed_nesterov(lr, momentum, delay, kept)


def as_rule(tx: optax.GradientTransformation | OuterRule) -> OuterRule:
    """A rule of a transformation whose settings are constants (it ignores lr and momentum).

    Args:
        tx: a transformation (e.g. `make_outer_optimizer`'s), or already a rule.

    Returns:
        A rule: `tx` itself when it is one, else a rule that returns `tx`.
    """
    if isinstance(tx, optax.GradientTransformation):
        return lambda lr, momentum: tx
    return tx


def is_fixed(tx: optax.GradientTransformation | OuterRule) -> bool:
    """Whether `tx` carries its settings as constants (a transformation, not a rule)."""
    return isinstance(tx, optax.GradientTransformation)


def settings_args(
    settings: tuple[float, float] | None, fixed: bool
) -> tuple[np.float32, np.float32]:
    """A step's (lr, momentum) as the float32 scalars its jit takes.

    Args:
        settings: (lr, momentum) of this step; None only for a fixed transformation.
        fixed: whether the step's transformation has its settings as constants
            (then the arguments are unused and `settings` may be None).

    Returns:
        (float32 lr, float32 momentum).

    Raises:
        OuterError: a rule without settings, or settings out of range.
    """
    if settings is None:
        if not fixed:
            raise OuterError("this outer step takes its lr and momentum per step: pass settings")
        return np.float32(0), np.float32(0)
    check_outer_settings(*settings)
    return np.float32(settings[0]), np.float32(settings[1])


def make_outer_optimizer(
    name: str = "nesterov",
    lr: float = 0.7,
    momentum: float = 0.9,
    delay: int = 1,
    kept: str = "float32",
) -> optax.GradientTransformation:
    """Build the outer optax transformation with its lr and momentum as constants.

    Args:
        name: "nesterov" (`round_nesterov`: momentum moved once per round;
            delayed Nesterov when delay > 1), "sgd" (plain, no momentum; delay
            must be 1) or "delayed-nesterov".
        lr: outer learning rate, > 0.
        momentum: in [0, 1); ignored by "sgd".
        delay: contributions between momentum updates, >= 1.
        kept: the momentum buffer's dtype, "float32" or "bfloat16".

    Returns:
        An optax.GradientTransformation applied to the pseudo-gradient
        (`outer_rule(name, delay, kept)(lr, momentum)`).
    """
    if name not in OUTER_OPTIMIZERS:
        raise OuterError(f"unknown outer optimizer {name!r}; choose one of {OUTER_OPTIMIZERS}")
    check_outer_settings(lr, momentum)
    return outer_rule(name, delay, kept)(lr, momentum)


def _check_vector(name: str, arr: np.ndarray, size: int | None = None) -> None:
    if not isinstance(arr, np.ndarray) or arr.dtype != np.float32 or arr.ndim != 1:
        raise OuterError(
            f"{name} must be a 1-D float32 numpy array, got "
            f"{type(arr).__name__} {getattr(arr, 'dtype', None)} {getattr(arr, 'shape', None)}"
        )
    if size is not None and arr.shape != (size,):
        raise OuterError(f"{name} has shape {arr.shape}, expected ({size},)")


def aligned_float32(size: int, align: int = 64) -> np.ndarray:
    """An uninitialized 1-D float32 array whose data starts on an `align`-byte boundary.

    Args:
        size: number of elements.
        align: alignment in bytes (64: what XLA's CPU client needs to alias
            a buffer through DLPack instead of copying it).

    Returns:
        A writable, C-contiguous float32 array of `size` elements.
    """
    raw = np.empty(size * 4 + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + size * 4].view(np.float32)


class DonatingStep:
    """The outer step of a fragment, jitted with params and optimizer state donated.

    The optax transformation applied to the merged pseudo-gradient, with params
    and state kept as JAX arrays that XLA updates in place, and the merged
    delta entering zero-copy (a 64-byte aligned numpy buffer via DLPack; an
    unaligned one is copied by JAX). Measured on a 8M-element fragment: 10 ms
    instead of 150 ms, which went to copies and page faults of freshly
    allocated memory. Given a rule (`outer_rule`), each call takes its lr and
    momentum as arguments of the one compiled step.

    A numpy view of the old params (e.g. a shard's `snapshot`) stays valid:
    JAX does not donate a buffer that has external references (it copies instead).
    """

    def __init__(self, tx: optax.GradientTransformation | OuterRule) -> None:
        """Jit the step of a transformation.

        Args:
            tx: the outer transformation with its settings as constants, or a
                rule (lr and momentum given per call).
        """
        self.fixed = is_fixed(tx)
        rule = as_rule(tx)
        self.tx = tx if self.fixed else rule(1.0, 0.0)  # init: the same for any settings

        def step(
            params: jax.Array, opt_state: Any, delta: jax.Array, lr: jax.Array, momentum: jax.Array
        ) -> tuple[jax.Array, Any]:
            updates, opt_state = rule(lr, momentum).update(delta, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        self._step = jax.jit(step, donate_argnums=(0, 1))

    def __call__(
        self,
        params: jax.Array,
        opt_state: Any,
        merged: np.ndarray,
        settings: tuple[float, float] | None = None,
    ) -> tuple[jax.Array, Any]:
        """One step; `merged` may be reused by the caller as soon as this returns.

        Args:
            params: the fragment's params (donated: do not use them afterwards).
            opt_state: its optimizer state (donated).
            merged: the merged pseudo-gradient, 1-D float32, C-contiguous, writable.
            settings: (lr, momentum) of this step (a rule); None for a fixed transformation.

        Returns:
            (new params, new optimizer state).
        """
        delta = jax.dlpack.from_dlpack(merged)  # zero-copy when 64-byte aligned
        lr, momentum = settings_args(settings, self.fixed)
        new_params, new_state = self._step(params, opt_state, delta, lr, momentum)
        jax.block_until_ready((new_params, new_state))
        return new_params, new_state


class FragmentOptimizer:
    """Applies one outer transformation to fragments (1-D float32 vectors).

    Holds only the transformation and its `DonatingStep`; the state is passed
    in and out, so one instance serves every fragment (jit caches per shape).
    """

    def __init__(self, tx: optax.GradientTransformation | OuterRule) -> None:
        """Wrap a transformation.

        Args:
            tx: e.g. from make_outer_optimizer, or a rule (`outer_rule`: lr and
                momentum given to each `step`).
        """
        self.donating = DonatingStep(tx)
        self.tx = self.donating.tx  # for init and the state's structure

    def init(self, params: np.ndarray) -> Any:
        """Fresh optimizer state for one fragment.

        Args:
            params: the fragment's 1-D float32 values.

        Returns:
            The optax state (a pytree of jax arrays).
        """
        _check_vector("params", params)
        return self.tx.init(jnp.asarray(params))

    def step(
        self,
        params: np.ndarray,
        state: Any,
        merged_delta: np.ndarray,
        settings: tuple[float, float] | None = None,
    ) -> tuple[np.ndarray, Any]:
        """One outer step of a fragment, through `self.donating`.

        Inputs are not consumed: params and state are copied before being
        donated, and merged_delta is copied into an aligned buffer only when
        DLPack cannot take it as is (unaligned, strided or read-only).

        Args:
            params: current 1-D float32 values.
            state: state from init / a previous step (stays usable).
            merged_delta: weighted pseudo-gradient, 1-D float32 of the same size.
            settings: (lr, momentum) of this step (a rule); None for a fixed transformation.

        Returns:
            (new params as a writable 1-D float32 numpy array, new state).
        """
        _check_vector("params", params)
        _check_vector("merged_delta", merged_delta, params.shape[0])
        merged = merged_delta
        if merged.ctypes.data % 64 or not merged.flags.c_contiguous or not merged.flags.writeable:
            merged = aligned_float32(merged_delta.shape[0])
            merged[...] = merged_delta
        new_params, new_state = self.donating(
            jnp.array(params, copy=True), jax.tree.map(jnp.copy, state), merged, settings
        )
        # np.asarray of a jax array is a read-only view; callers write into params.
        return np.array(new_params, dtype=np.float32), new_state

    def state_to_arrays(self, state: Any) -> list[np.ndarray]:
        """Flatten a state to numpy arrays, e.g. for a checkpoint.

        Args:
            state: optimizer state.

        Returns:
            The state's leaves as numpy arrays, in pytree order.
        """
        return [np.array(leaf) for leaf in jax.tree.leaves(state)]

    def state_from_arrays(self, arrays: Sequence[np.ndarray], params: np.ndarray) -> Any:
        """Rebuild a state from `state_to_arrays` output.

        Args:
            arrays: the saved leaves (a bfloat16 momentum as bfloat16).
            params: the fragment's values (gives the state's structure and shapes).

        Returns:
            The optimizer state.

        Raises:
            OuterError: another number of leaves, another shape, or a bfloat16
                leaf where this optimizer keeps float32 (or the reverse).
        """
        template = self.init(params)
        leaves, treedef = jax.tree.flatten(template)
        if len(arrays) != len(leaves):
            raise OuterError(
                f"{len(arrays)} state arrays given, this optimizer's state has {len(leaves)}; "
                "was the checkpoint written with another outer optimizer?"
            )
        restored = []
        for i, (arr, leaf) in enumerate(zip(arrays, leaves, strict=True)):
            arr = np.asarray(arr)
            if arr.shape != leaf.shape:
                raise OuterError(f"state array {i} has shape {arr.shape}, expected {leaf.shape}")
            if (arr.dtype == jnp.bfloat16) != (leaf.dtype == jnp.bfloat16):
                raise OuterError(
                    f"state array {i} is {arr.dtype}, this optimizer keeps it in {leaf.dtype}: "
                    "a momentum dtype is never converted silently"
                )
            restored.append(jnp.asarray(arr, dtype=leaf.dtype))
        return jax.tree.unflatten(treedef, restored)
