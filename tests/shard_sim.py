"""A deterministic simulation of one shard: its core over a real data directory, a fake clock.

No sockets, no threads: requests are packed as on the wire and handed to the
batch path the shard's I/O loop runs (`paramserver.server.shard.run_batch`
and `maybe_checkpoint`); replies and publishes come back decoded. The test
decides what arrives, in which order, how often, and when time passes; a
crash drops the process (nothing unsent goes out) and a restart rebuilds the
core from what it asked to write.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from shard_helpers import delta_frames, init_payload, plan_for, push_header, small_flat

from paramserver.server.config import ShardConfig
from paramserver.server.core import Request, ShardCore
from paramserver.server.fragment import AcceptEvent, StepEvent
from paramserver.server.shard import maybe_checkpoint, run_batch
from paramserver.server.storage import wal
from paramserver.server.storage.shard_storage import ShardStorage
from paramserver.server.storage.wal import LogReader, record_to_event
from paramserver.wire import protocol

T0 = 1_000_000.0
ENDPOINTS = [("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")]


@dataclass
class Island:
    """A simulated island: its id, its connection, and the requests it builds."""

    name: str
    conn: bytes = b""
    _ids: Any = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        self.conn = self.conn or f"conn-{self.name}".encode()

    def request(self, header: dict[str, Any], payload: list[Any] = ()) -> Request:
        """A request as it comes off the ROUTER (own id, own connection)."""
        header = {"id": next(self._ids), "island": self.name, **header}
        return Request(self.conn, protocol.pack(header, list(payload)))

    def hello(self, **fields: Any) -> Request:
        """Its hello."""
        return self.request({"kind": "hello", **fields})

    def heartbeat(self) -> Request:
        """Its heartbeat."""
        return self.request({"kind": "heartbeat"})


class ShardSim:
    """One shard core, its data directory and a fake clock."""

    def __init__(self, data_dir: Path, **overrides: Any) -> None:
        base = ShardConfig(
            data_dir=str(data_dir), mode="async", fsync=True, downlink="float32",
            checkpoint_every_steps=0, checkpoint_every_s=0,
        )  # fmt: skip
        self.cfg = replace(base, **overrides)
        self.now = T0
        self.flat = small_flat()
        self.plan = plan_for(self.flat, 1, self.cfg.num_fragments)
        self.published: list[dict[str, Any]] = []
        self.fsync_fails = False
        self._start()

    def _start(self) -> None:
        self.storage = ShardStorage(self.cfg, 0)
        state = self.storage.recover()
        self.core = ShardCore(self.cfg, 0, state, ENDPOINTS, self.now, None, self.storage.replayed)

    @property
    def state(self):
        """The core's state."""
        return self.core.state

    def batch(self, *requests: Request, tick: bool = True) -> list[tuple[bytes, dict[str, Any]]]:
        """Run one loop turn at the current time; the replies (connection, header), in order."""
        real_fsync = os.fsync

        def failing_fsync(fd: int) -> None:
            raise OSError(5, "Input/output error")

        if self.fsync_fails:
            wal.os.fsync = failing_fsync
        try:
            messages = run_batch(self.core, self.storage, list(requests), self.now, tick)
        finally:
            wal.os.fsync = real_fsync
        maybe_checkpoint(self.core, self.storage, self.now)
        replies = []
        for conn, frames in messages:
            if conn is None:
                self.published.append(protocol.unpack(frames, protocol.PUB)[0])
            else:
                replies.append((conn, protocol.unpack(frames, protocol.REPLY)[0]))
        return replies

    def one(self, request: Request) -> dict[str, Any]:
        """The reply to one request handled alone (with a tick)."""
        ((_, reply),) = self.batch(request)
        return reply

    def advance(self, seconds: float) -> None:
        """Let time pass."""
        self.now += seconds

    def crash_and_restart(self) -> None:
        """The process dies (what was not sent is lost) and starts again from its data dir."""
        self.storage.close()
        self._start()

    def init(self, island: Island) -> dict[str, Any]:
        """Hello and init from `island`; the init reply."""
        assert self.one(island.hello())["kind"] == "welcome"
        header = {"kind": "init", "plan": self.plan.to_wire()}
        return self.one(island.request(header, init_payload(self.plan, self.flat)))

    def push(self, island: Island, rnd: int, fragment: int = 0, base: int = 0) -> Request:
        """A push of `island`'s deterministic delta of round `rnd`."""
        return island.request(push_header(self.plan, island.name, rnd, fragment, base), delta_frames(
            self.delta(island.name, rnd, fragment)
        ))  # fmt: skip

    def delta(self, island: str, rnd: int, fragment: int = 0) -> np.ndarray:
        """The delta an island sends in a round (a function of the three)."""
        seed = [sum(island.encode()), rnd, fragment]
        size = self.plan.fragments[fragment].size
        return np.random.default_rng(seed).standard_normal(size).astype(np.float32) * 0.01

    def logged(self) -> tuple[list[tuple[str, int, int]], list[tuple[str, int]]]:
        """Every (island, round, fragment) accepted in the log, and every key merged by a step."""
        accepted, merged = [], []
        for path in sorted(self.storage.dir.glob("wal-*.log")):
            for record in LogReader(path):
                event = record_to_event(record)
                if isinstance(event, AcceptEvent):
                    accepted.append(event.contribution.key)
                elif isinstance(event, StepEvent):
                    merged += [(island, rnd, event.fragment) for island, rnd in event.keys]
        return accepted, merged
