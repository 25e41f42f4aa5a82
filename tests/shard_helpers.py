"""Helpers for shard tests: small parameter sets, plans, init/push payloads, forged frames."""

from __future__ import annotations

import zlib
from typing import Any

import msgpack
import numpy as np

import codec
from paramserver.wire.plan import Plan, leaf_specs, make_plan


def small_flat(seed: int = 0) -> dict[str, np.ndarray]:
    """A tiny flat parameter mapping (168 float32 elements in two leaves)."""
    rng = np.random.default_rng(seed)
    return {
        "a/w": rng.standard_normal((8, 16)).astype(np.float32),
        "b": rng.standard_normal(40).astype(np.float32),
    }


def plan_for(flat: dict[str, np.ndarray], shards: int = 1, fragments: int = 2) -> Plan:
    """The sharding plan of `flat`."""
    return make_plan(leaf_specs(flat), shards, fragments)


def init_payload(plan: Plan, flat: dict[str, np.ndarray], shard: int = 0) -> list[Any]:
    """Codec frames of the init tree {"<fragment>": values} for one shard."""
    tree = {str(f.index): plan.gather(flat, f.index) for f in plan.fragments_of(shard)}
    frames, _ = codec.raw("float32").encode(tree)
    return frames


def delta_frames(vec: np.ndarray, scheme: str = "raw") -> list[Any]:
    """Codec frames of {"delta": vec} with the raw float32 or int8 codec."""
    c = codec.raw("float32") if scheme == "raw" else codec.int8()
    frames, _ = c.encode({"delta": vec})
    return frames


def push_header(
    plan: Plan,
    island: str,
    round: int,
    fragment: int,
    base_version: int = 0,
    tokens: int = 1000,
    steps: int = 10,
) -> dict[str, Any]:
    """A well-formed push header."""
    return {
        "kind": "push",
        "island": island,
        "round": round,
        "fragment": fragment,
        "base_version": base_version,
        "tokens": tokens,
        "steps": steps,
        "plan_hash": plan.hash,
    }


def nan_frames(size: int, value: float = float("nan"), name: str = "delta") -> list[Any]:
    """Valid raw-codec frames of {name: vec} whose first element is `value` (NaN/Inf).

    The codec refuses to encode non-finite values, so the payload is patched
    after encoding and its crc32 recomputed: a well-formed message carrying poison.
    """
    frames, _ = codec.raw("float32").encode({name: np.zeros(size, np.float32)})
    payload = bytearray(frames[1])
    payload[0:4] = np.float32(value).tobytes()
    header = msgpack.unpackb(bytes(frames[0]), raw=False)
    header["frames"][0][2] = zlib.crc32(payload)
    return [msgpack.packb(header), bytes(payload), *frames[2:]]
