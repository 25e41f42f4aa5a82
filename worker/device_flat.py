"""The flat layout of an island's exchange state on its devices: fragments padded to whole blocks.

`worker.device_exchange` keeps anchor, base and residual as one float32
vector each: the plan's fragments back to back in fragment order, each padded
with zeros to a whole number of quantization blocks, the whole padded to a
multiple of block x devices (so it spreads evenly over the island's devices).
Any set of fragments is then block-aligned, so quantizing the due fragments is
one pass over their regions. `FlatLayout` knows where every fragment and every
leaf piece sits and builds the traced gathers between parameter leaves and
the flat vector. XLA's CPU backend runs a many-operand concatenation fused
into an elementwise consumer element by element, so `assemble` returns the
regions' own vector when they are all the fragments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

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
