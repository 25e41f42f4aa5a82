"""The outer step of one fragment: weigh the pending deltas, merge them, step the outer optimizer.

This module owns the arithmetic of a step, given the deltas it merges: the
islands' shares (`paramserver.server.weighting`), the merged delta
(`paramserver.server.merge`: a `ChunkMerge` of the coded pending deltas,
handed to the step as `fill(lo, hi, out)`, which decodes them a piece at a
time), the outer optimizer (`paramserver.server.outer`, applied in place chunk
by chunk by `paramserver.server.chunked_step`: one optimizer for every step
of a run; a step that merges fewer islands than the shard expected is a
smaller share of a round, `weighting.round_share`; sparse topk deltas:
`paramserver.server.sparse_merge`'s per-entry merge and SGD) and the
compressed downlink (`paramserver.server.downlink`: the fragment takes exactly
the update replicas decode, chunk by chunk). Which deltas a step merges, and
the bookkeeping around it (pending set, version, counters), are
`paramserver.server.state`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from paramserver.server.chunked_step import ChunkedStep
from paramserver.server.config import ShardConfig
from paramserver.server.downlink import Downlink, new_residual
from paramserver.server.events import Contribution, PieceGram
from paramserver.server.fragment import FragmentState
from paramserver.server.merge import chunk_merge, scaled
from paramserver.server.outer import FragmentOptimizer, make_outer_optimizer, set_round_share
from paramserver.server.sparse_merge import (
    SPARSE_PUBLISH_ZSTD_LEVEL,
    is_sparse,
    sparse_merge,
    sparse_optimizer,
)
from paramserver.server.tensor_groups import TensorGroups, partials
from paramserver.server.weighting import (
    IslandShare,
    make_weighting,
    merge_coefficients,
    round_share,
)
from paramserver.wire.plan import Fragment


class FragmentStepper:
    """One shard's outer step: weighting, merge, outer optimizer and downlink, per fragment."""

    def __init__(self, cfg: ShardConfig) -> None:
        """Build the step from the cluster settings.

        Args:
            cfg: weighting, merge, outer optimizer and downlink settings.
        """
        self.merge = cfg.merge
        self.weighting = make_weighting(cfg.weighting, cfg.staleness_exponent, cfg.step_rule)
        outer = (cfg.outer_optimizer, cfg.effective_outer_lr, cfg.effective_outer_momentum)
        self.optimizer = FragmentOptimizer(make_outer_optimizer(*outer, cfg.nesterov_delay))
        self.downlink = Downlink(cfg.downlink)
        finish = self.downlink.finish if self.downlink.compressed else None
        self._step = ChunkedStep(self.optimizer.tx, finish=finish)  # the outer step, in place
        self.groups = TensorGroups(cfg.merge)  # rda: a cut tensor's other pieces on this shard
        # sparse (topk) deltas: per-entry merge, SGD without momentum (sparse_merge)
        self._sparse = ChunkedStep(sparse_optimizer(cfg.sparse_outer_lr), finish=finish)
        self._sparse_downlink = Downlink(cfg.downlink, zstd_level=SPARSE_PUBLISH_ZSTD_LEVEL)

    def init(self, params: np.ndarray) -> Any:
        """A fragment's fresh optimizer state, as host buffers the step updates in place.

        Args:
            params: the fragment's values (aligned: chunked_step.host_vector).

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
            outside: rda: the Grams of its cut tensors' other pieces (`tensor_groups`).

        Returns:
            (the islands' shares, the published update's codec frames or None
            for the float32 downlink).
        """
        coefficients, shares = merge_coefficients(self.weighting, merged_in, frag.version, expected)
        sources = [(c.island, scaled(c.delta, c.clip)) for c in merged_in]
        downlink = self.downlink
        if is_sparse(merged_in):  # topk: each entry over the islands that sent it, no momentum
            fill = sparse_merge(sources, coefficients, where.size).fill
            step, opt_state = self._sparse, self._sparse.init(frag.params)
            downlink = self._sparse_downlink  # a mostly-zero update: zstd shrinks its codes
        else:
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
        if not self.downlink.compressed:
            step.step(frag.params, opt_state, fill)
            return shares, None
        if frag.residual is None:
            frag.residual = new_residual(frag.params.shape[0])
        publication = downlink.begin(frag.params, frag.residual)
        step.step(frag.params, opt_state, fill, publication.apply, frag.residual)
        return shares, tuple(publication.frames())
