"""The sharding plan: which flat element ranges form each fragment, and which shard owns it.

This module owns the plan and nothing else: a pure function of (leaf paths,
shapes, dtypes, shard count, fragment count) that server and client both
compute and compare by `Plan.hash`, plus `gather` / `scatter` between the flat
parameter mapping and a fragment's 1-D float32 vector.

Layout: leaves are sorted by path (code point order), each flattened
row-major, and laid end to end. The concatenation is cut at
`(2 * i * total + F) // (2 * F)` for i = 0..F (F = num_fragments): i * total / F
rounded half *up*, in integer arithmetic (not Python's `round`, which rounds
halves to even). So every fragment holds `total // F` or one more element
(byte-balanced to one element, since fragment values are always float32);
large leaves are split across fragments, small neighbours share one, a leaf
with no elements is in no fragment. Shards then own contiguous runs of
fragments: shard k owns fragments [c_k, c_{k+1}) with c_k = k * F / S rounded
half up the same way (S = num_shards), so each holds floor(F / S) or
ceil(F / S) fragments (bytes balanced to one fragment plus one element per
fragment), and the pieces of a leaf cut across fragments sit on one shard
unless the leaf spans one of the S - 1 run boundaries. A shard can then merge
a cut tensor as a whole (RDA's whole-tensor norms,
`paramserver.server.step.policy`) without another shard's data. (Before
this rule fragments went to shards greedily, largest first; a shard refuses
to resume a data dir written under that rule, saying its plan does not match.)

The hash is the lowercase hex SHA-256 of the wire form without its "hash"
key, as `json.dumps(..., sort_keys=True, separators=(",", ":"))` writes it
(ASCII-escaped). `docs/protocol.md` (section 6) spells all of this out for
clients written without this module.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

PLAN_FORMAT_VERSION = 1


class PlanError(ValueError):
    """A plan cannot be built, or a wire plan or parameter mapping does not match it."""


@dataclass(frozen=True)
class LeafSpec:
    """One parameter leaf: flat path, shape and dtype name (e.g. "float32")."""

    path: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise PlanError(f"leaf path must be a non-empty string, got {self.path!r}")
        if not isinstance(self.shape, tuple) or not all(
            isinstance(d, int | np.integer) and not isinstance(d, bool) and d >= 0
            for d in self.shape
        ):
            raise PlanError(
                f"leaf {self.path!r}: shape must be a tuple of non-negative ints, got {self.shape!r}"
            )
        if not isinstance(self.dtype, str) or not self.dtype:
            raise PlanError(f"leaf {self.path!r}: dtype must be a dtype name, got {self.dtype!r}")

    @property
    def size(self) -> int:
        """Number of elements of the leaf."""
        return math.prod(int(d) for d in self.shape)


@dataclass(frozen=True)
class Slice:
    """The flat (row-major) element range [start, stop) of one leaf."""

    path: str
    start: int
    stop: int

    @property
    def size(self) -> int:
        """Number of elements in the range."""
        return self.stop - self.start


@dataclass(frozen=True)
class Fragment:
    """The unit of synchronisation: ordered slices whose concatenation has `size` elements."""

    index: int
    shard: int
    slices: tuple[Slice, ...]
    size: int


@dataclass(frozen=True)
class Plan:
    """A sharding plan; build it with `make_plan` or `Plan.from_wire`, not by hand."""

    leaves: tuple[LeafSpec, ...]
    num_shards: int
    num_fragments: int
    fragments: tuple[Fragment, ...]
    hash: str

    def fragments_of(self, shard: int) -> list[Fragment]:
        """Fragments owned by one shard.

        Args:
            shard: shard index in [0, num_shards).

        Returns:
            The shard's fragments in fragment-index order.
        """
        if not 0 <= shard < self.num_shards:
            raise PlanError(f"shard {shard} out of range: the plan has {self.num_shards} shards")
        return [f for f in self.fragments if f.shard == shard]

    def _fragment(self, index: int) -> Fragment:
        if not 0 <= index < self.num_fragments:
            raise PlanError(
                f"fragment {index} out of range: the plan has {self.num_fragments} fragments"
            )
        return self.fragments[index]

    def _leaf_view(self, flat: Mapping[str, np.ndarray], path: str) -> np.ndarray:
        if path not in flat:
            raise PlanError(f"parameter {path!r} is missing from the mapping the plan covers")
        arr = flat[path]
        spec = self._specs[path]
        if tuple(arr.shape) != spec.shape:
            raise PlanError(
                f"parameter {path!r} has shape {tuple(arr.shape)}, plan has {spec.shape}"
            )
        return arr

    @functools.cached_property
    def total_size(self) -> int:
        """Elements of all fragments together (every parameter element once)."""
        return sum(f.size for f in self.fragments)

    @functools.cached_property
    def _specs(self) -> dict[str, LeafSpec]:
        return {leaf.path: leaf for leaf in self.leaves}

    def gather(
        self, flat: Mapping[str, np.ndarray], index: int, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Copy one fragment's values out of the flat parameters.

        Args:
            flat: path -> array with the plan's leaf shapes; any float dtype.
            index: fragment index.
            out: optional 1-D float32 buffer of the fragment's size to fill.

        Returns:
            The fragment's values as a 1-D float32 array (`out` when given).
        """
        frag = self._fragment(index)
        if out is None:
            out = np.empty(frag.size, dtype=np.float32)
        elif out.dtype != np.float32 or out.shape != (frag.size,):
            raise PlanError(
                f"out must be float32 of shape ({frag.size},) for fragment {index}, "
                f"got {out.dtype} {out.shape}"
            )
        return self.gather_piece(flat, index, 0, frag.size, out)

    def gather_piece(
        self,
        flat: Mapping[str, np.ndarray],
        index: int,
        offset: int,
        count: int,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Copy elements [offset, offset + count) of one fragment's values (a piece of an init).

        Args:
            flat: path -> array with the plan's leaf shapes; any float dtype.
            index: fragment index.
            offset: the piece's first element, 0 <= offset <= the fragment's size.
            count: its element count (offset + count <= the fragment's size).
            out: optional 1-D float32 buffer of `count` elements to fill.

        Returns:
            The piece as a 1-D float32 array (`out` when given).
        """
        frag = self._fragment(index)
        if not 0 <= offset <= offset + count <= frag.size:
            raise PlanError(f"piece [{offset}, +{count}) outside fragment {index} ({frag.size})")
        if out is None:
            out = np.empty(count, dtype=np.float32)
        at, end = 0, offset + count  # at: the fragment element where the slice starts
        for s in frag.slices:
            lo, hi = max(at, offset), min(at + s.size, end)
            if lo < hi:
                arr = np.asarray(self._leaf_view(flat, s.path))
                if not _is_float(arr.dtype):
                    raise PlanError(f"parameter {s.path!r} has non-float dtype {arr.dtype}")
                leaf = arr.reshape(-1)[s.start + lo - at : s.start + hi - at]
                out[lo - offset : hi - offset] = leaf
            at += s.size
        return out

    def scatter(self, index: int, values: np.ndarray, flat: Mapping[str, np.ndarray]) -> None:
        """Write one fragment's values back into the flat parameters, in place.

        Args:
            index: fragment index.
            values: 1-D array of the fragment's size.
            flat: path -> writable, C-contiguous float32 arrays of the plan's leaf shapes.
        """
        frag = self._fragment(index)
        values = np.asarray(values)
        if values.shape != (frag.size,):
            raise PlanError(
                f"values for fragment {index} must have shape ({frag.size},), got {values.shape}"
            )
        offset = 0
        for s in frag.slices:
            arr = self._leaf_view(flat, s.path)
            if not isinstance(arr, np.ndarray) or arr.dtype != np.float32:
                raise PlanError(
                    f"parameter {s.path!r} must be a float32 numpy array to scatter into, "
                    f"got {type(arr).__name__} {getattr(arr, 'dtype', None)}; convert it first"
                )
            if not arr.flags.writeable or not arr.flags.c_contiguous:
                raise PlanError(
                    f"parameter {s.path!r} must be writable and C-contiguous to scatter into; "
                    "pass np.array(x, dtype=np.float32) copies"
                )
            arr.reshape(-1)[s.start : s.stop] = values[offset : offset + s.size]
            offset += s.size

    def to_wire(self) -> dict:
        """Plain dict/list/str/int form for msgpack; `Plan.from_wire` inverts it.

        Returns:
            A dict with format version, leaves, counts, fragments and hash.
        """
        return {
            "format": PLAN_FORMAT_VERSION,
            "leaves": [[leaf.path, list(leaf.shape), leaf.dtype] for leaf in self.leaves],
            "num_shards": self.num_shards,
            "num_fragments": self.num_fragments,
            "fragments": [
                [f.index, f.shard, [[s.path, s.start, s.stop] for s in f.slices]]
                for f in self.fragments
            ],
            "hash": self.hash,
        }

    @classmethod
    def from_wire(cls, obj: object) -> Plan:
        """Rebuild a plan from `to_wire` output, recomputing and checking every field.

        Args:
            obj: the decoded wire object.

        Returns:
            The plan, equal to `make_plan` of the same inputs.

        Raises:
            PlanError: malformed object, other format version, or any field that
                differs from the recomputed plan (fragments or hash).
        """
        try:
            if not isinstance(obj, Mapping):
                raise TypeError("not a mapping")
            if obj["format"] != PLAN_FORMAT_VERSION:
                raise PlanError(
                    f"plan format {obj['format']!r} is not supported; "
                    f"this build speaks {PLAN_FORMAT_VERSION}"
                )
            leaves = [
                LeafSpec(str(path), tuple(int(d) for d in shape), str(dtype))
                for path, shape, dtype in obj["leaves"]
            ]
            plan = make_plan(leaves, int(obj["num_shards"]), int(obj["num_fragments"]))
            wire_frags = [
                [int(i), int(sh), [[str(p), int(a), int(b)] for p, a, b in slices]]
                for i, sh, slices in obj["fragments"]
            ]
            wire_hash = obj["hash"]
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"malformed wire plan: {exc!r}") from exc
        if wire_frags != plan.to_wire()["fragments"]:
            raise PlanError("wire plan fragments differ from the plan recomputed from its leaves")
        if wire_hash != plan.hash:
            raise PlanError(f"wire plan hash {wire_hash!r} differs from recomputed {plan.hash!r}")
        return plan


def _is_float(dtype: np.dtype) -> bool:
    # ml_dtypes (bfloat16, float8_*) register with kind "V"; accept them by name.
    return dtype.kind == "f" or (dtype.kind == "V" and "float" in dtype.name)


def leaf_specs(flat: Mapping[str, np.ndarray]) -> list[LeafSpec]:
    """Describe a flat parameter mapping as leaf specs.

    Args:
        flat: path -> array.

    Returns:
        One LeafSpec per entry, sorted by path.
    """
    return [
        LeafSpec(path, tuple(int(d) for d in np.shape(arr)), str(np.asarray(arr).dtype))
        for path, arr in sorted(flat.items())
    ]


def _cut_fragments(leaves: Sequence[LeafSpec], num_fragments: int) -> list[tuple[Slice, ...]]:
    bounds = _half_up_bounds(sum(leaf.size for leaf in leaves), num_fragments)
    pieces: list[list[Slice]] = [[] for _ in range(num_fragments)]
    leaf_start = 0
    frag = 0
    for leaf in leaves:
        pos = leaf_start
        leaf_stop = leaf_start + leaf.size
        while pos < leaf_stop:
            while bounds[frag + 1] <= pos:
                frag += 1
            end = min(leaf_stop, bounds[frag + 1])
            pieces[frag].append(Slice(leaf.path, pos - leaf_start, end - leaf_start))
            pos = end
        leaf_start = leaf_stop
    return [tuple(p) for p in pieces]


def _half_up_bounds(total: int, parts: int) -> list[int]:
    """i * total / parts rounded half up for i = 0..parts, exact in integer arithmetic."""
    return [(2 * i * total + parts) // (2 * parts) for i in range(parts + 1)]


def _assign_shards(num_fragments: int, num_shards: int) -> list[int]:
    """Contiguous runs: shard k owns fragments [c_k, c_{k+1}), c = _half_up_bounds(F, S)."""
    runs = _half_up_bounds(num_fragments, num_shards)
    return [k for k in range(num_shards) for _ in range(runs[k], runs[k + 1])]


def _plan_hash(
    leaves: Sequence[LeafSpec], num_shards: int, num_fragments: int, fragments: Sequence[Fragment]
) -> str:
    canonical = {
        "format": PLAN_FORMAT_VERSION,
        "leaves": [[leaf.path, list(leaf.shape), leaf.dtype] for leaf in leaves],
        "num_shards": num_shards,
        "num_fragments": num_fragments,
        "fragments": [
            [f.index, f.shard, [[s.path, s.start, s.stop] for s in f.slices]] for f in fragments
        ],
    }
    blob = json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def make_plan(leaves: Sequence[LeafSpec], num_shards: int, num_fragments: int) -> Plan:
    """Build the deterministic, byte-balanced sharding plan.

    Args:
        leaves: the parameter leaves, in any order (sorted by path here).
        num_shards: number of shard processes, >= 1.
        num_fragments: number of fragments, num_shards <= num_fragments <= total elements.

    Returns:
        The plan; equal inputs give an equal plan and hash.

    Raises:
        PlanError: empty or duplicate leaves, or counts out of range.
    """
    leaves = tuple(sorted(leaves, key=lambda leaf: leaf.path))
    if not leaves:
        raise PlanError("no leaves: pass the flat parameters' leaf_specs(...)")
    for leaf in leaves:
        if not isinstance(leaf, LeafSpec):
            raise PlanError(f"leaves must be LeafSpec, got {type(leaf).__name__}")
    for a, b in zip(leaves, leaves[1:], strict=False):
        if a.path == b.path:
            raise PlanError(f"duplicate leaf path {a.path!r}")
    for name, value in (("num_shards", num_shards), ("num_fragments", num_fragments)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise PlanError(f"{name} must be an int, got {value!r}")
    num_shards, num_fragments = int(num_shards), int(num_fragments)
    if num_shards < 1:
        raise PlanError(f"num_shards={num_shards}: need at least one shard")
    if num_fragments < num_shards:
        raise PlanError(
            f"num_fragments={num_fragments} < num_shards={num_shards}: every shard needs a "
            "fragment; raise num_fragments or lower num_shards"
        )
    total = sum(leaf.size for leaf in leaves)
    if num_fragments > total:
        raise PlanError(
            f"num_fragments={num_fragments} exceeds the {total} parameter elements; "
            "lower num_fragments"
        )
    slices = _cut_fragments(leaves, num_fragments)
    sizes = [sum(s.size for s in sl) for sl in slices]
    owner = _assign_shards(num_fragments, num_shards)
    fragments = tuple(
        Fragment(index=i, shard=owner[i], slices=slices[i], size=sizes[i])
        for i in range(num_fragments)
    )
    return Plan(
        leaves=leaves,
        num_shards=num_shards,
        num_fragments=num_fragments,
        fragments=fragments,
        hash=_plan_hash(leaves, num_shards, num_fragments, fragments),
    )
