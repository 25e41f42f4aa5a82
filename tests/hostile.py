"""Hostile messages for fuzzing a live shard, generated deterministically from a seed.

`hostile_messages(rng, ...)` returns a list of (family, frames): random bytes,
mutated valid pushes (bit flips in header or payload, truncated, dropped or
extra frames, retyped fields), oversize payloads (below the hard cap), NaN/Inf
payloads, wrong shapes and dtypes, replays of accepted pushes, forged island
ids, wrong protocol versions and unknown kinds. Every message is a list of
bytes frames ready for a DEALER.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
from shard_helpers import delta_frames, nan_frames

from paramserver.wire import protocol

FAMILIES = (
    "random_bytes",
    "flip_header",
    "flip_payload",
    "truncate",
    "drop_frames",
    "extra_frames",
    "retype_field",
    "oversize",
    "non_finite",
    "wrong_shape",
    "wrong_dtype",
    "replay",
    "forged_island",
    "bad_version",
    "unknown_kind",
    "random_request",
)

_JUNK_VALUES: tuple[Any, ...] = (
    -1,
    2**63,
    -(2**63),
    1.5,
    float("nan"),
    "",
    "x" * 300,
    None,
    True,
    [],
    {},
    b"\x00\xff",
    [1, [2, [3]]],
)


def _flip(data: bytes, rng: random.Random, flips: int) -> bytes:
    buf = bytearray(data)
    if not buf:
        return bytes(rng.getrandbits(8) for _ in range(4))
    for _ in range(flips):
        i = rng.randrange(len(buf))
        buf[i] ^= 1 << rng.randrange(8)
    return bytes(buf)


def hostile_messages(
    rng: random.Random,
    count: int,
    valid: Sequence[tuple[dict[str, Any], list[bytes]]],
    size: int,
    max_message_bytes: int,
    forbidden_islands: frozenset[str] = frozenset(),
) -> list[tuple[str, list[bytes]]]:
    """`count` hostile messages, families chosen round-robin so each appears.

    Args:
        rng: the seeded generator (same seed, same messages).
        count: number of messages.
        valid: (header, payload frames) of pushes the shard already accepted:
            replayed as they are and used as the seed of every mutation.
        size: the fragment's element count (for shape and NaN cases).
        max_message_bytes: the shard's limit; oversize messages stay below twice it
            (past that ZeroMQ drops the connection instead of replying).
        forbidden_islands: island ids never forged (e.g. a silent island the
            test keeps alive so that no outer step happens).

    Returns:
        [(family, frames)] with every frame as bytes.
    """
    out = []
    for i in range(count):
        family = FAMILIES[i % len(FAMILIES)]
        header, payload = rng.choice(valid)
        header = dict(header)
        frames = _make(family, rng, header, [bytes(f) for f in payload], size, max_message_bytes)
        island = _island_of(frames)
        if isinstance(island, str) and island in forbidden_islands:
            frames = [msgpack.packb({"v": 1, "kind": "status"})]
        out.append((family, frames))
    return out


def _island_of(frames: list[bytes]) -> Any:
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    except Exception:
        return None
    return header.get("island") if isinstance(header, dict) else None


def _pack(header: dict[str, Any], payload: list[bytes]) -> list[bytes]:
    full = {"v": protocol.PROTOCOL_VERSION, **header}
    return [msgpack.packb(full, use_bin_type=True), *(bytes(f) for f in payload)]


def _make(
    family: str,
    rng: random.Random,
    header: dict[str, Any],
    payload: list[bytes],
    size: int,
    max_bytes: int,
) -> list[bytes]:
    valid = _pack(header, payload)
    if family in ("flip_payload", "truncate", "drop_frames", "extra_frames"):
        # a fresh round, so the payload is decoded rather than acked as a duplicate
        header["round"] += rng.randint(3, 5)
        valid = _pack(header, payload)
    if family == "random_bytes":
        n = rng.choice((0, 1, 7, 64, 1000))
        return [bytes(rng.getrandbits(8) for _ in range(n)) for _ in range(rng.randint(1, 3))]
    if family == "flip_header":
        return [_flip(valid[0], rng, rng.randint(1, 8)), *valid[1:]]
    if family == "flip_payload":
        j = rng.randrange(1, len(valid))
        frames = list(valid)
        frames[j] = _flip(frames[j], rng, rng.randint(1, 4))
        return frames
    if family == "truncate":
        j = rng.randrange(len(valid))
        frames = list(valid)
        frames[j] = frames[j][: rng.randrange(max(1, len(frames[j])))]
        return frames
    if family == "drop_frames":
        keep = rng.randrange(1, len(valid))
        return valid[:keep]
    if family == "extra_frames":
        return [*valid, *(_flip(b"\x00" * 16, rng, 8) for _ in range(rng.randint(1, 3)))]
    if family == "retype_field":
        field = rng.choice(sorted(header))
        header[field] = rng.choice(_JUNK_VALUES)
        return _pack(header, payload)
    if family == "oversize":
        extra = max_bytes + rng.randrange(1, max_bytes // 2)
        return [valid[0], b"\x00" * extra]
    if family == "non_finite":
        value = rng.choice((float("nan"), float("inf"), float("-inf")))
        header["round"] += rng.randint(1, 3)
        return _pack(header, nan_frames(size, value))
    if family == "wrong_shape":
        n = rng.choice((0, 1, size - 1, size + 1, 2 * size))
        header["round"] += rng.randint(1, 3)
        return _pack(header, delta_frames(np.zeros(n, np.float32)))
    if family == "wrong_dtype":
        header["round"] += rng.randint(1, 3)
        return _pack(header, delta_frames(np.zeros(size, np.float16)))
    if family == "replay":
        return valid
    if family == "forged_island":
        header["island"] = f"forged-{rng.randrange(10**6)}"
        header["round"] = rng.randrange(10**6)
        return _pack(header, payload)
    if family == "bad_version":
        header["v"] = rng.choice((0, 2, 99, -1, "1", None))
        return [msgpack.packb(header), *payload]
    if family == "unknown_kind":
        header["kind"] = rng.choice(("pull", "PUSH", "", "shutdown", "x" * 40))
        return _pack(header, payload)
    if family == "random_request":
        kinds = ("hello", "heartbeat", "snapshot", "init", "init_begin", "init_piece", "status")
        kind = rng.choice((*kinds, "bye"))
        fields: dict[str, Any] = {"kind": kind, "island": f"forged-{rng.randrange(50)}"}
        if kind in ("snapshot", "init_piece"):
            fields["fragment"] = rng.choice((0, 1, 7, 2**40))
        if kind in ("init", "init_begin"):
            fields["plan"] = {"junk": rng.randrange(100)}
        if kind == "init_piece":
            fields.update(plan_hash=f"{rng.randrange(2**64):064x}", offset=rng.randrange(10**6))
        return _pack(fields, payload if kind in ("init", "init_piece") else [])
    raise ValueError(f"unknown family {family!r}")
