"""One shard's init in pieces, as the join's handshake sends it: `init_begin`, then the pieces.

This module owns, with no I/O and no clock, the client's side of an init in
pieces (docs/protocol.md section 3.2): `Upload` cuts the shard's fragments
into pieces that fit the shard's `max_message_bytes`
(`protocol.piece_elements`), asks `init_begin`, then keeps `WINDOW` pieces
(or one per bulk link, if more) in flight, each gathered from the island's
parameters only when it is sent (so the island holds at most that many
pieces of encoded values). A lost piece or
reply is re-sent by the join on its timeout (pieces are idempotent); a
`not_initialized` (the shard dropped our unfinished init: another island took
it over after our silence) starts the upload over, at most `RESTARTS` times.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import codec
from paramserver.client.types import ClientError, PlanMismatch
from paramserver.wire import protocol
from paramserver.wire.plan import Plan

WINDOW = 2  # pieces in flight per shard (the join asks `shards.pieces_in_flight`)
RESTARTS = 3  # uploads started over (our unfinished init was dropped) before the join fails
_RAW = codec.raw("float32")

DONE, LOST, MORE = "done", "lost", "more"  # what a reply means to the handshake


@dataclass(frozen=True)
class Ask:
    """A request the join wants sent to one shard (the core adds `id` and `island`)."""

    shard: int
    kind: str  # "hello", "init_begin" or "init_piece"
    payload: list[Any] = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)


class Upload:
    """The init in pieces of one shard (see the module docstring)."""

    def __init__(
        self,
        plan: Plan,
        flat: Mapping[str, np.ndarray],
        shard: int,
        max_message_bytes: int,
        window: int = WINDOW,
    ) -> None:
        """Cut the shard's fragments into pieces.

        Args:
            plan: the island's plan.
            flat: path -> the island's parameters (the values sent).
            shard: the shard to initialise.
            max_message_bytes: the size each piece is cut to fit (the shard's limit, its
                welcome's, or less: `shards.pieces_in_flight`).
            window: pieces in flight (>= 1; one per bulk link fills them all).
        """
        self.plan, self._flat, self.shard = plan, flat, shard
        self._window = max(1, window)
        per = protocol.piece_elements(max_message_bytes)
        self._pieces = [
            (f.index, offset, count)
            for f in plan.fragments_of(shard)
            for offset, count in protocol.pieces(f.size, per)
        ]
        self._next = 0  # the first piece not sent yet
        self._restarts = 0

    @property
    def total(self) -> int:
        """How many pieces the shard's init takes."""
        return len(self._pieces)

    def begin(self) -> list[Ask]:
        """The first request: `init_begin` with the plan."""
        self._next = 0
        return [Ask(self.shard, "init_begin", [], {"plan": self.plan.to_wire()})]

    def on_reply(self, header: dict) -> tuple[str, list[Ask]]:
        """Take the reply to one of the upload's requests.

        Args:
            header: the reply header.

        Returns:
            (MORE | DONE | LOST, the requests to send next): DONE once `init_ok`
            came, LOST when another island initialises the shard
            (`already_initialized`: check its plan with a hello).

        Raises:
            ClientError: any other refusal (plan mismatch, a bad piece, storage).
        """
        kind = header["kind"]
        if kind == "init_ok":
            return DONE, []
        if kind == "init_begun":
            return MORE, [self._piece() for _ in range(self._window) if self._next < self.total]
        if kind == "init_piece_ok":
            return MORE, [self._piece()] if self._next < self.total else []
        reason, detail = header.get("reason"), header.get("detail")
        if reason == "already_initialized":
            return LOST, []
        if reason == "not_initialized" and self._restarts < RESTARTS:
            self._restarts += 1
            return MORE, self.begin()
        if reason == "plan_mismatch":
            raise PlanMismatch(
                f"join: plan mismatch: {detail}", island_hash=self.plan.hash, detail=str(detail)
            )
        raise ClientError(f"join: shard {self.shard} refused init: {reason}: {detail}")

    def _piece(self) -> Ask:
        fragment, offset, count = self._pieces[self._next]
        self._next += 1
        values = self.plan.gather_piece(self._flat, fragment, offset, count)
        frames, _ = _RAW.encode({"values": values}, None)
        fields = {"plan_hash": self.plan.hash, "fragment": fragment, "offset": offset}
        return Ask(self.shard, "init_piece", list(frames), fields)
