"""Shared test plumbing: polling, free ports, ZeroMQ contexts, raw test peers, shards in threads.

Everything binds to 127.0.0.1 (ports the OS picks, or `free_port`'s) and sets linger 0. The one home of:

- `wait_for(predicate, what)`: poll until the predicate is truthy; fail after a timeout.
- `free_port(count=1)`: the first of `count` consecutive TCP ports free a moment ago,
  below the ephemeral range and in a slice of its own per xdist worker.
- `zmq_ctx`: a fresh context; the test fails if it leaves a socket open.
- `peer(endpoint)`: a raw DEALER speaking `paramserver.wire.protocol` (no client
  library), for sending good and bad messages to a shard.
- `RunningShard`: one ShardServer serving in a thread (the only code that runs one).
- `start_shard(**overrides)`: a shard in a thread on ports the OS picks, with a
  temporary data dir; stopped (and checked to have stopped) at teardown.
- `cluster(shards, **overrides)` / `Cluster`: N shards in threads on fixed free ports
  that advertise what they bind, restartable on the same ports and data dir.
- a safety net for every test with a `tmp_path`: at teardown, whatever the outcome,
  every daemon whose pid file lies under it is stopped (SIGTERM, then SIGKILL of its
  group; `daemon_process`), and the leak is reported as a warning.

It imports `jax_cache` first: one JAX compilation cache for the session (removed after).
"""

from __future__ import annotations

import jax_cache  # first: its environment must be set before anything imports JAX

# isort: split
import itertools
import os
import platform
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import daemon_process
import pytest
import zmq

from paramserver.plumbing import ports
from paramserver.server.config import ShardConfig
from paramserver.server.shard import ShardServer
from paramserver.wire import protocol
from paramserver.wire.snapshot import snapshot_request, snapshot_values

REPLY_TIMEOUT_S = 10.0
WAIT_S = 20.0  # default bound of wait_for

# a test of glibc's malloc (its arenas, malloc_trim) that reads RSS from /proc
glibc_linux = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or not Path("/proc/self/statm").exists(),
    reason="the test is of glibc's malloc and reads RSS from /proc",
)


def wait_for(
    predicate: Callable[[], Any],
    what: str = "the condition",
    *,
    timeout_s: float = WAIT_S,
    poll_s: float = 0.02,
) -> Any:
    """Poll `predicate` until it returns a truthy value; fail the test after `timeout_s`.

    Args:
        predicate: called every `poll_s` seconds (and once more at the deadline).
        what: what is awaited, for the failure message.
        timeout_s: how long to wait.
        poll_s: pause between calls.

    Returns:
        The predicate's first truthy value.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        time.sleep(poll_s)


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive TCP ports on 127.0.0.1 that were free a moment ago.

    The ports lie below the kernel's ephemeral range, so no outgoing connection of
    another test (a ZeroMQ connect takes an ephemeral local port) can take one between
    this check and the bind. Each pytest-xdist worker draws from its own slice, and one
    process never hands out a port twice, nor one of the `PORT_GAP` ports after a
    hand-out, so two tests running at once cannot pick the same port. Still prefer
    binding to port * where the code allows it.

    Args:
        count: how many consecutive ports are needed (a shard binds ROUTER P, PUB P + 1).

    Returns:
        The first port P (P .. P + count - 1 were free).
    """
    first, size = _PORT_SLICE
    with _PORT_LOCK:
        for _ in range(size):
            base = first + _PORT_NEXT[0] % (size - count)
            _PORT_NEXT[0] += 1
            if all(_bindable(p) for p in range(base, base + count)):
                # never hand out one of these ports again, nor the next PORT_GAP: a process
                # that binds past what its test asked for must not take the next test's port
                _PORT_NEXT[0] += count - 1 + PORT_GAP
                return base
    raise AssertionError(f"no {count} consecutive free ports in {first}..{first + size - 1}")


def _port_slice() -> tuple[int, int]:
    """This process's ports: (first, how many), a ninth of `ports.unreserved_range()`."""
    low, high = ports.unreserved_range()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw3"; "" outside xdist
    slot = int(worker[2:]) + 1 if worker.startswith("gw") and worker[2:].isdigit() else 0
    slots = 9  # the controller (or a run without xdist) and up to 8 workers
    size = (high - low) // slots
    return low + (slot % slots) * size, size


PORT_GAP = 16  # ports left free after each hand-out (seen: the port after a shard's taken)
_PORT_SLICE = _port_slice()
_PORT_NEXT = [random.randrange(_PORT_SLICE[1])]  # where the next search starts; fresh per run
_PORT_LOCK = threading.Lock()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(autouse=True)
def _no_daemon_outlives_its_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test that has a tmp_path: stop the daemons it left there, and say so."""
    yield
    tmp = request.node.funcargs.get("tmp_path") if hasattr(request.node, "funcargs") else None
    if tmp is not None and (left := daemon_process.stop_daemons_under(tmp)):
        request.node.warn(pytest.PytestWarning(f"the test left daemons running: pids {left}"))


def _timeout_s(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    return float(marker.args[0]) if marker is not None and marker.args else 0.0


@pytest.hookimpl(trylast=True)  # after `-m` deselected what this pass does not run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, start each worker's share of the tests with the slow runs.

    `--dist worksteal` deals each of N workers a contiguous share of the collection (the
    first `len // N`, then the same of what is left) and lets an idle worker steal the
    tail of a busy one's queue, never its head. A long end-to-end run that sits near the
    end keeps its worker busy while the others idle. So the slow runs, the longest
    timeouts first, are dealt in turn to the heads of the shares, and the other tests
    fill the shares in their collection order: in `./dev test`'s one pass the quick
    tests fill the gaps the long runs leave. This only orders: every test still runs.
    Without xdist the order is left as collected.
    """
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    long = [i for i in items if i.get_closest_marker("slow")]
    if workers < 2 or not long:
        return
    long.sort(key=_timeout_s, reverse=True)  # stable: equal timeouts keep collection order
    dealt = {i.nodeid for i in long}
    rest = iter([i for i in items if i.nodeid not in dealt])
    ordered: list[pytest.Item] = []
    left = len(items)
    for k in range(workers):
        size = left // (workers - k)
        left -= size
        head = long[k::workers][:size]
        ordered += head + list(itertools.islice(rest, size - len(head)))
    placed = {i.nodeid for i in ordered}
    ordered += [i for i in long if i.nodeid not in placed] + list(rest)
    assert len(ordered) == len(items)
    items[:] = ordered


def pytest_unconfigure(config: pytest.Config) -> None:
    """End of the session: remove the JAX compilation cache made for it."""
    jax_cache.remove_made()


@pytest.fixture
def zmq_ctx() -> Iterator[zmq.Context]:
    """A ZeroMQ context; fails the test if a socket is still open at teardown."""
    ctx = zmq.Context()
    yield ctx
    leaked = [s for s in list(ctx._sockets) if not s.closed]
    for s in leaked:
        s.close(linger=0)
    ctx.term()
    assert not leaked, f"{len(leaked)} socket(s) left open: close them (linger 0)"


class Peer:
    """A raw DEALER test peer: sends protocol messages (or arbitrary frames), reads replies."""

    _ids = itertools.count(1)

    def __init__(self, ctx: zmq.Context, endpoint: str, island: str = "peer") -> None:
        self.island = island
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, header: dict[str, Any], payload: Sequence[Any] = ()) -> int:
        """Send one request; adds a fresh `id` unless given. Returns the id."""
        header = {"id": next(self._ids), **header}
        self.sock.send_multipart(protocol.pack(header, list(payload)))
        return header["id"]

    def send_raw(self, frames: Sequence[Any]) -> None:
        """Send frames exactly as given (for malformed messages)."""
        self.sock.send_multipart(list(frames))

    def recv(self, timeout_s: float = REPLY_TIMEOUT_S) -> tuple[dict[str, Any], list[Any]]:
        """The next reply, decoded as a REPLY; fails the test on timeout."""
        assert self.sock.poll(int(timeout_s * 1000)), f"no reply within {timeout_s} s"
        frames = self.sock.recv_multipart()
        return protocol.unpack(frames, role=protocol.REPLY)

    def request(
        self, header: dict[str, Any], payload: Sequence[Any] = ()
    ) -> tuple[dict[str, Any], list[Any]]:
        """Send one request and return its reply (checked to echo the id)."""
        rid = self.send(header, payload)
        reply, body = self.recv()
        assert reply.get("id") == rid, f"reply {reply} does not answer request {rid}"
        return reply, body

    def hello(self) -> dict[str, Any]:
        """Say hello as this peer's island; returns the welcome header."""
        reply, _ = self.request({"kind": "hello", "island": self.island})
        assert reply["kind"] == "welcome", reply
        return reply

    def snapshot(self, fragment: int, size: int | None = None) -> tuple[dict[str, Any], Any]:
        """Snapshot one fragment as the client does (`wire.snapshot`): (reply header, values)."""
        reply, payload = self.request(snapshot_request(self.island, fragment))
        assert reply["kind"] == "snapshot_reply", reply
        return reply, snapshot_values(reply, payload, size)

    def status(self) -> dict[str, Any]:
        """The shard's status dict (a `throttled` refusal is waited out, as a client does)."""
        deadline = time.monotonic() + 30.0
        while True:
            reply, _ = self.request({"kind": "status"})
            if reply.get("reason") != "throttled" or time.monotonic() > deadline:
                break
            time.sleep(min(1.0, float(reply.get("retry_after_s") or 0.05)))
        assert reply["kind"] == "status_reply", reply
        return reply["status"]

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def peer(zmq_ctx: zmq.Context) -> Iterator[Callable[..., Peer]]:
    """Factory: peer(endpoint, island="peer") -> a connected Peer, closed at teardown."""
    made: list[Peer] = []

    def make(endpoint: str, island: str = "peer") -> Peer:
        p = Peer(zmq_ctx, endpoint, island)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


class RunningShard:
    """A ShardServer serving in a background thread."""

    def __init__(self, server: ShardServer) -> None:
        self.server = server
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"shard-{server.index}", daemon=True)
        self.thread.start()
        deadline_ok = server.ready.wait(REPLY_TIMEOUT_S * 3)
        if self.error is not None:
            raise self.error
        assert deadline_ok, "shard did not become ready"
        assert server.bound_endpoints is not None
        self.router, self.pub = server.bound_endpoints

    def _run(self) -> None:
        try:
            self.server.serve(self.stop_event)
        except BaseException as exc:  # surfaced to the test by stop() / __init__
            self.error = exc
            self.server.ready.set()

    def stop(self) -> None:
        """Stop the shard and wait for it; re-raises an error from its thread."""
        self.stop_event.set()
        self.thread.join(REPLY_TIMEOUT_S * 3)
        assert not self.thread.is_alive(), "shard thread did not stop"
        if self.error is not None:
            raise self.error


@pytest.fixture
def start_shard(tmp_path) -> Iterator[Callable[..., RunningShard]]:
    """Factory: start_shard(cfg=None, index=0, **overrides) -> RunningShard on random ports.

    The config defaults to ShardConfig with data_dir under tmp_path, fsync off and
    the given field overrides; every started shard is stopped at teardown.
    """
    running: list[RunningShard] = []

    def start(cfg: ShardConfig | None = None, index: int = 0, **overrides: Any) -> RunningShard:
        if cfg is None:
            base = ShardConfig(data_dir=str(tmp_path / "server"), fsync=False)
            cfg = replace(base, **overrides)
        elif overrides:
            cfg = replace(cfg, **overrides)
        server = ShardServer(
            cfg, index, router_bind="tcp://127.0.0.1:*", pub_bind="tcp://127.0.0.1:*"
        )
        shard = RunningShard(server)
        running.append(shard)
        return shard

    yield start
    for shard in running:
        if shard.thread.is_alive():
            shard.stop()


class Cluster:
    """N shards serving in threads, with the endpoints they advertise matching their binds.

    Args:
        tmp_path: the data dir is tmp_path / "server".
        shards: how many shards.
        overrides: ShardConfig fields (default: async, heartbeats every 0.2 s, no fsync).
    """

    def __init__(self, tmp_path, shards: int = 1, **overrides: Any) -> None:
        settings = {"mode": "async", "heartbeat_interval_s": 0.2, **overrides}
        self.cfg = ShardConfig(
            data_dir=str(tmp_path / "server"), fsync=False, shards=shards, **settings
        )
        base = free_port(2 * shards)  # one range: no two endpoints of the cluster collide
        self.endpoints = [
            (f"tcp://127.0.0.1:{base + 2 * i}", f"tcp://127.0.0.1:{base + 2 * i + 1}")
            for i in range(shards)
        ]
        self.shards: list[RunningShard | None] = [None] * shards
        for i in range(shards):
            self.start(i)

    def start(self, i: int) -> None:
        """Start (or restart, on the same ports and data dir) shard i."""
        router, pub = self.endpoints[i]
        server = ShardServer(self.cfg, i, self.endpoints, router_bind=router, pub_bind=pub)
        self.shards[i] = RunningShard(server)

    @property
    def servers(self) -> list[ShardServer]:
        """The ShardServer of each shard (its latest start)."""
        return [shard.server for shard in self.shards]

    def stop_shard(self, i: int) -> None:
        self.shards[i].stop()

    @property
    def connect(self) -> str:
        return self.endpoints[0][0]

    def stop(self) -> None:
        """Stop every shard still serving."""
        for shard in self.shards:
            if shard is not None:
                shard.stop()


@pytest.fixture
def cluster(tmp_path) -> Iterator[Callable[..., Cluster]]:
    """Factory: cluster(shards=1, **overrides) -> Cluster; every one is stopped at teardown."""
    made: list[Cluster] = []

    def make(shards: int = 1, **overrides: Any) -> Cluster:
        made.append(Cluster(tmp_path, shards, **overrides))
        return made[-1]

    yield make
    for c in made:
        c.stop()
