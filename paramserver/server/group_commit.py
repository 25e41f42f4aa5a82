"""The shard's log writer thread and the replies waiting for it (group commit).

Writing a whole-model delta's record (tens of MB into the page cache) and
its fsync (a tenth of a second to seconds) take far longer than anything
else a turn of the shard's loop does. The loop therefore hands every event
it admits, in admission order, to `LogWriter`, a thread that writes
everything queued when it starts a run as one group (`append_each`) and
fsyncs it once, then wakes the loop. `GroupCommit` is the loop's side: it
numbers the records (tickets), sends at once what vouches for nothing on
disk, holds the rest until its record is durable, and renders it then
through the core (`ShardCore.settle`).

What waits, and for what:

- an ack of an accepted push, `init_ok`, `init_begun`, `init_piece_ok`: its
  own record's fsync;
- a duplicate's ack: the fsync of the first copy's record while that one is
  still being written (else it goes at once: the copy is on disk);
- an `update` on the PUB: its step's record (updates go out in step order);
- a `snapshot_reply` while a step's record is being written: that record
  (a snapshot never shows a version that a crash could take back);
- everything else (heartbeats, status, welcome, refusals, PUB heartbeats):
  nothing; it is sent in the turn that answered it. (So `status` shows the
  state as admitted: its versions and counters may be ahead of the disk by
  what the writer still holds.)

The log's order is the order of admission: one writer, first in first out.
So a record on disk has every record admitted before it on disk too, which
is why a step may merge a delta whose record is still being written: the
step's record comes after the delta's in the log, its update is published
only once the step's record is durable, and a crash (or a storage fault)
that loses the delta's record loses the step's as well (`append_each` never
writes a step after a lost event). A checkpoint begins only while the
writer holds nothing (`idle`): the state it captures is the one on disk, and
the log segment it starts is never one being written.

Storage faults take the path of the inline write (`paramserver.server.shard.store`):
a failed append costs its own record, a failed sync the whole group. The
writer then stops writing: what was queued after the failed group is
dropped, not written (the loop admitted it into a state that is about to be
replaced). On its next turn the loop rebuilds the state from disk
(`ShardStorage.reload`, in the loop's thread: the writer touches nothing
meanwhile) and settles every reply held: lost records' replies are
`storage_error` refusals, the other records of the failed group are acked;
then writing resumes with a new generation. A log that cannot even be cut
back (`OSError` out of the storage layer) is raised in the loop, which stops
the shard, as before.

An operator's (or a test's) `log.hold` file in the shard's directory makes
the writer wait between a group's write and its fsync while it exists: what
a crash at that moment does to a live shard can then be tested.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paramserver.plumbing.loop_thread import LoopThread
from paramserver.server.effects import DurableReply, Effects, Publish, Reply, StorageFailure
from paramserver.server.fragment import AcceptEvent, Event, StepEvent
from paramserver.server.storage.shard_storage import ShardStorage, StorageError

HOLD_LOG_NAME = "log.hold"  # while it exists the writer waits before each fsync
HOLD_POLL_S = 0.01  # how often a held writer looks at the file again (and at stop)


@dataclass(frozen=True)
class Written:
    """How one group's write and fsync ended.

    Attributes:
        generation: the generation its records were submitted in.
        last: the highest ticket of the group.
        lost: the group's events not on disk: empty when all are, None when
            none is (a failed sync).
        error: what failed ("" when nothing did).
        fatal: the log could not be cut back (the shard must stop).
    """

    generation: int
    last: int
    lost: tuple[Event, ...] | None = ()
    error: str = ""
    fatal: BaseException | None = None


class LogWriter(LoopThread):
    """The shard's log writer thread: each run appends the queued records and fsyncs once."""

    GROUPS = True

    def __init__(self, storage: ShardStorage, hold: Path | None = None) -> None:
        """Start the thread.

        Args:
            storage: the shard's data directory (recovered: its log is open).
            hold: a file whose existence pauses the writer before each fsync.
        """
        self._storage = storage
        self._hold = hold
        self._done: list[Written] = []
        self._dead = -1  # the generation that failed: its records still queued are dropped
        super().__init__("log-writer")

    def submit(self, generation: int, ticket: int, event: Event) -> None:
        """Write an event's record after those submitted before it.

        Args:
            generation: the loop's generation (bumped after each storage fault).
            ticket: the record's number (increasing).
            event: the event.
        """
        self._put((generation, ticket, event))

    def take(self) -> list[Written]:
        """The groups written (or failed) since the last call, in order."""
        self._drain_wake()
        with self._lock:
            done, self._done = self._done, []
        return done

    def _handle(self, jobs: list[tuple[int, int, Event]]) -> None:
        live = [job for job in jobs if job[0] > self._dead]
        if not live:  # queued behind a failed group: the loop refuses them itself
            return
        generation, last = live[-1][0], live[-1][1]
        events = [event for _, _, event in live]
        try:
            lost = tuple(self._storage.append_each(events))
            self._held()
            self._storage.sync()
            written = Written(generation, last, lost, self._storage.last_fault if lost else "")
        except StorageError as exc:
            written = Written(generation, last, None, str(exc))
        except BaseException as exc:  # the log could not be cut back, or a bug: the loop raises it
            written = Written(generation, last, None, str(exc), exc)
        if written.lost is None or written.lost:
            self._dead = generation
        with self._lock:
            self._done.append(written)

    def _held(self) -> None:
        """Wait while the hold file exists (observes close)."""
        while self._hold is not None and self._hold.exists() and not self.closing.is_set():
            time.sleep(HOLD_POLL_S)


class GroupCommit:
    """The loop's side of the log writer: tickets, the replies held for them, the settling.

    Args:
        storage: the shard's data directory.
        writer: the log writer thread over it.
    """

    def __init__(self, storage: ShardStorage, writer: LogWriter) -> None:
        self.storage = storage
        self.writer = writer
        self.generation = 0
        self.submitted = 0  # the last ticket handed to the writer
        self.durable = 0  # the last ticket known on disk (or given up after a fault)
        self._records: list[tuple[int, Event]] = []  # in flight, in order
        self._held: list[tuple[int, Reply | DurableReply | Publish]] = []  # in submission order
        self._pushes: dict[tuple[Any, Any, Any], int] = {}  # accepted pushes in flight -> ticket
        self._step = 0  # the ticket of the last step record in flight (0: none)

    @property
    def idle(self) -> bool:
        """Whether every record submitted is settled (nothing in flight, nothing held)."""
        return self.durable >= self.submitted

    def submit(self, core: Any, effects: Effects, now: float) -> list[tuple[bytes | None, list]]:
        """Queue a batch's records; send what needs no durability, hold the rest.

        Args:
            core: the shard's core (`ShardCore`; renders and counts what is sent).
            effects: the batch's effects, in order.
            now: wall-clock seconds.

        Returns:
            [(conn, frames)] to send now, conn None for the PUB.
        """
        tickets: dict[int, int] = {}
        for event in effects.records:
            self.submitted += 1
            ticket = tickets[id(event)] = self.submitted
            self.writer.submit(self.generation, ticket, event)
            self._records.append((ticket, event))
            if isinstance(event, AcceptEvent):
                c = event.contribution
                self._pushes[(c.island, c.round, c.fragment)] = ticket
            elif isinstance(event, StepEvent):
                self._step = ticket
        now_out = Effects()
        for reply in effects.replies:
            ticket = self._wait_for(reply, tickets)
            if ticket > self.durable:
                self._held.append((ticket, reply))
            else:
                now_out.replies.append(reply)
        last = max(tickets.values(), default=0)
        for publish in effects.publishes:
            if publish.is_update and last > self.durable:
                self._held.append((last, publish))
            else:
                now_out.publishes.append(publish)
        return core.settle(now_out, now) if now_out.replies or now_out.publishes else []

    def _wait_for(self, reply: Reply | DurableReply, tickets: dict[int, int]) -> int:
        """The ticket a reply waits for (0 or already durable: none)."""
        if isinstance(reply, Reply):
            snapshot = reply.header.get("kind") == "snapshot_reply"
            return self._step if snapshot else 0
        if reply.event is not None:
            return tickets.get(id(reply.event), self.submitted)
        if reply.request.get("kind") == "push":  # a duplicate: of a copy still in flight?
            key = tuple(reply.request.get(k) for k in ("island", "round", "fragment"))
            return self._pushes.get(key, 0)
        return self.submitted

    def complete(self, core: Any, now: float) -> list[tuple[bytes | None, list]]:
        """Settle what the writer finished: send the replies and updates it made durable.

        After a storage fault the state is rebuilt from disk and every held
        reply is settled against it (`ShardCore.settle`).

        Args:
            core: the shard's core.
            now: wall-clock seconds.

        Returns:
            [(conn, frames)] to send, in order.

        Raises:
            BaseException: what the writer could not recover from (the log not cut back).
        """
        out: list[tuple[bytes | None, list]] = []
        for written in self.writer.take():
            if written.generation != self.generation:
                continue
            if written.fatal is not None:
                raise written.fatal
            if written.lost is not None and not written.lost:
                out += core.settle(self._release(written.last), now)
                continue
            rebuilt = self.storage.reload()
            first = StorageFailure(written.error, rebuilt, written.lost)
            out += core.settle(self._release(written.last), now, first)
            rest = self._release(self.submitted)
            if rest.records or rest.replies or rest.publishes:
                out += core.settle(rest, now, StorageFailure(written.error, rebuilt))
            self.generation += 1
        return out

    def _release(self, upto: int) -> Effects:
        """Take the records and held messages of tickets up to `upto` (they are settled now)."""
        self.durable = max(self.durable, upto)
        done = Effects(records=[e for t, e in self._records if t <= upto])
        self._records = [(t, e) for t, e in self._records if t > upto]
        held = []
        for ticket, item in self._held:
            if ticket > upto:
                held.append((ticket, item))
            elif isinstance(item, Publish):
                done.publishes.append(item)
            else:
                done.replies.append(item)
        self._held = held
        self._pushes = {k: t for k, t in self._pushes.items() if t > upto}
        if self._step <= upto:
            self._step = 0
        return done

    def drain(self, core: Any, timeout_s: float) -> list[tuple[bytes | None, list]]:
        """Wait for the writer to finish what is queued and settle it (the drain at stop).

        Args:
            core: the shard's core.
            timeout_s: how long at most to wait.

        Returns:
            [(conn, frames)] to send.
        """
        self.writer.wait(timeout_s)
        return self.complete(core, time.time())
