"""Reading a fragment's values from a shard: the snapshot request and the checks of its reply.

This module owns the part of the protocol conversation that every reader of
a shard's parameters shares (the island's client when it joins or re-syncs,
and `paramserver.plumbing.probe` when an operator reads the global model): the
`snapshot` request header, the decoding of the fp32 vectors a shard sends
(`snapshot_reply` and published `update` payloads, codec frames holding
{"values": 1-D vector}), and the assembly of a fragment read in pieces
(`SnapshotPieces`: every piece from one version of the fragment). No I/O; an
unusable reply raises `ProtocolError`, undecodable frames `codec.CodecError`.
docs/protocol.md (section 3.3) is the spec.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import codec
from paramserver.wire import protocol
from paramserver.wire.protocol import ProtocolError


def snapshot_request(
    island: str,
    fragment: int,
    rid: int | None = None,
    piece: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """The header of a `snapshot` request.

    Args:
        island: the asking island's id (any valid id; no hello is needed).
        fragment: the fragment index.
        rid: the request id the reply echoes (None: no id).
        piece: (offset, count) of the elements asked (None: the whole fragment).

    Returns:
        A header for `protocol.pack`.
    """
    header: dict[str, Any] = {"kind": "snapshot", "island": island, "fragment": fragment}
    if rid is not None:
        header["id"] = rid
    if piece is not None:
        header["offset"], header["count"] = piece
    return header


class SnapshotPieces:
    """One fragment read in pieces: the pieces to ask, and the values once all are of one version.

    Pieces are answered at the fragment's version of the moment; when a piece
    comes back at a newer version than the ones held, those are asked again
    (and a piece older than the newest is asked again itself), so the result
    is one version of the fragment, bit for bit. A reader that keeps no values
    (`values=False`) asks one piece of one element: its reply carries the
    fragment's version and seq all the same.
    """

    def __init__(
        self, fragment: int, size: int, max_message_bytes: int, values: bool = True
    ) -> None:
        """Cut the fragment into pieces that fit one reply.

        Args:
            fragment: the fragment index.
            size: its element count by the reader's plan.
            max_message_bytes: the shard's limit (its welcome's `max_message_bytes`).
            values: False: read only the version and seq (the result's values are None).
        """
        self.fragment, self.size = fragment, size
        if values:
            self.pieces = protocol.pieces(size, protocol.piece_elements(max_message_bytes))
        else:
            self.pieces = [(0, 1)]
        self.values = np.empty(size if values else 1, np.float32)
        self._keep = values
        self._got: dict[int, tuple[int, int]] = {}  # offset -> (version, seq) of pieces held
        self._count = dict(self.pieces)  # offset -> count

    @property
    def complete(self) -> bool:
        """Whether every piece is held, all of one version."""
        return len(self._got) == len(self.pieces)

    def result(self) -> tuple[int, int, np.ndarray | None]:
        """(version, seq, values) of a complete read; seq is the smallest of its pieces'.

        values is None for a read made with `values=False`.
        """
        version = next(iter(self._got.values()))[0]
        seq = min(s for _, s in self._got.values())
        return version, seq, self.values if self._keep else None

    def take(self, header: dict[str, Any], payload: list[Any]) -> list[tuple[int, int]]:
        """Take one `snapshot_reply` of this fragment.

        Args:
            header: the reply header (fragment, version, seq, offset, size).
            payload: its codec frames.

        Returns:
            The pieces (offset, count) to ask again (held ones of an older version,
            or this one when it is older than those held).

        Raises:
            ProtocolError: not a piece that was asked, or of another fragment size.
            codec.CodecError: the frames cannot be decoded.
        """
        offset = header.get("offset", 0)
        if offset not in self._count or header.get("size", self.size) != self.size:
            raise ProtocolError(
                "bad_shape",
                f"snapshot piece at offset {offset} of fragment {self.fragment} "
                f"(size {header.get('size')}) was not asked; its size is {self.size}",
            )
        count = self._count[offset]
        values = snapshot_values(header, payload, count)
        version, seq = header["version"], header["seq"]
        newest = max((v for v, _ in self._got.values()), default=version)
        if version < newest:
            return [(offset, count)]
        again = [(o, self._count[o]) for o, (v, _) in self._got.items() if v < version]
        for o, _ in again:
            del self._got[o]
        self.values[offset : offset + count] = values
        self._got[offset] = (version, seq)
        return again


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
            "bad_shape",
            f"snapshot of fragment {header['fragment']}: {values.shape} elements, want {size}",
        )
    return values
