"""Process 0's decisions, shared with the other processes of a multi-process island.

In an island of several processes (`jax.distributed`) every process runs the
same training loop and calls `Session.step` at the same points, SPMD style.
Process 0 alone talks to the shards; what only it knows reaches the others
through JAX collectives (`broadcast_one_to_all`):

- at the join, the plan, the mode and the global parameters (`share_join`);
- at every step, a small int32 header (stop requested? which fragments got a
  new version, and which?) and then the new values of those fragments
  (`share_updates`), so every process folds the same versions at the same step
  and keeps the same bookkeeping (bases, anchors) as process 0.

When a round's delta is due every process knows it (the push schedule is a
function of the step count), and all take part in `gather`, which brings
parameters sharded over several processes to every host. A one-process
island (`multi` False) runs none of this: each call is a plain return.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from paramserver.client import JoinResult, Update


class LeaderFailed(RuntimeError):
    """Process 0 could not join; the other processes stop with it."""


def _broadcast(tree: Any, source: bool) -> Any:
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(tree, is_source=source)


class LeaderSync:
    """One process's end of the island's decision broadcast (trivial for one process)."""

    def __init__(self, multi: bool, leader: bool) -> None:
        """Args:
        multi: the island spans several processes.
        leader: this is process 0 (the only process when not `multi`).
        """
        self.multi, self.leader = multi, leader
        self.broken = False  # another process is gone: no more collectives

    def _send(self, tree: Any) -> Any:
        return _broadcast(tree, self.leader)

    def share_join(self, joined: JoinResult | None) -> JoinResult:
        """Give every process process 0's join result.

        Args:
            joined: process 0's result; None on process 0 when its join failed
                (the others then raise too), ignored on the others.

        Returns:
            The join result (plan, float32 params by leaf path, versions, mode).

        Raises:
            LeaderFailed: process 0 did not join.
        """
        if not self.multi:
            assert joined is not None
            return joined
        blob = b""
        if self.leader and joined is not None:
            blob = pickle.dumps((joined.plan, joined.versions, joined.mode))
        size = int(np.asarray(self._send(np.array([len(blob)], np.int32)))[0])
        if size == 0:
            raise LeaderFailed("process 0 of the island could not join the cluster")
        raw = np.frombuffer(blob, np.uint8) if self.leader else np.zeros(size, np.uint8)
        plan, versions, mode = pickle.loads(np.asarray(self._send(raw)).tobytes())
        template = {
            leaf.path: (
                joined.params[leaf.path] if self.leader else np.zeros(leaf.shape, np.float32)
            )
            for leaf in plan.leaves
        }
        params = {k: np.asarray(v, np.float32) for k, v in self._send(template).items()}
        return JoinResult(plan=plan, params=params, versions=versions, mode=mode)

    def share_updates(
        self, updates: list[Update], stop: bool, fragment_sizes: list[int]
    ) -> tuple[list[Update], bool]:
        """Give every process the versions process 0 folds at this step, and its stop.

        Args:
            updates: process 0's new versions (ignored on the others).
            stop: process 0's stop request (ignored on the others).
            fragment_sizes: elements per fragment (the plan's).

        Returns:
            (the updates, the stop request), the same on every process.
        """
        if not self.multi:
            return updates, stop
        words = np.zeros(2 + 2 * len(fragment_sizes), np.int32)
        if self.leader:
            words[0], words[1] = int(stop), len(updates)
            for i, u in enumerate(updates):
                words[2 + 2 * i], words[3 + 2 * i] = u.fragment, u.version
        words = np.asarray(self._send(words))
        count = int(words[1])
        if count == 0:
            return [], bool(words[0])
        keys = [(int(words[2 + 2 * i]), int(words[3 + 2 * i])) for i in range(count)]
        values = (
            [np.asarray(u.values, np.float32) for u in updates]
            if self.leader
            else [np.zeros(fragment_sizes[f], np.float32) for f, _ in keys]
        )
        values = [np.asarray(v, np.float32) for v in self._send(values)]
        return [Update(f, v, x) for (f, v), x in zip(keys, values, strict=True)], bool(words[0])

    def gather(self, leaves: list[Any]) -> list[Any]:
        """Leaves every host can read whole (a collective when one spans processes).

        Args:
            leaves: the parameter leaves (jax or numpy arrays).

        Returns:
            The leaves; those sharded over several processes are all-gathered.
        """
        if not self.multi:
            return leaves
        from jax.experimental import multihost_utils

        out = []
        for leaf in leaves:
            spread = not (
                getattr(leaf, "is_fully_addressable", True)
                or getattr(leaf, "is_fully_replicated", True)
            )
            out.append(multihost_utils.process_allgather(leaf, tiled=True) if spread else leaf)
        return out
