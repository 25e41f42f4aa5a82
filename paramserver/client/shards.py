"""The connections to the shards as the client's core sees them: links, flows, requests in flight.

This module owns, with no I/O, the bookkeeping under the client's core
(`paramserver.client.core`) and the rules of its connections
(docs/protocol.md section 1, "Control and bulk connections").

The links: an island's control DEALER carries hello, heartbeats, status and
bye; its bulk DEALERs carry `BULK_KINDS`, so that a long push never delays a
heartbeat. One TCP flow's window is what the kernel lets its socket buffers
grow to (autotuning up to net.ipv4.tcp_wmem/tcp_rmem's maximum, 4 MiB by
default), so a link whose bandwidth-delay product is larger needs several
flows or larger buffers: `bulk_flows` picks the count, `flow_buffer_bytes`
the buffer of each (`paramserver.client.links.Links` applies it as ZeroMQ
SNDBUF/RCVBUF). `Flows` puts each bulk message, whole, on the flow with the
fewest bytes in flight and knows what a flow that died was carrying;
`pieces_in_flight` sizes the init and snapshot pieces so that every flow
carries one.

The shards: `ShardLink` (endpoints, links, liveness and update stream of one
shard) and `Shards`, which numbers links and request ids, keeps the tracked
requests (id -> what was asked), builds the messages (every request carries
the island id, every hello the client's session) and collects the effects
(`Open`, `Close`, `Send`, below) the core returns. A shard's snapshot goes in
pieces that fit its `max_message_bytes` (`SnapshotRead`, `pieces_in_flight`:
two in flight, or one per bulk link). Bulk requests go on the attached bulk
link with the fewest bytes in flight (`Flows`); a bulk link whose connection
died is replaced and what it carried is sent again on the others
(`on_link_down`).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from paramserver.client.types import FLOW_WINDOW_BYTES, MAX_BULK_LINKS, bulk_flows  # noqa: F401
from paramserver.wire import protocol
from paramserver.wire.plan import Plan
from paramserver.wire.snapshot import SnapshotPieces, snapshot_request

# an annotation only (the replica's module is not needed to move bytes)
if TYPE_CHECKING:
    from paramserver.client.replica import ShardFeed


# What travels on a bulk link once one is attached; everything else on the control link.
BULK_KINDS = frozenset({"push", "snapshot", "init", "init_begin", "init_piece"})
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


logger = logging.getLogger(__name__)


@dataclass
class SnapshotRead:
    """A shard's fragments being read in pieces: what is held, what is still to ask."""

    fragments: dict[int, SnapshotPieces]
    queue: list[tuple[int, int, int]] = field(default_factory=list)  # (fragment, offset, count)
    in_flight: int = 0


@dataclass
class ShardLink:
    """One shard as the client sees it: its endpoints, links, liveness and update stream."""

    index: int
    router: str
    pub: str
    dealer: int | None = None  # link of its (control) DEALER
    bulk: list[int] = field(default_factory=list)  # links of its bulk DEALERs
    attached: set[int] = field(default_factory=set)  # bulk links attached since the last welcome
    # attached bulk links whose attach was welcomed
    confirmed: set[int] = field(default_factory=set)
    welcomed: bool = False  # its control link was welcomed (bulk links may attach)
    flows: Flows = field(default_factory=Flows)  # what its bulk links carry
    sub: int | None = None  # link of its SUB
    heard: float = 0.0  # last message on the DEALER
    sub_heard: float = 0.0  # last message on the SUB
    up: bool = True
    attempt: int = 0  # reconnects since the shard was last heard
    next_reconnect: float = 0.0
    next_heartbeat: float = 0.0
    feed: ShardFeed | None = None


class Shards:
    """Every shard of one client (`all`, by index), their links and the requests in flight."""

    def __init__(self, island: str, session: str, values: bool = True, bulk_links: int = 0) -> None:
        """Start with no shard and no link.

        Args:
            island: the island id every request carries.
            session: the token every hello carries.
            values: False: snapshots read only each fragment's version (no replica).
            bulk_links: bulk DEALERs per shard beside the control one (0: one
                DEALER per shard carries everything).
        """
        self.island = island
        self.session = session
        self.values = values
        self.bulk_links = bulk_links
        self.all: list[ShardLink] = []
        self.requests: dict[int, tuple[str, int, int]] = {}  # id -> (kind, shard, fragment)
        self._links: dict[int, tuple[Role, ShardLink]] = {}
        self._next_link = 0
        self._next_id = 0
        self._out: list[Effect] = []
        self.max_message_bytes = (
            protocol.DEFAULT_MAX_MESSAGE_BYTES
        )  # the shards' limit (their welcome's)
        self.reads: dict[int, SnapshotRead] = {}  # shard index -> its snapshot in pieces

    @property
    def has_links(self) -> bool:
        """Whether any link is open."""
        return bool(self._links)

    def owner(self, link: int) -> tuple[Role, ShardLink] | None:
        """(role, shard) of an open link, or None (closed or never opened)."""
        return self._links.get(link)

    def new_id(self) -> int:
        """A fresh request id."""
        self._next_id += 1
        return self._next_id

    def open(self, shard: ShardLink, role: Role) -> None:
        """Give `shard` a fresh link of `role` (the old one, if any, is closed).

        A fresh DEALER comes with fresh bulk links (`bulk_links`), attached
        once the control link is welcomed.
        """
        old = shard.dealer if role == "dealer" else shard.sub
        closing = [old] if old is not None else []
        if role == "dealer":
            closing += shard.bulk
            shard.bulk, shard.attached, shard.confirmed = [], set(), set()
            shard.welcomed = False
            shard.flows.clear()  # the reconnect's welcome re-sends the shard's deltas
        for link in closing:
            self._links.pop(link, None)
            self._out.append(Close(link))
        link = self._new_link(role, shard, shard.router if role == "dealer" else shard.pub)
        if role == "dealer":
            shard.dealer = link
            shard.bulk = [self._new_link("bulk", shard, shard.router)
                          for _ in range(self.bulk_links)]  # fmt: skip
        else:
            shard.sub = link

    def _new_link(self, kind: str, shard: ShardLink, endpoint: str) -> int:
        self._next_link += 1
        link = self._next_link
        self._links[link] = ("sub" if kind == "sub" else "dealer", shard)
        self._out.append(Open(link, kind, endpoint))  # type: ignore[arg-type]
        return link

    def on_link_reply(self, shard: ShardLink, link: int, header: dict) -> bool:
        """Keep the bulk links attached; called with every reply on a shard's DEALERs.

        A `welcome` on the control link (a join's hello, a reconnect's, a
        rejoin's) attaches every bulk link not attached: a hello with `attach`
        on each, after which bulk requests use it. A refused attach, or an
        `unknown_island` on a bulk link, leaves that link unused until the
        next welcome (the core says hello on the control link for the latter);
        an `island_in_use` on a bulk link (a restarted shard bound the island to
        the control link's hello) is read as `unknown_island`: not a final
        refusal.

        Args:
            shard: the shard it came from.
            link: the link it came on.
            header: the reply's header.

        Returns:
            True when the reply was the answer to an attach (nothing else to do).
        """
        kind, rid = header["kind"], header.get("id")
        if isinstance(rid, int):
            shard.flows.release(rid)  # answered: no longer in flight
        if kind == "ack" and "fragment" in header and "round" in header:
            shard.flows.release((header["fragment"], header["round"]))
        if link == shard.dealer:
            if kind == "welcome":
                shard.welcomed = True
                self._attach(shard)
            return False
        asked = self.requests.get(rid) if isinstance(rid, int) else None
        if asked is not None and asked[0] == "attach":
            del self.requests[rid]
            if kind == "welcome":
                shard.confirmed.add(link)
            else:
                shard.attached.discard(link)
                logger.warning(
                    "shard %d refused a bulk link: %s: %s",
                    shard.index, header.get("reason"), header.get("detail"),
                )  # fmt: skip
            return True
        if header.get("reason") in ("unknown_island", "island_in_use"):
            # the shard does not hold this bulk link as the island's: it forgot the island,
            # or it restarted and holds only the control link's hello (island_in_use).
            # Either way what it refused is pending as after `unknown_island`: the core
            # says hello on the control link, whose welcome re-attaches and re-sends.
            shard.attached.discard(link)
            shard.confirmed.discard(link)
            header["reason"] = "unknown_island"
        return False

    def on_link_down(self, shard: ShardLink, link: int) -> None:
        """The connection of one of `shard`'s bulk links died (the control link: no-op).

        ZeroMQ would reconnect it as a connection the shard does not hold as
        the island's, and what was on its way is lost: the link is closed
        instead, and what it carried unanswered (`Flows.drop`) is sent again
        on the other links. A link whose attach had been welcomed is replaced
        at once by a fresh one, attached before those re-sends; any other
        (the shard may be going away) is replaced at the next welcome of the
        control link, so that a peer that drops every connection is not
        reconnected in a loop. Nothing about exactly-once changes: a push is
        deduplicated by its key whatever link it travels on.

        Args:
            shard: the shard whose link it is.
            link: the link whose connection died.
        """
        if link not in shard.bulk:
            return
        replace_now = link in shard.confirmed and shard.welcomed
        lost = shard.flows.drop(link)
        shard.bulk.remove(link)
        shard.attached.discard(link)
        shard.confirmed.discard(link)
        self._links.pop(link, None)
        self._out.append(Close(link))
        if replace_now:
            self._attach(shard)
        for what, nbytes, frames in lost:
            if isinstance(what, tuple):  # a push, by its ledger key
                self.send_frames(shard, frames, key=what)
            else:  # a request (a snapshot's, an init's), by its id: its reply matches it
                self.send_frames(shard, frames, kind="snapshot", rid=what, load=nbytes)

    def _attach(self, shard: ShardLink) -> None:
        """Attach every bulk link not attached, first opening any missing of `bulk_links`."""
        while len(shard.bulk) < self.bulk_links:
            shard.bulk.append(self._new_link("bulk", shard, shard.router))
        for link in [link for link in shard.bulk if link not in shard.attached]:
            rid = self.new_id()
            self.requests[rid] = ("attach", shard.index, -1)
            header = {"kind": "hello", "id": rid, "island": self.island,
                      "session": self.session, "attach": True}  # fmt: skip
            self._out.append(Send(link, protocol.pack(header)))
            shard.attached.add(link)  # what follows on the link comes after the attach

    def link_for(self, shard: ShardLink, kind: str) -> int:
        """The link a request of `kind` goes on (-1: the shard has no DEALER).

        Args:
            shard: the shard.
            kind: the request's kind.

        Returns:
            For BULK_KINDS the attached bulk link with the fewest bytes in flight
            (`Flows.pick`) when there is one, else the control link.
        """
        if kind in BULK_KINDS and shard.attached:
            return shard.flows.pick([link for link in shard.bulk if link in shard.attached])
        return -1 if shard.dealer is None else shard.dealer

    def close_all(self) -> None:
        """Close every link, forget every shard and request."""
        self._out.extend(Close(link) for link in self._links)
        self._links.clear()
        self.requests.clear()
        for shard in self.all:
            shard.flows.clear()
        self.all = []

    def send(
        self, shard: ShardLink, header: dict, payload: list[Any] = (), load: int | None = None
    ) -> list[Any]:
        """Send one message on a shard's DEALER (adds `island`, and `session` to a hello).

        Args:
            shard: the shard.
            header: the request's header (a bulk one with an `id` is carried until its reply).
            payload: its payload frames.
            load: the bytes it puts in flight on a bulk link (None: its own size;
                a snapshot request: the reply's).

        Returns:
            The packed frames.
        """
        if header["kind"] == "hello":
            header = {**header, "session": self.session}
        frames = protocol.pack({"island": self.island, **header}, list(payload))
        self.send_frames(shard, frames, kind=header["kind"], rid=header.get("id"), load=load)
        return frames

    def send_frames(
        self,
        shard: ShardLink,
        frames: list[Any],
        key: Hashable | None = None,
        *,
        kind: str = "hello",
        rid: Any = None,
        load: int | None = None,
    ) -> None:
        """Send packed frames on the link their kind goes on (`link_for`).

        Args:
            shard: the shard.
            frames: the packed message.
            key: a push's ledger key (fragment, round) (its `kind` is then "push").
            kind: the request's kind (a re-send of the join's: its own).
            rid: the request's id, if it has one.
            load: see `send`.
        """
        if key is not None:
            kind, rid = "push", key
        link = self.link_for(shard, kind)
        if link in shard.attached and rid is not None:
            nbytes = protocol.message_bytes(frames) if load is None else load
            shard.flows.carry(rid, link, nbytes, frames)
        self._out.append(Send(link, frames, key))

    def request(self, shard: ShardLink, kind: str, about: int = -1, **fields: Any) -> None:
        """Send a tracked request (`about`: its fragment, if any); the reply is matched by id."""
        rid = self.new_id()
        self.requests[rid] = (kind, shard.index, about)
        self.send(shard, {"kind": kind, "id": rid, **fields})

    def request_snapshots(self, shard: ShardLink, now: float, plan: Plan) -> None:
        """Start (or restart) a snapshot of every fragment of `shard` (its feed must exist).

        Args:
            shard: the shard.
            now: current time (the feed times the sync out).
            plan: the island's plan (the fragments' sizes).
        """
        for rid in [
            r for r, (k, s, _) in self.requests.items() if (k, s) == ("snapshot", shard.index)
        ]:
            del self.requests[rid]  # replies to an earlier read are ignored
            shard.flows.release(rid)
        _, limit = pieces_in_flight(self.bulk_links, self.max_message_bytes)
        read = SnapshotRead(
            {
                f: SnapshotPieces(f, plan.fragments[f].size, limit, self.values)
                for f in shard.feed.begin_sync(now)
            }
        )
        read.queue = [(f, o, n) for f, p in read.fragments.items() for o, n in p.pieces]
        self.reads[shard.index] = read
        self._ask_pieces(shard, read)

    def on_snapshot_piece(
        self, shard: ShardLink, header: dict, payload: list[Any]
    ) -> tuple[int, int, int, np.ndarray | None] | None:
        """Take one `snapshot_reply` (to a tracked request); ask the next pieces.

        Args:
            shard: the shard it came from.
            header: the reply header.
            payload: its codec frames.

        Returns:
            (fragment, version, seq, values) once that fragment is complete, else None
            (values None when reading versions only).

        Raises:
            ProtocolError, codec.CodecError: an unusable piece (it is asked again first).
        """
        read = self.reads.get(shard.index)
        pieces = read.fragments.get(header["fragment"]) if read is not None else None
        if pieces is None:
            return None
        read.in_flight -= 1
        try:
            again = pieces.take(header, payload)
        except Exception:
            offset = header.get("offset", 0)
            read.queue[:0] = [(pieces.fragment, o, n) for o, n in pieces.pieces if o == offset]
            self._ask_pieces(shard, read)
            raise
        read.queue[:0] = [(pieces.fragment, o, n) for o, n in again]
        self._ask_pieces(shard, read)
        if not pieces.complete:
            return None
        del read.fragments[pieces.fragment]
        return (pieces.fragment, *pieces.result())

    def _ask_pieces(self, shard: ShardLink, read: SnapshotRead) -> None:
        window, _ = pieces_in_flight(self.bulk_links, self.max_message_bytes)
        while read.queue and read.in_flight < window:
            fragment, offset, count = read.queue.pop(0)
            rid = self.new_id()
            self.requests[rid] = ("snapshot", shard.index, fragment)
            reply_bytes = 4 * count if self.values else 64  # what the reply brings back
            request = snapshot_request(self.island, fragment, rid, (offset, count))
            self.send(shard, request, load=reply_bytes)
            read.in_flight += 1

    def forget_requests(self, shard: int) -> None:
        """Drop the tracked requests to `shard` (its DEALER was replaced)."""
        for rid in [r for r, (_, s, _) in self.requests.items() if s == shard]:
            del self.requests[rid]

    def flush(self) -> list[Effect]:
        """The effects collected since the last flush."""
        out, self._out = self._out, []
        return out


# -- the effects ---------------------------------------------------------------------------
# What the core asks its I/O loop to do: open, close and send on numbered links. A *link*
# is one socket, named by a number the core picks: a DEALER to a shard's ROUTER or a SUB
# to its PUB. The I/O loop (`paramserver.client.io_thread.IOThread`) keeps a socket per open link,
# performs the effects in order, reports each `Send` back (`ClientCore.on_sent`), and
# hands the core every message with the link it came in on.


Role = Literal["dealer", "sub"]


@dataclass(frozen=True)
class Open:
    """Open link `link` to `endpoint`: a DEALER (`role` "dealer"), a bulk DEALER ("bulk":
    its socket buffers sized for the link) or a subscribe-all SUB ("sub")."""

    link: int
    role: Literal["dealer", "bulk", "sub"]
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
