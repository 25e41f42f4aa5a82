"""The island exchange on the island's own devices: only codes and scales cross to the host.

`DeviceExchange` keeps the float32 anchor (values already accounted for),
base (the global values adopted) and error-feedback residual of
`worker.exchange`'s rule as JAX arrays on the island's devices, each one flat
vector in the plan's order with every fragment padded to whole blocks
(`FlatLayout`, below), spread evenly over the island's devices. A push runs one
jitted function over the due fragments: the parameters into that layout
(one fused gather), ``delta = anchor - local`` (`worker.exchange.delta_since`),
error-feedback int8/int4 quantization of every due block at once
(`worker.device_quant`, the codec's JAX formulation, bit-equal to the numpy
codec), the anchor moved to the local values; only the codes and
block scales come back to the host, where `codec.decode` frames them
(zstd there when the codec has it) into the very frames `Codec.encode` would
write. A published version folds in on the devices too: an int8 increment
that follows the adopted version crosses as its codes and is dequantized and
added to the base there (as a replica adds it), otherwise the full values
cross; then keep-progress (``local = G + (local - anchor)``) or overwrite
(`worker.exchange.folded`), and ``base = anchor = G``; the touched leaves come
back in their own shardings and dtypes. State buffers are donated to each call
(updated in place).

Why one flat vector and not per-leaf arrays with the leaves' shardings: the
blocks of a fragment span leaves, so per-leaf state needed a concatenation
and a scatter per fragment and XLA kept copies of every leaf (measured at
the `base` preset on CPU: 243 ms a push against 15 ms for a copy of the
parameters). In the padded layout any set of fragments is block-aligned, so
a push is one gather, one reduction and one elementwise pass. `FlatLayout`
knows where every fragment and every leaf piece sits (each fragment padded
with zeros to whole quantization blocks, the whole to a multiple of block x
devices) and builds the traced gathers between parameter leaves and the flat
vector. XLA's CPU backend runs a many-operand concatenation fused into an
elementwise consumer element by element, so `assemble` returns the regions'
own vector when they are all the fragments.

Every process of a multi-process island runs the same calls (SPMD); codes and
scales come out replicated, so process 0 reads them from its own devices and
only they travel between processes. Nothing here names a device type.

One compiled function per set of fragments would be 2^P - 1 pushes and more
folds, each compiled (or read from the cache) the first time its set comes
up; sets other than all fragments come up when pushes are skipped or updates
arrive apart, i.e. under faults: a chaos run's islands compiled ~35 of them
mid-run, a third of a second each. So a push of some but not all fragments,
and a fold that is not the whole increment one, run as one call per
fragment: P + 1 pushes, the whole fold and two folds per fragment (codes or
values), with the same results (every step is per element or per block).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from codec.coded import Coded, code_dtype, frame_codes
from codec.format import LEVELS, layout
from paramserver.client import Update
from worker.device_quant import dequantize, quantize
from worker.exchange import UnfoldableUpdate, delta_since, folded
from worker.param_tree import TreeLayout

# -- the flat layout of the exchange state -------------------------------------------

Piece = tuple[int, int, int]  # (leaf index, start, stop) of a fragment's flat range in one leaf


@dataclass(frozen=True)
class FlatLayout:
    """Where each fragment lives in the padded flat vector.

    Attributes:
        pieces: fragment -> its (leaf, start, stop) ranges, in order.
        offset: fragment -> first element in the flat vector (a multiple of `block`).
        size: fragment -> its element count.
        padded: fragment -> its size rounded up to whole blocks.
        total: the flat vector's length (a multiple of block * devices).
    """

    pieces: dict[int, tuple[Piece, ...]]
    offset: dict[int, int]
    size: dict[int, int]
    padded: dict[int, int]
    total: int

    @classmethod
    def of(cls, plan: Any, names: Sequence[str], block: int, devices: int) -> FlatLayout:
        """The layout of a plan's fragments for a block size over some devices."""
        index = {name: i for i, name in enumerate(names)}
        pieces, offset, size, padded, pos = {}, {}, {}, {}, 0
        for frag in plan.fragments:
            pieces[frag.index] = tuple((index[s.path], s.start, s.stop) for s in frag.slices)
            offset[frag.index], size[frag.index] = pos, frag.size
            padded[frag.index] = -(-frag.size // block) * block
            pos += padded[frag.index]
        unit = block * devices
        return cls(pieces, offset, size, padded, -(-max(pos, 1) // unit) * unit)

    def region(self, flat: jax.Array, f: int) -> jax.Array:
        """Fragment f's padded region of a flat vector."""
        return flat[self.offset[f] : self.offset[f] + self.padded[f]]

    def gather(self, leaves: dict[int, jax.Array], fragments: Sequence[int]) -> jax.Array:
        """The padded regions of `fragments`, back to back, from float32 leaves (traced)."""
        parts = []
        for f in fragments:
            parts += [leaves[i].reshape(-1)[a:b] for i, a, b in self.pieces[f]]
            if self.padded[f] > self.size[f]:
                parts.append(jnp.zeros(self.padded[f] - self.size[f], jnp.float32))
        return jnp.concatenate(parts)

    def cover(self, flat: jax.Array, fragments: Sequence[int]) -> jax.Array:
        """The padded regions of `fragments` of a flat vector, back to back (traced)."""
        if list(fragments) == sorted(self.offset):  # all of them: one slice
            return flat[: sum(self.padded.values())]
        return jnp.concatenate([self.region(flat, f) for f in fragments])

    def assemble(
        self, regions: dict[int, jax.Array], rest: jax.Array, whole: jax.Array | None = None
    ) -> jax.Array:
        """A flat vector of the given fragments' regions and `rest`'s everywhere else (traced).

        Args:
            regions: fragment -> its new padded region.
            rest: the values elsewhere.
            whole: the regions back to back, when they are all the fragments' (then no
                concatenation of pieces is built: XLA's CPU backend runs a fused
                many-operand concatenation element by element).
        """
        covered = sum(self.padded.values())
        if whole is not None and sorted(regions) == sorted(self.offset):
            return whole if covered == self.total else jnp.concatenate([whole, rest[covered:]])
        parts, pos = [], 0
        for f in sorted(self.offset):
            if f in regions:
                if self.offset[f] > pos:
                    parts.append(rest[pos : self.offset[f]])
                parts.append(regions[f])
                pos = self.offset[f] + self.padded[f]
        if pos < self.total:
            parts.append(rest[pos:])
        return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

    def leaf(
        self, regions: dict[int, jax.Array], i: int, shape: tuple, fallback: jax.Array | None
    ) -> jax.Array:
        """Leaf i's values from fragments' padded regions (traced).

        Args:
            regions: fragment -> its padded region's values.
            i: the leaf.
            shape: its shape.
            fallback: the leaf's own values, for its elements in fragments not in
                `regions` (None: every fragment of the leaf is there).
        """
        parts = []
        for f in sorted(self.pieces):
            for pos, (j, a, b) in _positions(self.pieces[f]):
                if j == i:
                    own = f not in regions
                    parts.append(
                        fallback.reshape(-1)[a:b] if own else regions[f][pos : pos + b - a]
                    )
        return (parts[0] if len(parts) == 1 else jnp.concatenate(parts)).reshape(shape)

    def leaves_of(self, fragments: Sequence[int]) -> list[int]:
        """The leaves the fragments touch, sorted."""
        return sorted({i for f in fragments for i, _, _ in self.pieces[f]})


def _positions(pieces: Sequence[Piece]) -> list[tuple[int, Piece]]:
    out, pos = [], 0
    for piece in pieces:
        out.append((pos, piece))
        pos += piece[2] - piece[1]
    return out


# -- the exchange ----------------------------------------------------------------------


class TakenDelta:
    """The codes of a taken delta, on the devices until `frames` reads them (any thread).

    The push that made them is dispatched; `frames` waits for it, copies each
    fragment's codes and scales to the host and frames them.
    """

    def __init__(self, coded: list, leader: bool, frame: Callable) -> None:
        """Args:
        coded: (fragment, codes, scales) per fragment, device arrays.
        leader: whether this process frames them (the others only wait).
        frame: (fragment, codes, scales) -> that fragment's frames.
        """
        self.coded, self.leader, self._frame = coded, leader, frame

    def frames(self) -> dict[int, list]:
        """fragment -> codec frames ({} on processes other than 0, once the push ran)."""
        if not self.leader:  # wait for the call's collectives: process 0 may be reading its codes
            jax.block_until_ready([c for _, c, _ in self.coded])
            return {}
        return {f: self._frame(f, c, s) for f, c, s in self.coded}


def placed_bytes(array: jax.Array) -> int:
    """Bytes of an array's shards on this process's devices (what a host-to-device copy moved)."""
    return sum(shard.data.nbytes for shard in array.addressable_shards)


class DeviceExchange:
    """Anchors, bases and residuals of every fragment, on the devices; push and fold there."""

    def __init__(
        self,
        layout: TreeLayout,
        plan: Any,
        flat: dict[str, np.ndarray],
        versions: dict[int, int],
        *,
        scheme: str,
        block: int,
        zstd_level: int | None,
        rule: str,
    ) -> None:
        """Place the joined global values as anchor and base.

        Args:
            layout: the session's tree layout (every leaf a `jax.Array`: the leaves'
                devices hold the state, their shardings the leaves handed out).
            plan: the cluster's plan (`JoinResult.plan`).
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
        devices = sorted(layout.shardings[0].device_set, key=lambda d: d.id)
        mesh = Mesh(np.array(devices), ("all",))
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.spread = NamedSharding(mesh, PartitionSpec("all"))
        self.flat = FlatLayout.of(plan, layout.names, block, len(devices))
        host = np.zeros(self.flat.total, np.float32)
        for f in plan.fragments:
            a = self.flat.offset[f.index]
            plan.gather(flat, f.index, out=host[a : a + f.size])
        self.anchor = self._put(host, self.spread)
        self.base = jax.jit(jnp.copy, out_shardings=self.spread)(self.anchor)
        self.residual = jax.jit(
            lambda: jnp.zeros(self.flat.total, jnp.float32), out_shardings=self.spread
        )()
        self._pushes: dict[tuple[int, ...], Callable] = {}
        self._folds: dict[tuple, Callable] = {}
        self._refunds: dict[int, Callable] = {}

    def _put(self, host: np.ndarray, sharding: Any) -> jax.Array:
        host = np.ascontiguousarray(host)
        if sharding.is_fully_addressable:
            out = jax.device_put(host, sharding)
        else:  # every process passes the same values
            out = jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])
        self.host_device_bytes += placed_bytes(out)
        return out

    def _incoming(self, host: np.ndarray) -> Any:
        """A host array for a call that reads it whole on every device (codes, values).

        Where this process holds every device it stays a numpy array and the call
        places it, because a separate `device_put` costs more: 0.37-0.42 ms of CPU
        per single-fragment fold of `tiny` on a 2-core CPU VM, a third of the fold,
        paid on the step's thread. The call holds the array until it has run, so nothing
        may write it meanwhile (the client's codes and values are never rewritten;
        the rest is built per call). Elsewhere every process builds the global array
        from its own copy.
        """
        host = np.ascontiguousarray(host)
        if not self.replicated.is_fully_addressable:
            return self._put(host, self.replicated)
        self.host_device_bytes += host.nbytes * len(self.replicated.device_set)
        return host

    def _leaves_out(
        self, regions: dict[int, jax.Array], used: Sequence[int], fallback: dict | None = None
    ) -> list[jax.Array]:
        """Leaves `used` from fragments' regions (else `fallback`'s), in their dtypes (traced)."""
        return [
            self.flat.leaf(regions, i, self.layout.shapes[i], (fallback or {}).get(i)).astype(
                self.layout.dtypes[i]
            )
            for i in used
        ]

    def initial_params(self) -> Any:
        """The session's first parameters: the anchors in each leaf's dtype and sharding.

        Returns:
            The tree of the session's layout.
        """
        used = list(range(len(self.layout.names)))
        every = sorted(self.flat.pieces)
        build = jax.jit(
            lambda a: self._leaves_out({f: self.flat.region(a, f) for f in every}, used),
            out_shardings=list(self.layout.shardings),
        )
        return jax.tree_util.tree_unflatten(self.layout.treedef, build(self.anchor))

    def end_step(self) -> None:
        """Nothing to forget (the host keeps no copy)."""

    def wait(self) -> None:
        """Block until every call so far has run (its collectives included), e.g. before exit."""
        jax.block_until_ready((self.anchor, self.base, self.residual))

    # -- push ------------------------------------------------------------------------

    def encode(self, leaves: list[Any], fragments: Sequence[int], leader: bool) -> dict[int, list]:
        """`take` and its frames at once (the synchronous exchange; see `take`)."""
        return self.take(leaves, fragments, leader).frames()

    def take(self, leaves: list[Any], fragments: Sequence[int], leader: bool) -> TakenDelta:
        """Take each fragment's delta since its anchor, quantize it with error feedback.

        Only dispatches the jitted push (JAX runs it asynchronously): the anchors and
        residuals move at once, for every later call; the codes come to the host and
        are framed when `TakenDelta.frames` is called, on any thread. Every process
        calls it (the anchors and residuals move everywhere).

        Args:
            leaves: the current parameter leaves (layout order).
            fragments: the due fragments.
            leader: this process frames the codes (process 0); the others get {}.

        Returns:
            The taken delta; its `frames()` are `Codec.encode`'s for the same delta and state.
        """
        key = tuple(sorted(fragments))
        if 1 < len(key) < len(self.flat.offset):  # some, not all: one call each (module docstring)
            parts = [self.take(leaves, [f], leader) for f in key]
            return TakenDelta([c for p in parts for c in p.coded], leader, self._frame)
        used = self.flat.leaves_of(key)
        fn = self._pushes.get(key) or self._pushes.setdefault(key, self._push_fn(key, used))
        self.anchor, self.residual, codes, scales = fn(
            [leaves[i] for i in used], self.anchor, self.residual
        )
        if leader:  # counted now: the sizes are known before the copy
            self.host_device_bytes += sum(
                int(c.nbytes) + int(s.nbytes) for c, s in zip(codes, scales, strict=True)
            )
        return TakenDelta(list(zip(key, codes, scales, strict=True)), leader, self._frame)

    def _frame(self, fragment: int, codes: jax.Array, scales: jax.Array) -> list:
        """One fragment's codes and scales to the host, framed (any thread)."""
        return frame_codes(
            self.scheme,
            self.block,
            self.zstd_level,
            np.asarray(codes.addressable_data(0)),  # replicated: one copy is the whole
            np.asarray(scales.addressable_data(0)),
            self.flat.size[fragment],
        )  # fmt: skip

    def warm(
        self,
        leaves: list[Any],
        fragment_sets: Sequence[Sequence[int]],
        folds: Sequence[tuple[str, int]],
        *,
        rare: bool = False,
    ) -> None:
        """Compile pushes and folds now, on copies of the state: nothing changes.

        Args:
            leaves: parameter leaves of the session's layout (only read).
            fragment_sets: the sets of fragments whose push to compile.
            folds: (scheme, block) of the increments whose whole and per-fragment folds
                to compile (the shards' downlink).
            rare: also compile what only faults or a skipped push call for: each
                fragment's fold of full values (a version that does not follow the
                adopted one) and its refund (a push the shards refused), so that no
                executable is compiled (and its memory kept) mid-run.
        """
        copy = jax.jit(jnp.copy, out_shardings=self.spread)
        counted = self.host_device_bytes  # warming moves nothing the session uses
        if rare:
            self._warm_rare(leaves, copy)
        for fragments in fragment_sets:
            key = tuple(sorted(fragments))
            used = self.flat.leaves_of(key)
            fn = self._pushes.get(key) or self._pushes.setdefault(key, self._push_fn(key, used))
            jax.block_until_ready(
                fn([leaves[i] for i in used], copy(self.anchor), copy(self.residual))
            )
        for scheme, block in folds:
            if self.block % block:
                continue
            step = 2 if scheme == "int4" else 1
            covered = sum(self.flat.padded.values())
            codes = np.zeros(covered // step, code_dtype(scheme))
            scales = np.zeros(covered // block, np.float32)
            used = self.flat.leaves_of(sorted(self.flat.offset))
            key = ("whole", scheme, block)
            fn = self._folds.get(key) or self._folds.setdefault(key, self._fold_whole_fn(key, used))
            jax.block_until_ready(fn(
                [leaves[i] for i in used], copy(self.anchor), copy(self.base),
                self._incoming(codes), self._incoming(scales),
            ))  # fmt: skip
            for f in sorted(self.flat.offset):
                n = self.flat.size[f]
                key1 = ((f, scheme, block),)
                used1 = self.flat.leaves_of([f])
                fn = self._folds.get(key1) or self._folds.setdefault(
                    key1, self._fold_fn(key1, used1)
                )
                inc = (
                    self._incoming(np.zeros(-(-n // step), code_dtype(scheme))),
                    self._incoming(np.zeros(-(-n // block), np.float32)),
                )
                jax.block_until_ready(
                    fn([leaves[i] for i in used1], copy(self.anchor), copy(self.base), [inc])
                )
        self.host_device_bytes = counted

    def _warm_rare(self, leaves: list[Any], copy: Callable) -> None:
        """Compile each fragment's full-values fold and refund, on copies of the state."""
        for f in sorted(self.flat.offset):
            key = ((f, "full", 0),)
            used = self.flat.leaves_of([f])
            fn = self._folds.get(key) or self._folds.setdefault(key, self._fold_fn(key, used))
            values = self._incoming(np.zeros(self.flat.size[f], np.float32))
            jax.block_until_ready(
                fn([leaves[i] for i in used], copy(self.anchor), copy(self.base), [(values,)])
            )
            refund = self._refund_fn(f)
            back = self._incoming(np.zeros(self.flat.padded[f], np.float32))
            jax.block_until_ready(refund(copy(self.residual), back))

    def _push_fn(self, fragments: tuple[int, ...], used: list[int]) -> Callable:
        levels, block, flat = self.levels, self.block, self.flat

        def push(local, anchor, residual):
            lf = {i: x.astype(jnp.float32) for i, x in zip(used, local, strict=True)}
            now = flat.gather(lf, fragments)
            was = flat.cover(anchor, fragments)
            res = flat.cover(residual, fragments)
            codes, scales, new_res = quantize(delta_since(was, now) + res, levels, block)
            step = 2 if levels == 7 else 1  # elements per code byte
            out_codes, out_scales, regions, pos = [], [], {}, 0
            for f in fragments:  # slices, not a concatenation: only the codes cross
                out_codes.append(codes[pos // step : (pos + flat.size[f] + step - 1) // step])
                out_scales.append(scales[pos // block : (pos + flat.padded[f]) // block])
                regions[f] = pos, pos + flat.padded[f]
                pos += flat.padded[f]
            new_anchor = flat.assemble({f: now[a:b] for f, (a, b) in regions.items()}, anchor, now)
            new_res = flat.assemble(
                {f: new_res[a:b] for f, (a, b) in regions.items()}, residual, new_res
            )
            return new_anchor, new_res, out_codes, out_scales

        rep = [self.replicated] * len(fragments)
        return jax.jit(
            push, donate_argnums=(1, 2), out_shardings=(self.spread, self.spread, rep, rep)
        )

    def zero_frames(self, fragment: int) -> list:
        """The frames of an all-zero delta of one fragment, as a push of it is framed.

        Args:
            fragment: the fragment whose size the delta has.

        Returns:
            Codec frames (header first) that decode to zeros of the fragment's size.
        """
        size = self.flat.size[fragment]
        (t,), _ = layout(self.scheme, self.block, None, [(("delta",), (size,), "float32")])
        codes = np.zeros(t.codes_bytes, code_dtype(self.scheme))  # the codec's layout rule
        scales = np.zeros(t.blocks, np.float32)
        return frame_codes(self.scheme, self.block, self.zstd_level, codes, scales, size)

    def refund(self, fragment: int, values: np.ndarray) -> None:
        """Put a refused push's values back into the fragment's residual (every process).

        The shards never applied them, so the next push of the fragment sends them
        again, as `codec.refund` does for the numpy codec's error feedback.

        Args:
            fragment: the pushed fragment.
            values: the decoded delta that push carried (`codec.decode(frames)["delta"]`),
                the same on every process.
        """
        padded = np.zeros(self.flat.padded[fragment], np.float32)
        padded[: self.flat.size[fragment]] = np.asarray(values, np.float32).reshape(-1)
        fn = self._refund_fn(fragment)
        self.residual = fn(self.residual, self._incoming(padded))

    def _refund_fn(self, fragment: int) -> Callable:
        """The jitted refund of one fragment (built once)."""
        fn = self._refunds.get(fragment)
        if fn is None:
            start, length = self.flat.offset[fragment], self.flat.padded[fragment]
            fn = self._refunds[fragment] = jax.jit(
                lambda residual, back: residual.at[start : start + length].add(back),
                donate_argnums=(0,),
                out_shardings=self.spread,
            )
        return fn

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

        Raises:
            UnfoldableUpdate: an update has neither codes that follow the adopted version
                (as it stands when that update's turn comes: a fragment's versions may
                follow each other in one call) nor full values of its fragment's size.
        """
        whole = self._whole_increment(updates)
        if whole is not None:
            return self._fold_whole(leaves, updates, *whole)
        if len(updates) > 1:  # not the whole increment: one call each (module docstring)
            for u in sorted(updates, key=lambda u: u.fragment):
                leaves = self.fold(leaves, [u])
            return leaves
        key, incoming = [], []
        for u in updates:
            self._check_foldable(u)
        for u in sorted(updates, key=lambda u: u.fragment):
            coded = self.usable_increment(u)
            if coded is not None:
                key.append((u.fragment, coded.scheme, coded.block))
                incoming.append(
                    (
                        self._incoming(coded.codes),
                        self._incoming(coded.scales),
                    )
                )
            else:
                key.append((u.fragment, "full", 0))
                incoming.append((self._incoming(np.asarray(u.values, np.float32)),))
        key = tuple(key)
        used = self.flat.leaves_of([f for f, _, _ in key])
        return self._run_fold(key, used, self._fold_fn, leaves, updates, incoming)

    def _check_foldable(self, update: Update) -> None:
        """Raise `UnfoldableUpdate` unless `update` has usable codes or full values."""
        if self.usable_increment(update) is not None:
            return
        size = self.flat.size[update.fragment]
        values = update.values
        values_size = None if values is None else int(np.size(values))
        if values_size != size or np.ndim(values) != 1:
            raise UnfoldableUpdate(
                update.fragment, update.version, self.versions[update.fragment],
                getattr(update, "increment", None) is not None, values_size, size,
            )  # fmt: skip

    def _run_fold(self, key, used, build, leaves, updates, *incoming) -> list[Any]:
        """Call (building once) the fold `key`; take its state; return the new leaves."""
        fn = self._folds.get(key) or self._folds.setdefault(key, build(key, used))
        local, self.anchor, self.base = fn(
            [leaves[i] for i in used], self.anchor, self.base, *incoming
        )
        out = list(leaves)
        for j, i in enumerate(used):
            out[i] = local[j]
        for u in updates:
            self.versions[u.fragment] = u.version
        return out

    def _whole_increment(self, updates: Sequence[Update]) -> tuple[str, int] | None:
        """(scheme, block) when every fragment has an increment of one scheme that fits the
        flat layout's blocks: then the fold runs over the whole flat vector at once."""
        coded = [self.usable_increment(u) for u in updates]
        kinds = {(c.scheme, c.block) for c in coded if c is not None}
        if len(updates) != len(self.flat.offset) or None in coded or len(kinds) != 1:
            return None
        scheme, block = kinds.pop()
        return (scheme, block) if self.block % block == 0 else None

    def _fold_whole(self, leaves: list[Any], updates: Sequence[Update], scheme: str, block: int):
        """Every fragment's increment, laid out like the flat vector, folded in one pass."""
        step = 2 if scheme == "int4" else 1
        covered = sum(self.flat.padded.values())
        # padding codes decode to 0 (an int4 byte 0x88 holds two zero levels)
        codes = np.full(covered // step, 0x88 if step == 2 else 0, code_dtype(scheme))
        scales = np.zeros(covered // block, np.float32)
        for u in updates:
            a, c = self.flat.offset[u.fragment], u.increment
            codes[a // step : a // step + c.codes.shape[0]] = c.codes
            scales[a // block : a // block + c.scales.shape[0]] = c.scales
        used = self.flat.leaves_of(sorted(self.flat.offset))
        return self._run_fold(
            ("whole", scheme, block), used, self._fold_whole_fn, leaves, updates,
            self._incoming(codes), self._incoming(scales),
        )  # fmt: skip

    def _fold_whole_fn(self, key: tuple, used: list[int]) -> Callable:
        _, scheme, block = key
        flat, rule = self.flat, self.rule
        every = sorted(flat.offset)
        covered = sum(flat.padded.values())

        def fold(local, anchor, base, codes, scales):
            lf = {i: x.astype(jnp.float32) for i, x in zip(used, local, strict=True)}
            now = flat.gather(lf, every)
            g = flat.cover(base, every) + dequantize(codes, scales, covered, LEVELS[scheme], block)
            new_local = folded(now, flat.cover(anchor, every), g, rule)
            regions = {
                f: new_local[flat.offset[f] : flat.offset[f] + flat.padded[f]] for f in every
            }
            state = flat.assemble(dict.fromkeys(every), anchor, g)  # g, plus any tail
            return self._leaves_out(regions, used), state, state

        return jax.jit(
            fold,
            donate_argnums=(1, 2),
            out_shardings=([self.layout.shardings[i] for i in used], self.spread, self.spread),
        )

    def _fold_fn(self, key: tuple, used: list[int]) -> Callable:
        flat, rule = self.flat, self.rule
        fragments = [f for f, _, _ in key]

        def fold(local, anchor, base, incoming):
            lf = {i: x.astype(jnp.float32) for i, x in zip(used, local, strict=True)}
            now = flat.gather(lf, fragments)
            new_global, new_local, pos = {}, {}, 0
            for (f, scheme, block), inc in zip(key, incoming, strict=True):
                n, pad = flat.size[f], flat.padded[f] - flat.size[f]
                if scheme == "full":
                    g = jnp.pad(inc[0], (0, pad))
                else:
                    step = dequantize(inc[0], inc[1], n, LEVELS[scheme], block)
                    g = flat.region(base, f) + jnp.pad(step, (0, pad))
                here = now[pos : pos + flat.padded[f]]
                new_local[f] = folded(here, flat.region(anchor, f), g, rule)
                new_global[f] = g
                pos += flat.padded[f]
            for f, g in new_global.items():  # in place (donated): only the fragments move
                start = flat.offset[f]
                anchor = jax.lax.dynamic_update_slice(anchor, g, (start,))
                base = jax.lax.dynamic_update_slice(base, g, (start,))
            return self._leaves_out(new_local, used, lf), anchor, base

        shardings = [self.layout.shardings[i] for i in used]
        return jax.jit(
            fold, donate_argnums=(1, 2), out_shardings=(shardings, self.spread, self.spread)
        )

    # -- what the session reads ------------------------------------------------------

    def base_values(self) -> dict[str, np.ndarray]:
        """The adopted global values of every leaf, on the host (a device-to-host copy).

        Returns:
            name -> float32 array of the leaf's shape.
        """
        base = self.base
        if not base.is_fully_addressable:
            from jax.experimental import multihost_utils

            base = multihost_utils.process_allgather(base, tiled=True)
        host = np.asarray(base, np.float32)
        self.host_device_bytes += host.nbytes
        out = {
            n: np.empty(s, np.float32)
            for n, s in zip(self.layout.names, self.layout.shapes, strict=True)
        }
        for f in self.plan.fragments:
            a = self.flat.offset[f.index]
            self.plan.scatter(f.index, host[a : a + f.size], out)
        return out
