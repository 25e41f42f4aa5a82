"""Reading a fragment's values from a shard: the snapshot request and the checks of its reply.

This module owns the part of the protocol conversation that every reader of
a shard's parameters shares (the island's client when it joins or re-syncs,
and `paramserver.plumbing.probe` when an operator reads the global model): the
`snapshot` request header and the decoding of the fp32 vectors a shard sends
(`snapshot_reply` and published `update` payloads, codec frames holding
{"values": 1-D vector}). No I/O; an unusable reply raises `ProtocolError`,
undecodable frames `codec.CodecError`. docs/protocol.md is the spec.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import codec
from paramserver.wire.protocol import ProtocolError


def snapshot_request(island: str, fragment: int, rid: int | None = None) -> dict[str, Any]:
    """The header of a `snapshot` request.

    Args:
        island: the asking island's id (any valid id; no hello is needed).
        fragment: the fragment index.
        rid: the request id the reply echoes (None: no id).

    Returns:
        A header for `protocol.pack`.
    """
    header: dict[str, Any] = {"kind": "snapshot", "island": island, "fragment": fragment}
    if rid is not None:
        header["id"] = rid
    return header


def fragment_vector(payload: list[Any], name: str = "values") -> np.ndarray:
    """Decode codec frames holding {name: 1-D vector} into float32.

    Args:
        payload: the message's payload frames.
        name: the tensor's name in the codec tree.

    Returns:
        The vector, 1-D float32.

    Raises:
        ProtocolError: no such tensor, or not 1-D.
        codec.CodecError: the frames cannot be decoded.
    """
    tree = codec.decode(payload)
    if name not in tree:
        raise ProtocolError("malformed", f"payload has no {name!r} tensor")
    values = np.asarray(tree[name])
    if values.ndim != 1:
        raise ProtocolError("bad_shape", f"{name} must be 1-D, got {values.shape}")
    return values.astype(np.float32, copy=False)


def snapshot_values(header: dict[str, Any], payload: list[Any], size: int | None) -> np.ndarray:
    """The values of a `snapshot_reply`.

    Args:
        header: the reply header (fragment, version, seq).
        payload: its codec frames, {"values": 1-D vector}.
        size: the fragment's size by the reader's plan (None: not checked).

    Returns:
        The fragment's exact fp32 values.

    Raises:
        ProtocolError: no values, not 1-D, or not `size` elements.
        codec.CodecError: the frames cannot be decoded.
    """
    values = fragment_vector(payload)
    if size is not None and values.shape != (size,):
        raise ProtocolError(
            "bad_shape", f"snapshot of fragment {header['fragment']}: {values.shape}, want {size}"
        )
    return values
