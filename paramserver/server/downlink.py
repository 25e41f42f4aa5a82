"""The compressed downlink: what a shard publishes for each outer step, and what it keeps.

This module owns the rule that keeps every replica equal to the shard bit for
bit while the shard publishes int8 instead of float32:

    target    = outer update + residual          (float32)
    frames    = int8 encoding of target          (no codec error feedback:
                                                  the residual here IS the feedback)
    decoded   = what codec.decode(frames) gives  (what every replica decodes; the
                                                  encoder returns it: Codec.encode_decoded)
    params    = params + decoded                 (float32 add, numpy, as a replica does)
    residual  = target - decoded                 (carried into the next update)

The shard applies exactly the decoded update to its own fp32 parameters, so a
replica that adds every published update to the snapshot it started from
holds the same bits. Snapshots stay exact float32. Everything here is a pure
function of its inputs (round-to-nearest encoding), so replaying the log
reproduces the same frames and parameters.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import codec

DOWNLINKS = ("float32", "int8")


class DownlinkError(ValueError):
    """An unknown downlink scheme."""


class Downlink:
    """Encodes outer updates for publishing ("int8"), or does nothing ("float32": full values)."""

    def __init__(self, scheme: str = "float32") -> None:
        """Pick the scheme.

        Args:
            scheme: "float32" (publish the new values, mode "full") or "int8"
                (publish the quantized update, mode "increment").
        """
        if scheme not in DOWNLINKS:
            raise DownlinkError(f"downlink {scheme!r} is unknown; choose one of {DOWNLINKS}")
        self.scheme = scheme
        self._codec = codec.int8() if scheme == "int8" else None

    @property
    def compressed(self) -> bool:
        """Whether updates are published as quantized deltas."""
        return self._codec is not None

    def publish(
        self, params: np.ndarray, update: np.ndarray, residual: np.ndarray
    ) -> tuple[np.ndarray, list[Any], np.ndarray]:
        """Quantize one outer update and apply exactly what replicas will decode.

        Args:
            params: the fragment's current values (1-D float32, not modified).
            update: the outer optimizer's update (new - old before quantization).
            residual: the quantization error carried from the previous update.

        Returns:
            (new params = params + decoded, the codec frames of {"values": target},
            new residual = target - decoded); all float32.
        """
        if self._codec is None:
            raise DownlinkError("the float32 downlink publishes full values, not deltas")
        target = np.add(update, residual, dtype=np.float32)
        frames, _, decoded_tree = self._codec.encode_decoded({"values": target})
        decoded = decoded_tree["values"]
        new_params = np.add(params, decoded, dtype=np.float32)
        new_residual = np.subtract(target, decoded, dtype=np.float32)
        return new_params, frames, new_residual
