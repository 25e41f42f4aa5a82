"""Deltas a client cannot deliver now: handed back at close, and warned about when refused.

This module owns two small rules of the client's I/O thread
(`paramserver.client.io_thread`) about undelivered deltas: `requests_of` turns the
packed messages the ledger (`paramserver.client.outbox`) still holds at close back
into `PushRequest`s, which `Client.unacked` hands to the caller (an island
writes them to its outbox file and pushes them again when it restarts); and
`StorageWarning` logs, at most once a minute per shard, that a shard refuses
deltas with `storage_error` (they are kept and re-sent after the back-off).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from paramserver.client.types import PushRequest
from paramserver.wire import protocol

logger = logging.getLogger(__name__)

STORAGE_WARNING_EVERY_S = 60.0  # one warning per shard per minute while its disk fails


def requests_of(messages: Sequence[Sequence[Any]]) -> list[PushRequest]:
    """The deltas of packed push messages, with their frames copied to bytes.

    Args:
        messages: push messages as `protocol.pack` built them ([header, *codec frames]).

    Returns:
        One `PushRequest` per message, in the same order.
    """
    out = []
    for frames in messages:
        header, payload = protocol.unpack(frames, protocol.REQUEST)
        out.append(
            PushRequest(
                header["fragment"],
                header["round"],
                header["base_version"],
                header["tokens"],
                header["steps"],
                [memoryview(frame).tobytes() for frame in payload],
            )
        )
    return out


class StorageWarning:
    """Logs a shard's `storage_error` refusals at most once per `STORAGE_WARNING_EVERY_S`."""

    def __init__(self) -> None:
        """Start with no warning given."""
        self._last: dict[int, float] = {}

    def note(self, shard: int, ack: dict, now: float) -> bool:
        """Look at an ack that kept its delta for later; warn if it says storage_error.

        Args:
            shard: the shard's index.
            ack: the ack header (reason, detail).
            now: monotonic time.

        Returns:
            Whether a warning was logged.
        """
        if ack.get("reason") != "storage_error":
            return False
        last = self._last.get(shard)
        if last is not None and now - last < STORAGE_WARNING_EVERY_S:
            return False
        self._last[shard] = now
        logger.warning(
            "shard %d cannot store deltas (storage_error: %s); they are kept and re-sent "
            "after the back-off",
            shard,
            ack.get("detail", "no detail"),
        )
        return True
