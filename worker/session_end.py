"""How a session ends: `close` from its own thread, `abandon` from the watchdog's.

`SessionEnd` is a part of `worker.session.Session` (a base class that holds no
state of its own). `close` pushes the partial round, waits for the exchange's
collectives, then flushes the client, keeps what stays unacked in the outbox
(`worker.outbox`), writes the final metrics row and releases the island id and
the data dir's token. `abandon` (another process of the island is gone) closes
the client first, which ends any wait of `step` with `SessionClosed`, then takes
the session's lock and does the same without collectives.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from paramserver.client import Client, PushRequest
from worker import session_token
from worker.config import IslandConfig
from worker.deltas import DeltaLedger
from worker.leader_sync import LeaderSync
from worker.outbox import Outbox
from worker.param_tree import TreeLayout
from worker.push_thread import PushThread, flush_fragments

logger = logging.getLogger(__name__)

STOPPED_FLUSH_S = 2.0
"""The longest a session whose `stop` is set (Ctrl-C) waits at close for acks: what stays
unacked is kept in the outbox (with a data dir) and pushed again at the next start."""


class SessionClosed(RuntimeError):
    """`step` on a session that is closed, or was abandoned while the call ran.

    Attributes:
        island: the island id.
        abandoned: True when `abandon` (another process of the island is gone) closed it.
    """

    def __init__(self, island: str, abandoned: bool) -> None:
        why = (
            "was abandoned (another process of the island is gone)"
            if abandoned
            else ("is closed: step() after close()")
        )
        super().__init__(f"island {island!r}: the session {why}; join again")
        self.island, self.abandoned = island, abandoned


_open_islands: set[str] = set()
_open_lock = threading.Lock()


def claim_island(island: str) -> None:
    """Note that this process has an open session with `island` (released at its end).

    Raises:
        RuntimeError: it has one already.
    """
    with _open_lock:
        if island in _open_islands:
            raise RuntimeError(
                f"island {island!r} already has an open session in this process: "
                "close it first, or join with another island id"
            )
        _open_islands.add(island)


class SessionEnd:
    """The end of a `Session` (whose state the annotations below name).

    It also calls the session's `wait_pushed`, `_take`, `_push`, `log_row` and
    `stats_fields`.
    """

    cfg: IslandConfig
    island: str
    stop: threading.Event
    closed: bool
    _lock: threading.RLock
    _abandoned: threading.Event
    layout: TreeLayout
    leader_sync: LeaderSync
    client: Client | None
    outbox: Outbox | None
    token: session_token.HeldToken | None
    ledger: DeltaLedger
    pusher: PushThread | None
    exchange: Any  # DeviceExchange | HostExchange
    pushed_at: dict[int, tuple[int, int]]
    round_base: int
    round: int
    pushed_in_round: bool
    steps: int
    _latest: Any
    unsent: list[PushRequest]  # `Session.unsent`, a property

    def close(self, params: Any = None) -> None:
        """Push the partial round, flush, keep what stays unacked in the data dir, say bye.

        Args:
            params: the latest parameters if the loop trained after its last `step`
                (default: what the last `step` returned). Every process calls `close`.
        """
        with self._lock:
            if not self.closed:
                self._close(params)

    def _close(self, params: Any) -> None:
        try:
            latest = self._latest if params is None else params
            rest = flush_fragments({i: self.steps - at for i, (at, _) in self.pushed_at.items()})
            if rest and not self.leader_sync.broken:
                round_id = self.round_base + self.round + int(self.pushed_in_round)
                try:
                    if self.pusher is not None:  # the rounds in flight first, then no waits
                        self.wait_pushed(self._flush_timeout_s())
                        self.pusher.halt.set()  # no back-pressure wait: queue, then flush
                        self.pusher.wait_for_room(self._abandoned.is_set)
                    taken = self._take(self.layout.leaves(latest), rest)
                    self.exchange.end_step()
                    self._push(rest, taken, round_id)
                except RuntimeError as exc:  # e.g. its buffers were donated since
                    logger.warning("island %s: partial round not pushed: %s", self.island, exc)
            if (
                not self.leader_sync.broken
            ):  # no process leaves a collective of the others unfinished
                self.exchange.wait()
        finally:
            self.closed = True
            self._finish(self._flush_timeout_s())

    def _flush_timeout_s(self) -> float:
        """How long close waits for acks: `flush_timeout_s`, at most `STOPPED_FLUSH_S` once stopped."""
        if self.stop.is_set() or self._abandoned.is_set():
            return min(self.cfg.flush_timeout_s, STOPPED_FLUSH_S)
        return self.cfg.flush_timeout_s

    def abandon(self, flush_timeout_s: float) -> None:
        """Close from another thread without collectives (another process is gone).

        Closes the client first (a `step` in the owner thread then ends with
        `SessionClosed` at its next client call or wait), then, once `step` let go
        of the session, keeps the unacked deltas and releases the data dir. A
        `step` stuck in a collective for longer than `flush_timeout_s` + 5 s is
        left as it is (every pushed delta is in the outbox file already).

        Args:
            flush_timeout_s: how long to wait for unacked deltas.
        """
        self._abandoned.set()
        self.leader_sync.broken = True  # no more collectives, not even at close
        if self.client is not None:
            self.client.close(flush_timeout_s=flush_timeout_s)  # thread-safe
        self.ledger.close()  # ends step's waits on the ledger
        if not self._lock.acquire(timeout=flush_timeout_s + 5.0):
            logger.warning(
                "island %s: abandoned while a step is stuck; its outbox keeps what it pushed",
                self.island,
            )
            return
        try:
            if not self.closed:
                self.closed = True
                self._finish(flush_timeout_s)
        finally:
            self._lock.release()

    def _finish(self, flush_timeout_s: float) -> None:
        try:
            if self.pusher is not None:  # its queued jobs are framed and persisted, then pushed
                self.pusher.close(flush_timeout_s + 30.0)
            if self.client is not None:
                # a stop set while it flushes ends the flush (one set before: flush_timeout_s
                # is already at most STOPPED_FLUSH_S)
                during = None if self.stop.is_set() else self.stop
                self.client.close(flush_timeout_s=flush_timeout_s, stop=during)
                self.ledger.close()
                unacked = self.client.unacked()
                if self.outbox is not None:
                    self.outbox.keep(unacked + self.unsent)
                elif unacked:
                    logger.warning(
                        "island %s closed with %d unacked deltas and no data_dir to keep them",
                        self.island,
                        len(unacked),
                    )
                if self.steps:
                    final = self.stats_fields(final=True)
                    self.log_row({**final, "round": self.round, "final": True})
        finally:
            self._release()

    def _release(self) -> None:
        if self.outbox is not None:
            self.outbox.close()
        if self.token is not None:
            self.token.release()
        with _open_lock:
            _open_islands.discard(self.island)
