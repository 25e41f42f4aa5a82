"""Fixtures and helpers for client tests against real shards: a cluster of threads, clients.

- `Cluster`: N ShardServers in threads on fixed free ports (restartable on the
  same ports and data dir); `clusters(tmp_path)` is the body of a fixture whose
  `cluster(shards, **overrides)` makes one (a test module defines the fixture:
  `yield from clusters(tmp_path)`).
- `clients()`: the same for `client(connect, island, **overrides)`, a Client
  with fast heartbeats, closed at teardown.
- `wait_for(predicate, what)`: poll until true, fail after WAIT_S.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from conftest import free_port

from paramserver.client import Client, ClientConfig
from paramserver.server.config import ShardConfig
from paramserver.server.shard import ShardServer

WAIT_S = 20.0


class Cluster:
    """N shards serving in threads, with the endpoints they advertise matching their binds."""

    def __init__(self, tmp_path, shards: int = 1, **overrides) -> None:
        settings = {"mode": "async", "heartbeat_interval_s": 0.2, **overrides}
        self.cfg = ShardConfig(
            data_dir=str(tmp_path / "server"), fsync=False, shards=shards, **settings
        )
        self.endpoints = [
            (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
            for _ in range(shards)
        ]
        self.servers: list = [None] * shards
        self.threads: list = [None] * shards
        self.stops: list = [None] * shards
        for i in range(shards):
            self.start(i)

    def start(self, i: int) -> None:
        """Start (or restart, on the same ports and data dir) shard i."""
        router, pub = self.endpoints[i]
        server = ShardServer(self.cfg, i, self.endpoints, router_bind=router, pub_bind=pub)
        stop = threading.Event()
        thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
        thread.start()
        self.servers[i], self.threads[i], self.stops[i] = server, thread, stop
        assert server.ready.wait(WAIT_S), "shard did not start"

    def stop_shard(self, i: int) -> None:
        self.stops[i].set()
        self.threads[i].join(WAIT_S)
        assert not self.threads[i].is_alive()

    @property
    def connect(self) -> str:
        return self.endpoints[0][0]

    def stop(self) -> None:
        for i in range(len(self.threads)):
            self.stop_shard(i)


def clusters(tmp_path) -> Iterator[Callable[..., Cluster]]:
    """Body of a `cluster` fixture: yields cluster(shards=1, **overrides); stops them after."""
    made = []

    def make(shards: int = 1, **overrides) -> Cluster:
        c = Cluster(tmp_path, shards, **overrides)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


def clients() -> Iterator[Callable[..., Client]]:
    """Body of a `client` fixture: yields client(connect, island, **overrides); closes them after."""
    made = []

    def make(connect: str, island: str, **overrides) -> Client:
        settings = {"heartbeat_interval_s": 0.2, "join_timeout_s": WAIT_S, **overrides}
        cfg = ClientConfig(connect=connect, island=island, **settings)
        c = Client(cfg)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close(flush_timeout_s=1.0)


def wait_for(predicate, what: str):
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
