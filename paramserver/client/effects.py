"""What the client's core asks its I/O loop to do: open, close and send on numbered links.

This module owns the three effects that `paramserver.client.core.ClientCore`
returns and nothing else. A *link* is one socket, named by a number the core
picks: a DEALER to a shard's ROUTER or a SUB to its PUB. The I/O loop
(`paramserver.client.io_thread`) keeps a socket per open link, performs the
effects in order, reports each `Send` back (`ClientCore.on_sent`), and hands
the core every message with the link it came in on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Role = Literal["dealer", "sub"]


@dataclass(frozen=True)
class Open:
    """Open link `link`: a DEALER (`role` "dealer") or a subscribe-all SUB to `endpoint`."""

    link: int
    role: Role
    endpoint: str


@dataclass(frozen=True)
class Close:
    """Close link `link` (linger 0); messages still queued on it are never delivered."""

    link: int


@dataclass(frozen=True)
class Send:
    """Send `frames` on the DEALER of link `link` without blocking.

    `key` names the ledger's delta when the message is a push, so that
    `ClientCore.on_sent` records whether it went out.
    """

    link: int
    frames: list[Any]
    key: tuple[int, int] | None = None


Effect = Open | Close | Send
