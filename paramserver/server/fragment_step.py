"""The outer step of one fragment: weigh the pending deltas, merge them, step the outer optimizer.

This module owns the arithmetic of a step, given the deltas it merges: the
islands' shares (`paramserver.server.weighting`), the merged delta
(`paramserver.server.merge`, handed to the step as `fill(lo, hi, out)`:
`merge_fill`), the outer optimizer (`paramserver.server.outer`, applied in
place chunk by chunk by `paramserver.server.chunked_step`; a plain SGD step
when one island's work is merged alone and `single_island_outer_lr` is set)
and the compressed downlink (`paramserver.server.downlink`: the fragment takes
exactly the update replicas decode, chunk by chunk). Which deltas a step
merges, and the bookkeeping around it (pending set, version, counters), are
`paramserver.server.state`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import optax

from paramserver.server.chunked_step import ChunkedStep, Fill
from paramserver.server.config import ShardConfig
from paramserver.server.downlink import Downlink, new_residual
from paramserver.server.events import Contribution
from paramserver.server.fragment import FragmentState
from paramserver.server.merge import merge_pending
from paramserver.server.outer import FragmentOptimizer, make_outer_optimizer
from paramserver.server.weighting import IslandShare, island_shares, make_weighting
from paramserver.wire.plan import Fragment


def merge_fill(
    rule: str,
    deltas: Sequence[tuple[str, np.ndarray]],
    coefficients: Mapping[str, float],
    fragment: Fragment,
) -> Fill:
    """The merged delta of a step as `fill(lo, hi, out)`, from decoded float32 deltas.

    The weighted mean is elementwise, so each chunk is merged from the deltas'
    slices (no full-size buffer); RDA needs whole segments, so it is merged
    once into a fresh buffer that the chunks are copied from.

    Args:
        rule: "mean" or "rda" (`paramserver.server.merge`).
        deltas: (island, delta) of every pending delta the step merges.
        coefficients: island -> c_i.
        fragment: the plan fragment.

    Returns:
        fill(lo, hi, out): writes the merged elements [lo, hi) into out (float32).
    """
    if rule == "mean":

        def fill(lo: int, hi: int, out: np.ndarray) -> None:
            merge_pending(rule, [(i, d[lo:hi]) for i, d in deltas], coefficients, fragment, out)

        return fill
    whole = merge_pending(rule, deltas, coefficients, fragment)

    def copy(lo: int, hi: int, out: np.ndarray) -> None:
        out[...] = whole[lo:hi]

    return copy


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
        self.downlink = Downlink(cfg.downlink)
        finish = self.downlink.finish if self.downlink.compressed else None
        self._step = ChunkedStep(self.optimizer.tx, finish=finish)  # the outer step, in place
        # a step that merges one island's work when the quorum collapsed: plain SGD
        lr = cfg.single_island_outer_lr
        self._single = ChunkedStep(optax.sgd(lr), finish=finish) if lr else None

    def init(self, params: np.ndarray) -> Any:
        """A fragment's fresh optimizer state, as host buffers the step updates in place.

        Args:
            params: the fragment's values (aligned: chunked_step.host_vector).

        Returns:
            The optax state with numpy leaves.
        """
        return self._step.init(params)

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
        coefficients = {x.island: x.coefficient for x in shares}
        fill = merge_fill(self.merge, [(c.island, c.delta) for c in merged_in], coefficients, where)
        if self._single is not None and len(shares) == 1:
            step, opt_state = self._single, self._single.init(frag.params)
        else:
            step, opt_state = self._step, frag.opt_state
        if not self.downlink.compressed:
            step.step(frag.params, opt_state, fill)
            return shares, None
        if frag.residual is None:
            frag.residual = new_residual(frag.params.shape[0])
        publication = self.downlink.begin(frag.params, frag.residual)
        step.step(frag.params, opt_state, fill, publication.apply, frag.residual)
        return shares, tuple(publication.frames())
