"""Process 0's decisions, shared with the other processes of a multi-process island.

In an island of several processes (`jax.distributed`) every process runs the
same training loop and calls `Session.step` at the same points, SPMD style.
Process 0 alone talks to the shards; what only it knows reaches the others
through JAX collectives (`broadcast_one_to_all`):

- at the join, the plan, the mode and the global parameters (`share_join`);
- at every step, a small int32 header (stop requested? which fragments got a
  new version, and which? as codes or as values?) and then the new values of
  those fragments, or with a device exchange the int8 increment's codes and
  scales when the island holds the version before (`share_updates`), so every
  process folds the same versions at the same step and keeps the same
  bookkeeping (bases, anchors) as process 0.

When a round's delta is due every process knows it (the push schedule is a
function of the step count), and all take part in `gather`, which brings
parameters sharded over several processes to every host. A one-process
island (`multi` False) runs none of this: each call is a plain return.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from codec.coded import Coded, code_dtype
from paramserver.client import JoinResult, Update

SCHEMES = {127: "int8", 7: "int4"}  # quantization levels -> codec scheme


def travelling_codes(
    updates: list[Update], coded_after: dict[int, int] | None
) -> list[Coded | None]:
    """Which updates travel as their increment's codes instead of their full values.

    Args:
        updates: process 0's updates in order; a fragment may have several (a chain).
        coded_after: fragment -> the version the island holds (a device exchange), or
            None: every update travels as its values.

    Returns:
        Per update, its int8/int4 increment when it follows the version the island holds
        by then (the one before it in the list, or `coded_after`'s), else None.
    """
    out: list[Coded | None] = []
    held = None if coded_after is None else dict(coded_after)
    for u in updates:
        coded = u.increment
        follows = held is not None and held.get(u.fragment) == u.version - 1
        out.append(
            coded if follows and coded is not None and coded.scheme in SCHEMES.values() else None
        )
        if held is not None:
            held[u.fragment] = u.version
    return out


def _empty_like(size: int, levels: int, block: int) -> tuple[np.ndarray, ...]:
    """Buffers of the shapes process 0 broadcasts for one update (full values or codes)."""
    if not levels:
        return (np.zeros(size, np.float32),)
    scheme = SCHEMES[levels]
    codes = size if scheme == "int8" else (size + 1) // 2
    return np.zeros(codes, code_dtype(scheme)), np.zeros(-(-size // block), np.float32)


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
        self,
        updates: list[Update],
        stop: bool,
        fragment_sizes: list[int],
        coded_after: dict[int, int] | None = None,
    ) -> tuple[list[Update], bool]:
        """Give every process the versions process 0 folds at this step, and its stop.

        Args:
            updates: process 0's new versions (ignored on the others), in order; a fragment
                may have several (a client that keeps increments hands out every version).
            stop: process 0's stop request (ignored on the others).
            fragment_sizes: elements per fragment (the plan's).
            coded_after: fragment -> the version the island holds, when an update's
                increment that follows it should travel as its codes and scales instead
                of its full values (a device exchange); None: always the full values.

        Returns:
            (the updates, the stop request), the same on every process; an update
            shared as codes has `increment` set and, on the processes other than 0,
            empty `values`.
        """
        if not self.multi:
            return updates, stop
        travelling = travelling_codes(updates, coded_after) if self.leader else []
        slots = len(fragment_sizes)  # one update a fragment in the first broadcast
        words = np.zeros(2 + 4 * slots, np.int32)
        keys_out = np.zeros((len(updates), 4), np.int32)
        for i, (u, coded) in enumerate(zip(updates, travelling, strict=True)):
            keys_out[i] = (
                u.fragment,
                u.version,
                coded.levels if coded else 0,
                coded.block if coded else 0,
            )
        if self.leader:
            words[0], words[1] = int(stop), len(updates)
            first = keys_out[:slots].reshape(-1)
            words[2 : 2 + first.size] = first
        words = np.asarray(self._send(words))
        count = int(words[1])
        if count == 0:
            return [], bool(words[0])
        keys = [
            tuple(int(w) for w in words[2 + 4 * i : 6 + 4 * i]) for i in range(min(count, slots))
        ]
        if count > slots:  # more versions than fragments (a chain): the rest in a second one
            rest = keys_out[slots:] if self.leader else np.zeros((count - slots, 4), np.int32)
            keys += [tuple(int(w) for w in row) for row in np.asarray(self._send(rest))]
        if self.leader:
            arrays = [
                (coded.codes, coded.scales) if coded else (np.asarray(u.values, np.float32),)
                for u, coded in zip(updates, travelling, strict=True)
            ]
        else:
            arrays = [_empty_like(fragment_sizes[f], levels, block) for f, _, levels, block in keys]
        arrays = [tuple(np.asarray(a) for a in group) for group in self._send(arrays)]
        shared = []
        for (f, version, levels, block), group in zip(keys, arrays, strict=True):
            if not levels:
                shared.append(Update(f, version, group[0].astype(np.float32, copy=False)))
                continue
            coded = Coded(SCHEMES[levels], block, fragment_sizes[f], group[0], group[1])
            values = updates[len(shared)].values if self.leader else np.zeros(0, np.float32)
            shared.append(Update(f, version, values, coded))
        return shared, bool(words[0])

    def share_refused(
        self, refused: list[tuple[int, np.ndarray]], sizes: list[int]
    ) -> list[tuple[int, np.ndarray]]:
        """Process 0's refused pushes, on every process (a few broadcasts when `multi`).

        Args:
            refused: (fragment, decoded delta) per refused push (process 0's; others pass []).
            sizes: each fragment's size.

        Returns:
            Process 0's list, on every process.
        """
        if not self.multi:
            return refused
        count = int(self._send(np.int32(len(refused) if self.leader else 0)))
        if not count:
            return []
        mine = [f for f, _ in refused] if self.leader else [0] * count
        fragments = [int(f) for f in np.asarray(self._send(np.asarray(mine, np.int32)))]
        out = []
        for k, fragment in enumerate(fragments):
            values = refused[k][1] if self.leader else np.zeros(sizes[fragment], np.float32)
            out.append((fragment, np.asarray(self._send(np.asarray(values, np.float32)))))
        return out

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
