"""The outer step in one compiled pass per chunk: merge fill, Nesterov, int8 downlink, apply.

The default step of a shard (`outer.round_nesterov` with the int8 or float32
downlink) done by numba loops instead of the jitted `fragment_step.ChunkedStep`:
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

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from codec.quant import TINY, max_factor, step_factor
from paramserver.server.step.downlink import DownlinkError, Int8Publication
from paramserver.server.step.outer import ROUND_TOL, RoundNesterovState, aligned_float32

CHUNK = 1 << 18  # elements per fill and kernel call: 1 MiB of merged float32 (L2 or L3)

Fill = Callable[[int, int, np.ndarray], None]


def _kernels() -> Any:
    """`fused_kernels` (numba), or None where numba cannot be imported."""
    try:
        from paramserver.server.step import fused_kernels
    except ImportError:
        return None
    return fused_kernels


class FusedNesterov:
    """`round_nesterov(lr, momentum)` stepped in place by compiled loops (see the module)."""

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
            True for a RoundNesterovState and a block that divides the chunk.
        """
        return isinstance(state, RoundNesterovState) and (block == 0 or self.chunk % block == 0)

    def step(
        self,
        params: np.ndarray,
        state: RoundNesterovState,
        fill: Fill,
        publication: Int8Publication | None = None,
    ) -> None:
        """One outer step of a fragment, in place, chunk by chunk.

        Args:
            params: the fragment's aligned float32 values (updated in place).
            state: its RoundNesterovState with numpy leaves (updated in place).
            fill: `fill(lo, hi, out)` writes the merged delta's [lo, hi) into `out`.
            publication: the int8 downlink's message (codes and scales written
                into it, params and its residual updated); None: params += update.

        Raises:
            DownlinkError: the update is not finite (the chunks before stay applied,
                as with the jitted step, and so do this chunk's other blocks).
        """
        n = params.shape[0]
        phase, share = np.float32(state.phase), np.float32(state.share)
        fresh = bool(phase <= 0)
        phase = np.float32(phase + share)
        due = bool(phase >= np.float32(1 - ROUND_TOL))
        mom = state.momentum
        k = self.kernels
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
                k.nesterov_apply(merged, lo, params, mom, self.neg_lr, self.beta, fresh, due)
                continue
            bad = k.nesterov_int8(
                merged, lo, params, mom, residual,
                publication.codes_out(lo, hi), publication.scales_out(lo, hi), self._buf,
                self.neg_lr, self.beta, fresh, due, block, tiny, inv_max, step,
            )  # fmt: skip
            if bad >= 0:
                raise DownlinkError(f"outer update of elements [{lo}, {hi}) is not finite")
            publication.written(lo, hi)
        np.copyto(state.phase, np.float32(0) if due else phase)
