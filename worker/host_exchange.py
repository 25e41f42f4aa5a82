"""The island exchange on the host (`exchange="host"`): parameters to numpy and back.

`HostExchange` keeps each fragment's `worker.exchange.FragmentSync` (base and
anchor as numpy vectors) and the codec's error-feedback state. A step that
pushes or folds copies the parameters to the host once (gathered over the
processes of a multi-process island), takes each due fragment's delta and
encodes it with the numpy codec, folds published versions with
`FragmentSync.adopt` and places the whole tree back on the devices. It is the
fallback of `worker.device_exchange` (codecs other than int8/int4, parameters
held as numpy arrays) and the baseline the device path is measured against.
`DeviceExchange` has the same methods (`refund`: a push the shards finally
refused goes back into the error feedback, `codec.refund` here).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import codec
from paramserver.client import Update
from worker.exchange import FragmentSync
from worker.leader_sync import LeaderSync
from worker.param_tree import TreeLayout


def _placed_bytes(leaves: Sequence[Any]) -> int:
    return sum(
        shard.data.nbytes for leaf in leaves for shard in getattr(leaf, "addressable_shards", ())
    )


class TakenHostDelta:
    """Deltas taken on the host; `frames` encodes them (any thread, once, in take order)."""

    def __init__(self, deltas: dict[int, np.ndarray], encode: Any) -> None:
        self.deltas, self._encode = deltas, encode

    def frames(self) -> dict[int, list]:
        """fragment -> codec frames ({} on processes other than 0)."""
        return {i: self._encode(i, d) for i, d in self.deltas.items()}


class HostExchange:
    """Bases, anchors and residuals as numpy vectors per fragment; numpy delta, codec and fold."""

    def __init__(
        self,
        layout: TreeLayout,
        plan: Any,
        flat: dict[str, np.ndarray],
        versions: dict[int, int],
        *,
        delta_codec: codec.Codec,
        rule: str,
        leader_sync: LeaderSync,
    ) -> None:
        """Start every fragment at the joined values.

        Args:
            layout: the session's tree layout.
            plan: the cluster's plan (`JoinResult.plan`).
            flat: the joined float32 values by leaf name.
            versions: the joined version of each fragment.
            delta_codec: the codec of the pushed deltas.
            rule: the merge rule.
            leader_sync: the island's processes' decision broadcast (gathers spread leaves).
        """
        self.layout, self.plan, self.rule, self.leader_sync = layout, plan, rule, leader_sync
        self.codec = delta_codec
        self.syncs = {
            frag.index: FragmentSync.start(plan.gather(flat, frag.index), versions[frag.index])
            for frag in plan.fragments
        }
        self.ef_state = {
            frag.index: delta_codec.init({"delta": np.zeros(frag.size, np.float32)})
            for frag in plan.fragments
        }
        self.host_device_bytes = 0
        self._ef_lock = (
            threading.Lock()
        )  # `refund` (the step's thread) against encodes (a pusher's)
        self._host: dict[str, np.ndarray] | None = None  # this step's host copy
        self._joined: dict[str, np.ndarray] | None = flat  # until initial_params

    @property
    def versions(self) -> dict[int, int]:
        """The adopted version of each fragment."""
        return {index: sync.base_version for index, sync in self.syncs.items()}

    def _place(self, flat: dict[str, np.ndarray]) -> Any:
        tree = self.layout.build(flat)
        self.host_device_bytes += _placed_bytes(jax.tree_util.tree_leaves(tree))
        return tree

    def initial_params(self) -> Any:
        """The session's first parameters: the joined values placed like the user's leaves."""
        flat, self._joined = self._joined, None
        assert flat is not None, "initial_params is called once"
        return self._place(flat)

    def _host_copy(self, leaves: list[Any]) -> dict[str, np.ndarray]:
        if self._host is None:
            self._host = self.layout.to_host(self.leader_sync.gather(leaves))
            self.host_device_bytes += sum(
                leaf.nbytes for leaf in leaves if isinstance(leaf, jax.Array)
            )
        return self._host

    def encode(self, leaves: list[Any], fragments: Sequence[int], leader: bool) -> dict[int, list]:
        """`take` and its frames at once (the synchronous exchange)."""
        return self.take(leaves, fragments, leader).frames()

    def take(self, leaves: list[Any], fragments: Sequence[int], leader: bool) -> TakenHostDelta:
        """Take each due fragment's delta (moving its anchor); encode it later (process 0 only).

        The host copy and the deltas are taken now; the codec's encode (its error
        feedback in order, under the exchange's lock) runs when `frames` is called.

        Args:
            leaves: the current parameter leaves (layout order).
            fragments: the due fragments.
            leader: this process encodes; the others only move their anchors.

        Returns:
            The taken delta; its `frames()` are fragment -> codec frames ({} elsewhere).
        """
        host = self._host_copy(leaves)
        deltas = {i: self.syncs[i].take(self.plan.gather(host, i)) for i in fragments}
        return TakenHostDelta(deltas if leader else {}, self._encode_one)

    def _encode_one(self, index: int, delta: np.ndarray) -> list:
        with self._ef_lock:
            frames, self.ef_state[index] = self.codec.encode({"delta": delta}, self.ef_state[index])
        return frames

    def refund(self, fragment: int, values: np.ndarray) -> None:
        """Put a refused push's values back into the fragment's error feedback (process 0).

        The shards never applied them, so the next push of the fragment sends
        them again (`codec.refund`) instead of the mass being lost.

        Args:
            fragment: the pushed fragment.
            values: the decoded delta that push carried (`codec.decode(frames)["delta"]`).
        """
        with self._ef_lock:
            self.ef_state[fragment] = codec.refund(self.ef_state[fragment], {"delta": values})

    def fold(self, leaves: list[Any], updates: Sequence[Update]) -> list[Any]:
        """Adopt new global versions on the host and place the tree back; returns its leaves."""
        host = self._host_copy(leaves)
        for update in updates:
            sync = self.syncs[update.fragment]
            current = self.plan.gather(host, update.fragment)
            new_local = sync.adopt(current, update.values, update.version, self.rule)
            self.plan.scatter(update.fragment, new_local, host)
        return jax.tree_util.tree_leaves(self._place(host))

    def end_step(self) -> None:
        """Forget this step's host copy."""
        self._host = None

    def wait(self) -> None:
        """Nothing runs in the background here."""

    def base_values(self) -> dict[str, np.ndarray]:
        """The adopted global values of every leaf (host arrays).

        Returns:
            name -> float32 array of the leaf's shape.
        """
        flat = {
            n: np.empty(s, np.float32)
            for n, s in zip(self.layout.names, self.layout.shapes, strict=True)
        }
        for index, sync in self.syncs.items():  # the fragments cover every element
            self.plan.scatter(index, sync.base, flat)
        return flat
