"""How many connections a client keeps per shard, what travels on which, and their buffers.

Pure rules, no sockets (docs/protocol.md section 1, "Control and bulk
connections"): an island's control DEALER carries hello, heartbeats, status
and bye; its bulk DEALERs carry `BULK_KINDS`, so that a long push never
delays a heartbeat. One TCP flow's window is what the kernel lets its socket
buffers grow to (autotuning up to net.ipv4.tcp_wmem/tcp_rmem's maximum, 4 MiB
by default), so a link whose bandwidth-delay product is larger needs several
flows or larger buffers: `bulk_flows` picks the count, `flow_buffer_bytes`
the buffer of each (`paramserver.client.io_thread.Links` applies it as ZeroMQ
SNDBUF/RCVBUF). `Flows` puts each bulk message, whole, on the flow with the
fewest bytes in flight and knows what a flow that died was carrying;
`pieces_in_flight` sizes the init and snapshot pieces so that every flow
carries one.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

# What travels on a bulk link once one is attached; everything else on the control link.
BULK_KINDS = frozenset({"push", "snapshot", "init", "init_begin", "init_piece"})
FLOW_WINDOW_BYTES = 4 * 1024 * 1024  # what one TCP flow's autotuned window reaches (tcp_wmem)
MAX_BULK_LINKS = 8  # bulk links per shard at most (the shard attaches up to 16)


def bulk_flows(control_link: bool, bulk_links: int, bdp_bytes: int) -> int:
    """How many bulk links per shard a client opens.

    Args:
        control_link: whether control traffic gets a connection of its own.
        bulk_links: the configured count; 0 = from `bdp_bytes`.
        bdp_bytes: the links' bandwidth-delay product (0: unknown).

    Returns:
        0 without a control link (one connection carries everything), else
        `bulk_links`, or ceil(bdp_bytes / FLOW_WINDOW_BYTES) clamped to
        [1, MAX_BULK_LINKS] when it is 0.
    """
    if not control_link:
        return 0
    if bulk_links > 0:
        return bulk_links
    return max(1, min(MAX_BULK_LINKS, -(-bdp_bytes // FLOW_WINDOW_BYTES)))


PIECE_WINDOW = 2  # init and snapshot pieces in flight per shard over one bulk flow


def pieces_in_flight(flows: int, max_message_bytes: int) -> tuple[int, int]:
    """How many init or snapshot pieces a client keeps in flight per shard, and their size.

    One per bulk flow (at least `PIECE_WINDOW`), so that every flow carries
    one; cut smaller so that they hold no more than `PIECE_WINDOW` pieces of
    the largest size would: the shard counts an island's unread snapshot
    replies against 2 x max_message_bytes (docs/protocol.md section 8), and
    the island holds its init pieces encoded.

    Args:
        flows: bulk links per shard (0: one connection carries everything).
        max_message_bytes: the shards' message limit (their welcome's).

    Returns:
        (pieces in flight, the message limit each piece is cut to).
    """
    window = max(PIECE_WINDOW, flows)
    return window, max(1, max_message_bytes * PIECE_WINDOW // window)


def flow_buffer_bytes(bdp_bytes: int, flows: int, kernel_max: int) -> int:
    """The SNDBUF/RCVBUF of one bulk socket: its share of the bandwidth-delay product.

    Setting a buffer turns the kernel's autotuning off for that socket and is
    capped by net.core.wmem_max / rmem_max, so it is set only when it helps.

    Args:
        bdp_bytes: the links' bandwidth-delay product (0: unknown).
        flows: bulk links per shard (>= 1).
        kernel_max: the smaller of the kernel's wmem_max and rmem_max.

    Returns:
        ceil(bdp_bytes / flows) plus a quarter for headroom, when that exceeds
        FLOW_WINDOW_BYTES (what autotuning reaches) and fits `kernel_max`;
        else 0 (leave the kernel's autotuning).
    """
    if bdp_bytes <= 0:
        return 0
    share = -(-bdp_bytes // max(1, flows))
    share += share // 4
    return share if FLOW_WINDOW_BYTES < share <= kernel_max else 0


class Flows:
    """What the bulk links of one shard carry now: bytes in flight per link, and by what.

    A request is *carried* from its send until its reply (a push: until its
    ack): `pick` sends the next one on the attached link with the fewest bytes
    in flight (ties in turn), so that a round's pushes, a snapshot's and an
    init's pieces spread over every flow at once; `drop` hands back what a
    link that died was carrying, to be sent again on another. Each item is
    named by `what` (a push: its ledger key; a request: its id) and is one
    whole message: the unit of striping (docs/protocol.md section 1).
    """

    def __init__(self) -> None:
        """Start with nothing in flight."""
        self.load: dict[int, int] = {}  # link -> bytes in flight on it
        # what -> (link, bytes in flight, frames): until its reply
        self._carried: dict[Hashable, tuple[int, int, list[Any]]] = {}
        self._turn = 0  # where the next tie is broken

    def pick(self, links: Sequence[int]) -> int:
        """The link of `links` (non-empty) with the fewest bytes in flight; ties in turn."""
        n = len(links)
        best = min(range(n), key=lambda i: (self.load.get(links[i], 0), (i - self._turn) % n))
        self._turn = best + 1
        return links[best]

    def carry(self, what: Hashable, link: int, nbytes: int, frames: list[Any]) -> None:
        """`what` (`nbytes` on the wire or back) was sent on `link`; a copy elsewhere is moved."""
        self.release(what)
        self._carried[what] = (link, nbytes, frames)
        self.load[link] = self.load.get(link, 0) + nbytes

    def release(self, what: Hashable) -> None:
        """`what` was answered (or is no longer wanted): its bytes leave its link's load."""
        held = self._carried.pop(what, None)
        if held is not None:
            self.load[held[0]] -= held[1]

    def drop(self, link: int) -> list[tuple[Hashable, int, list[Any]]]:
        """Forget `link` (it died or was closed).

        Returns:
            (what, bytes, frames) of each message it was carrying, in the order they were sent.
        """
        self.load.pop(link, None)
        lost = [(what, n, frames) for what, (at, n, frames) in self._carried.items() if at == link]
        for what, _, _ in lost:
            del self._carried[what]
        return lost

    def clear(self) -> None:
        """Forget everything (every link was closed)."""
        self.load.clear()
        self._carried.clear()
