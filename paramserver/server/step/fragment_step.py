"""The outer step of one fragment: weigh the pending deltas, merge them, step the outer optimizer.

This module owns the arithmetic of a step, given the deltas it merges: the
islands' shares (`paramserver.server.step.weighting`), the merged delta
(`paramserver.server.step.merge`: a `ChunkMerge` of the coded pending deltas,
handed to the step as `fill(lo, hi, out)`, which decodes them a piece at a
time), the outer optimizer (`paramserver.server.step.outer`, applied in place chunk
by chunk by `ChunkedStep`, below: one optimizer for every step
of a run, its lr and momentum given to each step by `ShardConfig.outer_settings`
of the step's N; a step that merges fewer islands than the shard expected is a
smaller share of a round, `weighting.round_share`; sparse topk deltas:
`paramserver.server.step.sparse_merge`'s per-entry merge and SGD) and the
compressed downlink (`paramserver.server.step.downlink`: the fragment takes exactly
the update replicas decode, chunk by chunk). The default optimizer (round
Nesterov) runs as one compiled pass per chunk where numba is installed
(`FusedNesterov`, below: the same bits), `ChunkedStep`
otherwise and for every other optimizer. Which deltas a step merges, and
the bookkeeping around it (pending set, version, counters), are
`paramserver.server.state`'s.

`StepWork` (below) is one step's inputs and result between
`ShardState.begin_step` and `finish_step`: its `run` calls the stepper, in
the shard's step thread while the state goes on serving.

The outer step in place (`ChunkedStep`): an optax transformation applied chunk
by chunk to host buffers. A shard keeps a fragment's params and optimizer state as aligned numpy buffers
(`host_vector`), which JAX reads zero-copy through DLPack (`JaxViews`: each
buffer is imported once). A step walks the fragment in chunks of `CHUNK`
elements: the caller's `fill(lo, hi, out)` writes the merged delta's chunk into
a reused scratch buffer, one jitted call runs the transformation on that chunk
(params and the state's vector leaves are sliced inside the jit by a traced
offset: one compile per fragment and chunk length, not per chunk), and its
outputs are copied back into the buffers' slices. With a `sink` (the
compressed downlink), the jit adds a bfloat16 `carry` (the downlink residual)
to the chunk's update and runs `finish` on it (the downlink's quantizer), and
the sink takes its outputs instead. Chunk k+1 is filled and dispatched before
chunk k's outputs are taken, so XLA computes while the host copies. Scratch is
a few chunks, whatever the fragment's size; no full-size array is allocated
per step.

A momentum kept in bfloat16 (`ShardConfig.momentum_dtype`) is a bfloat16
host buffer: the jitted chunk step reads it as its uint16 bits (DLPack) and
bitcasts it, the rule computes in float32 and stores it rounded to nearest
even (`outer.round_nesterov`), and `FusedNesterov`'s loops do the same on
the bits, so the two paths stay equal bit for bit.

Elementwise transformations only (nesterov, sgd, delayed-nesterov): every
state leaf is either a vector of the fragment's size (chunked) or a value that
is the same for every chunk (delayed Nesterov's counter), which every chunk
reads from before the step and which is written back once, after the last
chunk. The arithmetic is the transformation's own, jitted as the whole-fragment
`outer.DonatingStep` jits it, so the numbers are the same bit for bit
(tests/test_chunked_step.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.dlpack
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

from codec.quant_rule import TINY, max_factor, step_factor
from paramserver.server.config import ShardConfig
from paramserver.server.fragment import (
    Contribution,
    FragmentState,
    PieceGram,
    StepEvent,
    TensorGroups,
    is_sparse,
    partials,
)
from paramserver.server.step.downlink import Downlink, DownlinkError, Int8Publication, new_residual
from paramserver.server.step.merge import chunk_merge, scaled
from paramserver.server.step.outer import (
    ROUND_TOL,
    FragmentOptimizer,
    OuterError,
    OuterRule,
    RoundNesterovState,
    aligned_float32,
    as_rule,
    is_fixed,
    outer_rule,
    set_round_share,
    settings_args,
)
from paramserver.server.step.sparse_merge import (
    SPARSE_PUBLISH_ZSTD_LEVEL,
    sparse_merge,
    sparse_optimizer,
)
from paramserver.server.step.weighting import (
    IslandShare,
    make_weighting,
    merge_coefficients,
    round_share,
)
from paramserver.wire.plan import Fragment

logger = logging.getLogger(__name__)

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)  # a momentum kept in bfloat16 (ShardConfig.momentum_dtype)


class FragmentStepper:
    """One shard's outer step: weighting, merge, outer optimizer and downlink, per fragment."""

    def __init__(self, cfg: ShardConfig) -> None:
        """Build the step from the cluster settings.

        Args:
            cfg: weighting, merge, outer optimizer and downlink settings.
        """
        self.merge = cfg.merge
        # (lr, momentum, why) in effect with N pushing islands: given values, else the
        # defaults of mode, H and N (`ShardConfig.outer_settings`), per step
        self.outer_settings = cfg.outer_settings
        self.in_effect: tuple[float, float] | None = None  # the latest step's (lr, momentum)
        self.weighting = make_weighting(
            cfg.weighting, cfg.staleness_exponent, cfg.step_rule, cfg.max_weight_ratio
        )
        # the rule with lr and momentum as arguments of each step: one compile for any settings
        rule = outer_rule(cfg.outer_optimizer, cfg.nesterov_delay, cfg.momentum_dtype)
        self.optimizer = FragmentOptimizer(rule)  # state <-> arrays (checkpoints)
        self.downlink = Downlink(cfg.downlink)
        finish = self.downlink.finish if self.downlink.compressed else None
        self._step = ChunkedStep(rule, finish=finish)  # the outer step, in place
        # the same step in one compiled pass per chunk, where numba is there (FusedNesterov)
        start = (cfg.effective_outer_lr, cfg.effective_outer_momentum)
        self._fused = FusedNesterov.for_config(cfg.outer_optimizer, *start, cfg.nesterov_delay)
        self.groups = TensorGroups(cfg.merge)  # rda: a cut tensor's other pieces on this shard
        # sparse (topk) deltas: per-entry merge, SGD without momentum (sparse_merge)
        self._sparse = ChunkedStep(sparse_optimizer(cfg.sparse_outer_lr), finish=finish)
        self._sparse_downlink = Downlink(cfg.downlink, zstd_level=SPARSE_PUBLISH_ZSTD_LEVEL)

    def init(self, params: np.ndarray) -> Any:
        """A fragment's fresh optimizer state, as host buffers the step updates in place.

        Args:
            params: the fragment's values (aligned: fragment_step.host_vector).

        Returns:
            The optax state with numpy leaves.
        """
        return self._step.init(params)

    def step(
        self,
        frag: FragmentState,
        merged_in: Sequence[Contribution],
        where: Fragment,
        expected: int | None = None,
        outside: Sequence[PieceGram] = (),
    ) -> tuple[list[IslandShare], tuple[Any, ...] | None]:
        """Merge `merged_in` into `frag` and take one outer step (params, opt_state, residual).

        Args:
            frag: the fragment's state (changed in place; version and pending are not).
            merged_in: the pending deltas this step merges (at least one).
            where: the fragment in the plan (its leaves, for per-tensor merges).
            expected: islands the shard expected this round (its live
                islands at the step); None: the step's own islands.
            outside: rda: the Grams of its cut tensors' other pieces (`paramserver.server.fragment.TensorGroups`).

        Returns:
            (the islands' shares, the published update's codec frames or None
            for the float32 downlink).
        """
        sparse = is_sparse(merged_in)  # topk: each entry over the islands that sent it
        coefficients, shares = merge_coefficients(
            self.weighting, merged_in, frag.version, expected, frag.clock, not sparse
        )  # staleness: the fragment's round clock; sparse entries: not diluted by the share
        sources = [(c.island, scaled(c.delta, c.clip)) for c in merged_in]
        downlink = self.downlink
        settings = None  # the sparse step's SGD keeps its lr as a constant
        if sparse:  # per entry, no momentum
            weights = {x.island: x.weight for x in shares}
            fill = sparse_merge(sources, coefficients, where.size, weights).fill
            step, opt_state = self._sparse, self._sparse.init(frag.params)
            downlink = self._sparse_downlink  # a mostly-zero update: zstd shrinks its codes
        else:
            settings = self.settings_for(expected or len(shares))
            fill = chunk_merge(
                self.merge,
                sources,
                coefficients,
                where,
                partials(outside, merged_in, coefficients),
            ).fill  # decodes the coded pending deltas a piece at a time, chunk by chunk
            step, opt_state = self._step, frag.opt_state
            share = round_share(len(shares), expected) if self.weighting.scales_by_share else 1.0
            set_round_share(opt_state, share)  # the momentum moves once per round
        fused = None if sparse else self._fused
        if fused is not None and not fused.fits(opt_state, downlink.block_size):
            fused = None
        if not self.downlink.compressed:
            if fused is not None:
                fused.step(frag.params, opt_state, fill, settings=settings)
            else:
                step.step(frag.params, opt_state, fill, settings=settings)
            return shares, None
        if frag.residual is None:
            frag.residual = new_residual(frag.params.shape[0])
        publication = downlink.begin(frag.params, frag.residual)
        if fused is not None:
            fused.step(frag.params, opt_state, fill, publication, settings=settings)
        else:
            step.step(
                frag.params, opt_state, fill, publication.apply, frag.residual, settings=settings
            )
        return shares, tuple(publication.frames())

    def settings_for(self, islands: int) -> tuple[float, float]:
        """The outer (lr, momentum) of a step with `islands` pushing islands; logs a change.

        Args:
            islands: the step's N (the islands the shard expected, else those it merges).

        Returns:
            (lr, momentum): `ShardConfig.outer_settings(islands)` (given values win).
        """
        lr, momentum, why = self.outer_settings(islands)
        if (lr, momentum) != self.in_effect:
            logger.info("outer lr %s momentum %s from this step on: %s", lr, momentum, why)
            self.in_effect = (lr, momentum)
        return lr, momentum


CHUNK = 1 << 18  # elements per jitted call: 1 MiB of float32, a few of them stay in cache
MAX_ELEMENTS = (1 << 31) - 1  # offsets are traced as int32

Fill = Callable[[int, int, np.ndarray], None]  # writes the merged delta's [lo, hi) into out
Finish = Callable[[jax.Array], Any]  # jax: the chunk's update (+ carry) -> what the sink takes
Sink = Callable[[int, int, Any], None]  # takes finish(update + carry) of [lo, hi)


def host_vector(values: Any, dtype: Any = np.float32) -> np.ndarray:
    """A 64-byte aligned 1-D copy of `values` (what JAX can read through DLPack without a copy).

    Args:
        values: a 1-D array-like (numpy or jax).
        dtype: the buffer's dtype.

    Returns:
        A writable, C-contiguous, aligned array holding `values`.
    """
    src = np.asarray(values)
    itemsize = np.dtype(dtype).itemsize
    out = aligned_float32(-(-src.size * itemsize // 4)).view(np.uint8)[: src.size * itemsize]
    out = out.view(dtype).reshape(src.shape)
    np.copyto(out, src, casting="unsafe")
    return out


class JaxViews:
    """Zero-copy JAX arrays of numpy buffers, each imported once and kept with its buffer."""

    def __init__(self) -> None:
        """An empty cache."""
        self._views: dict[tuple[int, tuple[int, ...], str], tuple[np.ndarray, jax.Array]] = {}

    def of(self, arr: np.ndarray) -> jax.Array:
        """The JAX array sharing `arr`'s memory (DLPack; `arr` must be 64-byte aligned).

        Args:
            arr: a C-contiguous numpy array of a dtype DLPack knows (view
                bfloat16 as uint16).

        Returns:
            The cached view (the cache holds `arr`, so its memory stays alive).
        """
        key = (arr.ctypes.data, arr.shape, arr.dtype.str)
        hit = self._views.get(key)
        if hit is None:
            hit = self._views[key] = (arr, jax.dlpack.from_dlpack(arr))
        return hit[1]


def _chunk_step(
    rule: OuterRule,
    apply: bool,
    finish: Finish | None,
    offset: jax.Array,
    params: jax.Array,
    state: Any,
    merged: jax.Array,
    lr: jax.Array,
    momentum: jax.Array,
    carry: jax.Array | None = None,
) -> tuple[jax.Array, Any]:
    """The rule at (lr, momentum) on the chunk [offset, offset + len(merged)) of a fragment.

    Returns (new params, new state) when `apply`, else (finish(update + carry),
    new state), `carry` being a bfloat16 vector of the fragment's size as uint16
    bits (none: 0) and `finish` the identity when None. A uint16 vector leaf of
    `state` is a bfloat16 momentum's bits (`ChunkedStep.step`): the rule gets it
    as bfloat16, and its new state has it as bfloat16.
    """
    tx = rule(lr, momentum)
    n, size = params.shape[0], merged.shape[0]

    def cut(leaf: jax.Array) -> jax.Array:
        if leaf.shape == (n,):
            leaf = jax.lax.dynamic_slice_in_dim(leaf, offset, size)
            if leaf.dtype == jnp.uint16:
                return jax.lax.bitcast_convert_type(leaf, jnp.bfloat16)
        return leaf

    p = cut(params)
    updates, new_state = tx.update(merged, jax.tree.map(cut, state), p)
    if apply:
        return optax.apply_updates(p, updates), new_state
    if carry is not None:
        carry = jax.lax.bitcast_convert_type(cut(carry), jnp.bfloat16)
        updates = updates + carry.astype(updates.dtype)
    return (updates if finish is None else finish(updates)), new_state


class ChunkedStep:
    """One elementwise optax transformation, stepped in place over host buffers."""

    def __init__(
        self,
        tx: optax.GradientTransformation | OuterRule,
        chunk: int = CHUNK,
        finish: Finish | None = None,
    ) -> None:
        """Jit the chunk step of a transformation.

        Args:
            tx: the outer transformation with its settings as constants, or a
                rule (`outer.outer_rule`: lr and momentum given to each `step`
                as arguments of the one compiled chunk step).
            chunk: elements per jitted call (a multiple of 1024; tests use small ones).
            finish: a jax function of a chunk's update (+ carry) run in the same
                jit, whose outputs a `step`'s sink takes (the downlink's
                quantizer); None: the sink takes the update.
        """
        if chunk <= 0 or chunk % 1024:
            raise OuterError(f"chunk={chunk} must be a positive multiple of 1024")
        self.fixed = is_fixed(tx)
        rule = as_rule(tx)
        self.tx = tx if self.fixed else rule(1.0, 0.0)  # init: the same for any settings
        self.chunk = chunk
        self.views = JaxViews()
        self._merged = (aligned_float32(chunk), aligned_float32(chunk))
        self._init = jax.jit(self.tx.init)
        self._apply = jax.jit(lambda *a: _chunk_step(rule, True, None, *a))
        self._updates = jax.jit(lambda *a: _chunk_step(rule, False, finish, *a))

    def init(self, params: np.ndarray) -> Any:
        """Fresh optimizer state for a fragment, as host buffers.

        Args:
            params: the fragment's 1-D float32 values (aligned: `host_vector`).

        Returns:
            The optax state with every leaf a numpy array (vectors aligned).
        """
        return host_state(self._init(self.views.of(params)))

    def step(
        self,
        params: np.ndarray,
        state: Any,
        fill: Fill,
        sink: Sink | None = None,
        carry: np.ndarray | None = None,
        settings: tuple[float, float] | None = None,
    ) -> None:
        """One outer step of a fragment, in place, chunk by chunk.

        Args:
            params: the fragment's values (aligned float32 buffer; updated in
                place unless `sink` is given).
            state: its optimizer state from `init` (updated in place).
            fill: `fill(lo, hi, out)` writes the merged delta's elements [lo, hi)
                into `out` (float32, hi - lo elements).
            sink: None to add each chunk's update to `params` (as
                `optax.apply_updates` does, inside the jit); else called as
                `sink(lo, hi, out)` with out = finish(update + carry) of
                [lo, hi), chunk by chunk in order, and `params` is left to it.
            carry: with `sink`, a bfloat16 vector of the fragment's size added
                to the update before `finish` (the downlink residual; a chunk's
                carry is read before its sink runs, so the sink may rewrite it).
            settings: (lr, momentum) of this step, traced (changing them compiles
                nothing); None for a transformation with constant settings.

        Raises:
            OuterError: params too large, a state leaf that is not elementwise,
                or a rule without settings.
        """
        n = params.shape[0]
        lr, momentum = settings_args(settings, self.fixed)
        if n > MAX_ELEMENTS:
            raise OuterError(f"a fragment of {n} elements is over {MAX_ELEMENTS}: use more")
        leaves, treedef = jax.tree.flatten(state)
        vector = [leaf.shape == (n,) for leaf in leaves]
        for leaf, is_vector in zip(leaves, vector, strict=True):
            if not is_vector and leaf.size > 1:
                raise OuterError(f"state leaf of shape {leaf.shape} is not elementwise over {n}")
        # scalar leaves: every chunk reads their value from before the step; a bfloat16
        # vector (the momentum) goes in as its uint16 bits (DLPack has no bfloat16 here)
        inputs = [
            self.views.of(_dlpack_form(x)) if v else jnp.asarray(x)
            for x, v in zip(leaves, vector, strict=True)
        ]
        j_state = jax.tree.unflatten(treedef, inputs)
        j_params = self.views.of(params)
        fn = self._apply if sink is None else self._updates
        extra = () if carry is None or sink is None else (self.views.of(carry.view(np.uint16)),)
        # pipelined: chunk k+1 is filled and dispatched (XLA runs it on its own
        # threads) before chunk k's results are copied back and sunk; chunks are
        # disjoint, and the merged delta alternates between two scratch buffers
        pending: tuple[int, int, Any, Any] | None = None
        new_leaves: list[Any] = []
        for k, lo in enumerate(range(0, n, self.chunk)):
            hi = min(lo + self.chunk, n)
            merged = self._merged[k % 2][: hi - lo]
            fill(lo, hi, merged)
            out, new_state = fn(
                np.int32(lo), j_params, j_state, self.views.of(merged), lr, momentum, *extra
            )
            if pending is not None:
                new_leaves = self._take(params, leaves, vector, sink, *pending)
            pending = (lo, hi, out, new_state)
        if pending is not None:
            new_leaves = self._take(params, leaves, vector, sink, *pending)
        for leaf, new, is_vector in zip(leaves, new_leaves, vector, strict=True):
            if not is_vector:
                np.copyto(leaf, np.asarray(new))

    @staticmethod
    def _take(
        params: np.ndarray,
        leaves: list[np.ndarray],
        vector: list[bool],
        sink: Sink | None,
        lo: int,
        hi: int,
        out: Any,
        new_state: Any,
    ) -> list[Any]:
        """Copy one chunk's results into the buffers (or hand them to the sink)."""
        new_leaves = jax.tree.leaves(new_state)
        for leaf, new, is_vector in zip(leaves, new_leaves, vector, strict=True):
            if is_vector:
                np.copyto(leaf[lo:hi], np.asarray(new))
        if sink is None:
            np.copyto(params[lo:hi], np.asarray(out))
        else:
            sink(lo, hi, out)
        return new_leaves


def _dlpack_form(arr: np.ndarray) -> np.ndarray:
    """A host buffer as DLPack takes it: bfloat16 as its uint16 bits, others as they are."""
    return arr.view(np.uint16) if arr.dtype == BFLOAT16 else arr


def host_state(state: Any) -> Any:
    """An optimizer state with every leaf copied into a host buffer (vectors aligned).

    Args:
        state: an optax state (jax or numpy leaves).

    Returns:
        The same structure with numpy leaves that `ChunkedStep.step` updates in place.
    """

    def to_host(leaf: Any) -> np.ndarray:
        arr = np.asarray(leaf)
        return host_vector(arr, arr.dtype) if arr.ndim == 1 else np.array(arr)

    return jax.tree.map(to_host, state)


# -- the fused step (numba) -----------------------------------------------------


def _kernels() -> Any:
    """`fused_kernels` (numba), or None where numba cannot be imported."""
    try:
        from paramserver.server.step import fused_kernels
    except ImportError:
        return None
    return fused_kernels


class FusedNesterov:
    """`round_nesterov(lr, momentum)` stepped in place by compiled loops: merge fill, Nesterov,
    int8 downlink, apply, in one pass per chunk.

    The default step of a shard (`outer.round_nesterov` with the int8 or float32
    downlink) done by numba loops instead of the jitted `ChunkedStep`:
    per chunk of `CHUNK` elements the merge writes the merged delta into a
    cache-resident scratch (`merge.ChunkMerge.fill`; the mean of int8-coded
    pending deltas is one compiled loop per delta), then one compiled loop
    (`fused_kernels.nesterov_int8`) reads it with the momentum, the residual and
    the params, and writes them back with the published update's codes and block
    scales, straight into the message's frame buffers (`downlink.Int8Publication`).
    Each byte of state is read and written once per step, with no per-chunk
    dispatch or copy back from XLA's outputs.

    Same numbers as the jitted step: the kernels compute `round_nesterov`, the
    codec's int8 rule and the apply in float32, in the order and with the fused
    multiply-adds XLA's CPU build uses (`fused_kernels`; tests/test_fused_step.py
    compares codes, scales, params, momentum and residual bit for bit), except
    that XLA may flush a subnormal residual to zero where this keeps it (the
    codec's numpy and numba encoders keep it too). A shard takes this path when
    numba can be imported and the step is the default one (`FusedNesterov.for_config`),
    else the jitted one, so a shard replaying its log on a machine without numba
    might differ from the original in such ulps; the frames it publishes, which is
    what replicas apply, are always those of the params it keeps.
    """

    def __init__(self, lr: float, momentum: float, kernels: Any, chunk: int = CHUNK) -> None:
        """Keep the constants as the jitted step has them (float32).

        Args:
            lr: the outer learning rate.
            momentum: the momentum decay beta.
            kernels: the `fused_kernels` module.
            chunk: elements per fill (a power of two, at most a payload frame).
        """
        self.neg_lr = np.float32(-lr)
        self.beta = np.float32(momentum)
        self.kernels = kernels
        self.chunk = chunk
        self._merged = aligned_float32(chunk)
        self._buf = np.empty(0, np.float32)  # one block of the int8 downlink

    @classmethod
    def for_config(
        cls, name: str, lr: float, momentum: float, delay: int, chunk: int = CHUNK
    ) -> FusedNesterov | None:
        """The fused step for these outer settings, or None (not round Nesterov, or no numba).

        Args:
            name: the outer optimizer's name.
            lr: outer learning rate.
            momentum: momentum decay.
            delay: Nesterov delay (1: round Nesterov).
            chunk: elements per fill.

        Returns:
            A FusedNesterov, or None for the jitted step.
        """
        if name != "nesterov" or delay != 1:
            return None
        kernels = _kernels()
        return None if kernels is None else cls(lr, momentum, kernels, chunk)

    def fits(self, state: Any, block: int) -> bool:
        """Whether this step can take a fragment's state and the downlink's block size.

        Args:
            state: the fragment's optimizer state.
            block: the int8 block size (0: the float32 downlink).

        Returns:
            True for a RoundNesterovState (momentum float32 or bfloat16) and a
            block that divides the chunk.
        """
        if not isinstance(state, RoundNesterovState):
            return False
        kept = np.asarray(state.momentum).dtype
        return kept in (np.float32, BFLOAT16) and (block == 0 or self.chunk % block == 0)

    def step(
        self,
        params: np.ndarray,
        state: RoundNesterovState,
        fill: Fill,
        publication: Int8Publication | None = None,
        settings: tuple[float, float] | None = None,
    ) -> None:
        """One outer step of a fragment, in place, chunk by chunk.

        Args:
            params: the fragment's aligned float32 values (updated in place).
            state: its RoundNesterovState with numpy leaves (updated in place;
                a bfloat16 momentum is computed in float32 and stored rounded
                to nearest even, as the jitted rule does).
            fill: `fill(lo, hi, out)` writes the merged delta's [lo, hi) into `out`.
            publication: the int8 downlink's message (codes and scales written
                into it, params and its residual updated); None: params += update.
            settings: (lr, momentum) of this step (arguments of the compiled
                loops); None: those this step was built with.

        Raises:
            DownlinkError: the update is not finite (the chunks before stay applied,
                as with the jitted step, and so do this chunk's other blocks).
        """
        n = params.shape[0]
        phase, share = np.float32(state.phase), np.float32(state.share)
        fresh = bool(phase <= 0)
        phase = np.float32(phase + share)
        due = bool(phase >= np.float32(1 - ROUND_TOL))
        mom = _dlpack_form(state.momentum)  # the kernels take a bfloat16 one as uint16 bits
        k = self.kernels
        neg_lr, beta = self.neg_lr, self.beta
        if settings is not None:
            neg_lr, beta = np.float32(-settings[0]), np.float32(settings[1])
        if publication is not None:
            block = publication.block
            if self._buf.shape[0] < block:
                self._buf = np.empty(block, np.float32)
            residual = publication.residual_bits
            tiny, inv_max, step = TINY, max_factor(127), step_factor(127)
        for lo in range(0, n, self.chunk):
            hi = min(lo + self.chunk, n)
            merged = self._merged[: hi - lo]
            fill(lo, hi, merged)
            if publication is None:
                k.nesterov_apply(merged, lo, params, mom, neg_lr, beta, fresh, due)
                continue
            bad = k.nesterov_int8(
                merged, lo, params, mom, residual,
                publication.codes_out(lo, hi), publication.scales_out(lo, hi), self._buf,
                neg_lr, beta, fresh, due, block, tiny, inv_max, step,
            )  # fmt: skip
            if bad >= 0:
                raise DownlinkError(f"outer update of elements [{lo}, {hi}) is not finite")
            publication.written(lo, hi)
        np.copyto(state.phase, np.float32(0) if due else phase)


class StepWork:
    """One outer step between `ShardState.begin_step` and `finish_step`: inputs, then result.

    `run` does the arithmetic (merge, outer step, downlink frames) with the
    fragment stepper on the fragment's arrays and nothing else of the state, so
    it may run in a worker thread while the state's owner goes on serving
    (numpy, numba and XLA release the GIL); the owner then books it with
    `finish_step`, which checks that the work is its own (`owner`).
    """

    def __init__(
        self,
        owner: object,
        stepper: FragmentStepper,
        timer: Callable[[], float] | None,
        event: StepEvent,
        frag: FragmentState,
        merged_in: list[Contribution],
        where: Fragment,
        quorum_s: float | None,
    ) -> None:
        """Hold a step's inputs (see `ShardState.begin_step`); `owner` is the state that began it."""
        self.owner = owner
        self.stepper = stepper
        self.timer = timer
        self.event = event
        self.frag = frag
        self.merged_in = merged_in
        self.where = where
        self.quorum_s = quorum_s  # None: replayed (no pace statistics, no log line)
        self.then: Callable[[StepWork], None] | None = None  # run after the arithmetic
        self.shares: list[Any] | None = None
        self.frames: tuple[Any, ...] | None = None
        self.took = 0.0
        self.error: BaseException | None = None
        self.extra: Any = None  # what `then` made (e.g. the float32 update's frames)

    @property
    def fragment(self) -> int:
        """The fragment this step changes."""
        return self.event.fragment

    def run(self) -> None:
        """The step's arithmetic; an exception is kept in `error` for `finish_step` to raise."""
        event, timer = self.event, self.timer
        started = timer() if timer else 0.0
        try:
            self.shares, self.frames = self.stepper.step(
                self.frag, self.merged_in, self.where, event.expected or None, event.outside
            )
            if self.then is not None:
                self.then(self)
        except BaseException as exc:  # re-raised by finish_step, in the owner's thread
            self.error = exc
        self.took = timer() - started if timer else 0.0
