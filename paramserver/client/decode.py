"""What a client accepts from a shard's snapshot replies and published updates.

This module owns, with no sockets, the decoding of the fragment vectors a
shard sends an island (snapshot replies on the DEALER, updates on the SUB)
and their checks against the island's plan: an unusable message raises
`protocol.ProtocolError` (counted and dropped), an update that does not fit
the plan raises `Resync` (the shard is snapshotted again).
"""

from __future__ import annotations

import numpy as np

import codec
from paramserver.client.replica import MODES, Published, Resync
from paramserver.wire import protocol
from paramserver.wire.plan import Plan


def snapshot_values(header: dict, payload: list, plan: Plan | None) -> np.ndarray:
    """The values of a snapshot reply.

    Args:
        header: the snapshot_reply header (fragment, version, seq).
        payload: its codec frames, {"values": 1-D vector}.
        plan: the island's plan (None: shapes not checked).

    Returns:
        The fragment's values, 1-D float32.

    Raises:
        ProtocolError: no values, not 1-D, or not the fragment's size.
        CodecError: the frames cannot be decoded.
    """
    values = _vector(payload, "values")
    fragment = header["fragment"]
    if plan is not None and fragment < plan.num_fragments:
        size = plan.fragments[fragment].size
        if values.shape != (size,):
            raise protocol.ProtocolError(
                "bad_shape", f"snapshot of fragment {fragment}: {values.shape}, want {size}"
            )
    return values


def published_update(header: dict, payload: list, plan: Plan | None) -> Published:
    """A published update, decoded.

    Args:
        header: the update header (seq, fragment, version, mode).
        payload: its codec frames, {"values": 1-D vector}.
        plan: the island's plan (None: shapes not checked).

    Returns:
        The update, its values 1-D float32.

    Raises:
        Resync: a fragment the plan does not have, or values of another size.
        ProtocolError: no values, not 1-D, or an unknown mode.
        CodecError: the frames cannot be decoded.
    """
    fragment = header["fragment"]
    values = _vector(payload, "values")
    if plan is not None and (
        fragment >= plan.num_fragments or values.shape != (plan.fragments[fragment].size,)
    ):
        raise Resync(f"update of fragment {fragment} with shape {values.shape}")
    if header["mode"] not in MODES:
        raise protocol.ProtocolError("malformed", f"update mode {header['mode']!r}")
    return Published(header["seq"], fragment, header["version"], header["mode"], values)


def _vector(payload: list, name: str) -> np.ndarray:
    """Decode codec frames holding {name: 1-D vector} into float32."""
    tree = codec.decode(payload)
    if name not in tree:
        raise protocol.ProtocolError("malformed", f"payload has no {name!r} tensor")
    values = np.asarray(tree[name])
    if values.ndim != 1:
        raise protocol.ProtocolError("bad_shape", f"{name} must be 1-D, got {values.shape}")
    return values.astype(np.float32, copy=False)
