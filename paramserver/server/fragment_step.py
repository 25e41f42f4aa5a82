"""The outer step of one fragment: weigh the pending deltas, merge them, step the outer optimizer.

This module owns the arithmetic of a step, given the deltas it merges: the
islands' shares (`paramserver.server.weighting`), the merged delta
(`paramserver.server.merge`: a `ChunkMerge` of the coded pending deltas,
filled into a reused buffer), the outer optimizer
(`paramserver.server.outer`; a plain SGD step when one island's work is
merged alone and `single_island_outer_lr` is set) and the compressed
downlink (`paramserver.server.downlink`: the fragment takes exactly the
update replicas decode). Which deltas a step merges, and the bookkeeping
around it (pending set, version, counters), are `paramserver.server.state`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax

from paramserver.server.config import ShardConfig
from paramserver.server.downlink import Downlink
from paramserver.server.events import Contribution
from paramserver.server.fragment import FragmentState
from paramserver.server.merge import chunk_merge, scaled
from paramserver.server.outer import (
    DonatingStep,
    FragmentOptimizer,
    aligned_float32,
    make_outer_optimizer,
)
from paramserver.server.weighting import IslandShare, island_shares, make_weighting
from paramserver.wire.plan import Fragment


class FragmentStepper:
    """One shard's outer step: weighting, merge, outer optimizer and downlink, per fragment."""

    def __init__(self, cfg: ShardConfig) -> None:
        """Build the step from the cluster settings.

        Args:
            cfg: weighting, merge, outer optimizer and downlink settings.
        """
        self.merge = cfg.merge
        self.weighting = make_weighting(cfg.weighting, cfg.staleness_exponent)
        outer = (cfg.outer_optimizer, cfg.effective_outer_lr, cfg.effective_outer_momentum)
        self.optimizer = FragmentOptimizer(make_outer_optimizer(*outer, cfg.nesterov_delay))
        self._step = self.optimizer.donating  # the one outer step (paramserver.server.outer)
        # a step that merges one island's work when the quorum collapsed: plain SGD
        self._single = DonatingStep(optax.sgd(lr)) if (lr := cfg.single_island_outer_lr) else None
        self.downlink = Downlink(cfg.downlink)
        self._merge_buffers: dict[int, np.ndarray] = {}

    def step(
        self, frag: FragmentState, merged_in: Sequence[Contribution], where: Fragment
    ) -> tuple[list[IslandShare], tuple[Any, ...] | None]:
        """Merge `merged_in` into `frag` and take one outer step (params, opt_state, residual).

        Args:
            frag: the fragment's state (changed in place; version and pending are not).
            merged_in: the pending deltas this step merges (at least one).
            where: the fragment in the plan (its leaves, for per-tensor merges).

        Returns:
            (the islands' shares, the published update's codec frames or None
            for the float32 downlink).
        """
        shares = island_shares(self.weighting, merged_in, frag.version)
        if where.index not in self._merge_buffers:  # reused: no fresh pages per step
            self._merge_buffers[where.index] = aligned_float32(frag.params.shape[0])
        fill = chunk_merge(
            self.merge,
            [(c.island, scaled(c.delta, c.clip)) for c in merged_in],
            {x.island: x.coefficient for x in shares},
            where,
        )  # decodes the coded pending deltas a piece at a time
        merged = fill.whole(self._merge_buffers[where.index])
        frames = None
        if self._single is not None and len(shares) == 1:
            step, opt_state = self._single, self._single.tx.init(frag.params)
        else:
            step, opt_state = self._step, frag.opt_state
        if self.downlink.compressed:
            updates, opt_state = step.updates(frag.params, opt_state, merged)
            if frag.residual is None:
                frag.residual = np.zeros(frag.params.shape[0], np.float32)
            new_params, encoded, frag.residual = self.downlink.publish(
                np.asarray(frag.params), np.asarray(updates), frag.residual
            )
            frag.params = jnp.asarray(new_params)
            frames = tuple(encoded)
        else:
            frag.params, opt_state = step(frag.params, opt_state, merged)
        if step is self._step:
            frag.opt_state = opt_state
        return shares, frames
