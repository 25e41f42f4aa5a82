"""The island exchange on the island's own devices: only codes and scales cross to the host.

`DeviceExchange` keeps, per parameter leaf and with that leaf's own sharding,
the float32 anchor (values already accounted for), base (the global values
adopted) and error-feedback residual of `worker.exchange`'s rule, as JAX
arrays. A push runs one jitted function over the due fragments' leaves:
``delta = anchor - local``, error-feedback int8/int4 quantization
(`worker.device_quant`, bit-equal to the numpy codec), the anchor moved to
the local values; only the codes and block scales come back to the host,
where `codec.prequantized` frames them (zstd there when the codec has it) into
the very frames `Codec.encode` would write. A published version folds in on
the devices too: an int8 increment that follows the adopted version crosses
as its codes and is dequantized and added to the base there (as a replica
adds it), otherwise the full values cross; then keep-progress (``local = G +
(local - anchor)``) or overwrite, and ``base = anchor = G``. Anchor, base and
residual buffers are donated to each call, so they are updated in place.

Every process of a multi-process island runs the same calls (SPMD); codes and
scales come out replicated, so process 0 reads them from its own devices and
only they travel between processes. Nothing here names a device type.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from codec.prequantized import Coded, frame_codes
from paramserver.client import Update
from paramserver.wire.plan import Plan
from worker.device_quant import dequantize, quantize
from worker.param_tree import TreeLayout

LEVELS = {"int8": 127, "int4": 7}

Piece = tuple[int, int, int]  # (leaf index, start, stop) of a fragment's flat range in one leaf


def placed_bytes(array: jax.Array) -> int:
    """Bytes of an array's shards on this process's devices (what a host-to-device copy moved)."""
    return sum(shard.data.nbytes for shard in array.addressable_shards)


def _flat_pieces(flats: dict[int, jax.Array], pieces: Sequence[Piece]) -> jax.Array:
    parts = [flats[i][a:b] for i, a, b in pieces]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _write(flats: dict[int, jax.Array], pieces: Sequence[Piece], values: jax.Array) -> None:
    offset = 0
    for i, a, b in pieces:
        part = values[offset : offset + b - a].astype(flats[i].dtype)
        flats[i] = jax.lax.dynamic_update_slice(flats[i], part, (a,))
        offset += b - a


class DeviceExchange:
    """Anchors, bases and residuals of every fragment, on the devices; push and fold there."""

    def __init__(
        self,
        layout: TreeLayout,
        plan: Plan,
        flat: dict[str, np.ndarray],
        versions: dict[int, int],
        *,
        scheme: str,
        block: int,
        zstd_level: int | None,
        rule: str,
    ) -> None:
        """Place the joined global values as anchor and base of every leaf.

        Args:
            layout: the session's tree layout (every leaf a `jax.Array`: its sharding is used).
            plan: the cluster's plan.
            flat: the joined float32 values by leaf name.
            versions: the joined version of each fragment.
            scheme: "int8" or "int4" (the delta codec).
            block: its block size.
            zstd_level: its zstd level (None: frames sent uncompressed).
            rule: the merge rule ("keep-progress" or "overwrite").
        """
        self.layout, self.plan, self.rule = layout, plan, rule
        self.scheme, self.levels, self.block, self.zstd_level = (
            scheme, LEVELS[scheme], block, zstd_level,
        )  # fmt: skip
        self.versions = dict(versions)
        self.host_device_bytes = 0
        index = {name: i for i, name in enumerate(layout.names)}
        self.pieces: dict[int, tuple[Piece, ...]] = {
            frag.index: tuple((index[s.path], s.start, s.stop) for s in frag.slices)
            for frag in plan.fragments
        }
        self.shardings = layout.shardings
        devices = sorted(layout.shardings[0].device_set, key=lambda d: d.id)
        self.replicated = NamedSharding(Mesh(np.array(devices), ("all",)), PartitionSpec())
        self.anchor = [
            self._put(flat[name], s) for name, s in zip(layout.names, self.shardings, strict=True)
        ]
        copy = jax.jit(jnp.copy, out_shardings=None)
        self.base = [copy(a) for a in self.anchor]
        self.residual = [
            jax.jit(lambda shape=shape: jnp.zeros(shape, jnp.float32), out_shardings=s)()
            for shape, s in zip(layout.shapes, self.shardings, strict=True)
        ]
        self._pushes: dict[tuple[int, ...], Callable] = {}
        self._folds: dict[tuple, Callable] = {}

    def _put(self, host: np.ndarray, sharding: Any) -> jax.Array:
        host = np.ascontiguousarray(host)
        if sharding.is_fully_addressable:
            out = jax.device_put(host, sharding)
        else:  # every process passes the same values
            out = jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])
        self.host_device_bytes += placed_bytes(out)
        return out

    def _get(self, array: jax.Array) -> np.ndarray:
        host = np.asarray(array.addressable_data(0))  # replicated: one copy is the whole
        self.host_device_bytes += host.nbytes
        return host

    def initial_params(self) -> Any:
        """The session's first parameters: the anchors cast to each leaf's dtype, on the devices.

        Returns:
            The tree of the session's layout.
        """
        cast = [
            jax.jit(lambda a, d=dtype: a.astype(d), out_shardings=s)(a)
            for a, dtype, s in zip(self.anchor, self.layout.dtypes, self.shardings, strict=True)
        ]
        return jax.tree_util.tree_unflatten(self.layout.treedef, cast)

    def end_step(self) -> None:
        """Nothing to forget (the host keeps no copy)."""

    def _leaves_of(self, fragments: Sequence[int]) -> list[int]:
        return sorted({i for f in fragments for i, _, _ in self.pieces[f]})

    # -- push ------------------------------------------------------------------------

    def encode(self, leaves: list[Any], fragments: Sequence[int], leader: bool) -> dict[int, list]:
        """Take each fragment's delta since its anchor, quantize it with error feedback, frame it.

        Every process calls it (the anchors and residuals move everywhere).

        Args:
            leaves: the current parameter leaves (layout order).
            fragments: the due fragments.
            leader: this process frames the codes (process 0); the others get {}.

        Returns:
            fragment -> codec frames (`Codec.encode`'s for the same delta and state).
        """
        key = tuple(sorted(fragments))
        used = self._leaves_of(key)
        fn = self._pushes.get(key) or self._pushes.setdefault(key, self._push_fn(key, used))
        anchor, residual, codes, scales = fn(
            [leaves[i] for i in used], [self.anchor[i] for i in used],
            [self.residual[i] for i in used],
        )  # fmt: skip
        for j, i in enumerate(used):
            self.anchor[i], self.residual[i] = anchor[j], residual[j]
        if not leader:
            return {}
        return {
            f: frame_codes(
                self.scheme,
                self.block,
                self.zstd_level,
                self._get(c),
                self._get(s),
                self.plan.fragments[f].size,
            )  # fmt: skip
            for f, c, s in zip(key, codes, scales, strict=True)
        }

    def _push_fn(self, fragments: tuple[int, ...], used: list[int]) -> Callable:
        shapes = [self.layout.shapes[i] for i in used]
        levels, block = self.levels, self.block

        def push(local, anchor, residual):
            lf = {i: x.astype(jnp.float32).reshape(-1) for i, x in zip(used, local, strict=True)}
            af = {i: x.reshape(-1) for i, x in zip(used, anchor, strict=True)}
            rf = {i: x.reshape(-1) for i, x in zip(used, residual, strict=True)}
            codes, scales = [], []
            for f in fragments:
                pieces = self.pieces[f]
                delta = _flat_pieces(af, pieces) - _flat_pieces(lf, pieces)
                c, s, r = quantize(delta + _flat_pieces(rf, pieces), levels, block)
                codes.append(c)
                scales.append(s)
                _write(rf, pieces, r)
                _write(af, pieces, _flat_pieces(lf, pieces))
            return (
                [af[i].reshape(shape) for i, shape in zip(used, shapes, strict=True)],
                [rf[i].reshape(shape) for i, shape in zip(used, shapes, strict=True)],
                codes,
                scales,
            )

        state = [self.shardings[i] for i in used]
        rep = [self.replicated] * len(fragments)
        return jax.jit(push, donate_argnums=(1, 2), out_shardings=(state, state, rep, rep))

    # -- fold ------------------------------------------------------------------------

    def usable_increment(self, update: Update) -> Coded | None:
        """The update's increment codes when they apply to the adopted version, else None."""
        coded = getattr(update, "increment", None)
        if coded is None or self.versions[update.fragment] != update.version - 1:
            return None
        return coded

    def fold(self, leaves: list[Any], updates: Sequence[Update]) -> list[Any]:
        """Adopt new global versions on the devices; returns the new leaves.

        Args:
            leaves: the current parameter leaves (layout order).
            updates: newer versions (one per fragment), with their increment codes when
                the island holds the version before (then only the codes cross).

        Returns:
            The leaves after the fold (untouched leaves are the same objects).
        """
        key, incoming = [], []
        for u in sorted(updates, key=lambda u: u.fragment):
            coded = self.usable_increment(u)
            if coded is not None:
                key.append((u.fragment, coded.scheme, coded.block))
                incoming.append(
                    (
                        self._put(coded.codes, self.replicated),
                        self._put(coded.scales, self.replicated),
                    )
                )
            else:
                key.append((u.fragment, "full", 0))
                incoming.append((self._put(np.asarray(u.values, np.float32), self.replicated),))
        key = tuple(key)
        used = self._leaves_of([f for f, _, _ in key])
        fn = self._folds.get(key) or self._folds.setdefault(key, self._fold_fn(key, used))
        local, anchor, base = fn(
            [leaves[i] for i in used], [self.anchor[i] for i in used],
            [self.base[i] for i in used], incoming,
        )  # fmt: skip
        out = list(leaves)
        for j, i in enumerate(used):
            out[i], self.anchor[i], self.base[i] = local[j], anchor[j], base[j]
        for u in updates:
            self.versions[u.fragment] = u.version
        return out

    def _fold_fn(self, key: tuple, used: list[int]) -> Callable:
        shapes = [self.layout.shapes[i] for i in used]
        keep = self.rule == "keep-progress"

        def fold(local, anchor, base, incoming):
            lf = {i: x.reshape(-1) for i, x in zip(used, local, strict=True)}
            af = {i: x.reshape(-1) for i, x in zip(used, anchor, strict=True)}
            bf = {i: x.reshape(-1) for i, x in zip(used, base, strict=True)}
            for (f, scheme, block), inc in zip(key, incoming, strict=True):
                pieces = self.pieces[f]
                if scheme == "full":
                    new_global = inc[0]
                else:
                    size = self.plan.fragments[f].size
                    step = dequantize(inc[0], inc[1], size, LEVELS[scheme], block)
                    new_global = _flat_pieces(bf, pieces) + step
                new_local = new_global
                if keep:
                    progress = _flat_pieces(lf, pieces).astype(jnp.float32) - _flat_pieces(
                        af, pieces
                    )
                    new_local = new_global + progress
                _write(lf, pieces, new_local)  # cast to each leaf's dtype
                _write(af, pieces, new_global)
                _write(bf, pieces, new_global)
            return (
                [lf[i].reshape(s) for i, s in zip(used, shapes, strict=True)],
                [af[i].reshape(s) for i, s in zip(used, shapes, strict=True)],
                [bf[i].reshape(s) for i, s in zip(used, shapes, strict=True)],
            )

        state = [self.shardings[i] for i in used]
        return jax.jit(fold, donate_argnums=(1, 2), out_shardings=(state, state, state))

    # -- what the session reads ------------------------------------------------------

    def base_values(self) -> dict[str, np.ndarray]:
        """The adopted global values of every leaf, on the host (a device-to-host copy).

        Returns:
            name -> float32 array of the leaf's shape.
        """
        out = {}
        for name, array in zip(self.layout.names, self.base, strict=True):
            if not array.is_fully_addressable:
                from jax.experimental import multihost_utils

                array = multihost_utils.process_allgather(array, tiled=True)
            host = np.array(array, np.float32)
            self.host_device_bytes += host.nbytes
            out[name] = host
        return out
