"""A loopback TCP relay that makes each connection one window-limited flow on a long link.

This kernel has no `netem`, so a link's delay is added in userspace (as
`bench.children.wan_relay` does), and here so is the limit that makes one
TCP flow slower than a long fat pipe: its window. Every chunk read from the
client is written to the target `one_way_s` later, and each connection holds
at most `window_bytes` read from the client and not yet delivered; the
reader stops reading while that many are held. One connection then moves at
most window_bytes / one_way_s bytes a second towards the target, as a TCP
flow whose window is smaller than its link's bandwidth-delay product, and N
connections move N times that. Replies (target -> client) are delayed the
same, without a cap. The relay runs in threads of the calling process; it
counts the bytes each connection carried each way.

    with WindowRelay(window_bytes=64 * 1024, one_way_s=0.02) as relay:
        relay.serve(("127.0.0.1", shard_port))
        ... connect to relay.endpoint ...
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Callable

CHUNK = 64 * 1024  # bytes read at once
ACCEPT_POLL_S = 0.2  # how often the accept loop looks at the stop event
JOIN_S = 5.0  # how long closing waits for each thread


@dataclasses.dataclass
class FlowBytes:
    """What one relayed connection carried: bytes towards the target and back."""

    up: int = 0
    down: int = 0


class _Pipe:
    """One direction of one connection: a reader and a writer thread and the line between."""

    def __init__(
        self,
        src: socket.socket,
        dst: socket.socket,
        one_way_s: float,
        cap: int,
        stop: threading.Event,
        count: Callable[[int], None],
    ) -> None:
        self.src, self.dst = src, dst
        self.one_way_s, self.cap, self.stop = one_way_s, cap, stop
        self.count = count
        self.cond = threading.Condition()
        self.line: collections.deque[tuple[float, bytes]] = collections.deque()
        self.held = 0
        self.eof = False
        self.threads = [
            threading.Thread(target=self._read, name="window-relay-read", daemon=True),
            threading.Thread(target=self._write, name="window-relay-write", daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def _room(self) -> int:
        """Bytes the reader may read now (under the lock); 0 = wait."""
        if self.stop.is_set():
            return CHUNK  # unblock: the read fails on the shut-down socket
        if not self.cap:
            return CHUNK
        return min(CHUNK, self.cap - self.held)

    def _read(self) -> None:
        while True:
            with self.cond:
                while self._room() <= 0:
                    self.cond.wait()
                room = self._room()
            try:
                data = self.src.recv(room)
            except OSError:
                data = b""
            with self.cond:
                if not data or self.stop.is_set():
                    self.eof = True
                    self.cond.notify_all()
                    return
                self.line.append((time.monotonic() + self.one_way_s, data))
                self.held += len(data)
                self.cond.notify_all()

    def _write(self) -> None:
        while True:
            with self.cond:
                while not self.line and not self.eof and not self.stop.is_set():
                    self.cond.wait()
                if not self.line or self.stop.is_set():
                    with contextlib.suppress(OSError):
                        self.dst.shutdown(socket.SHUT_WR)
                    return
                due, data = self.line[0]
            if self.stop.wait(max(0.0, due - time.monotonic())):
                return
            try:
                self.dst.sendall(data)
            except OSError:
                return
            self.count(len(data))
            with self.cond:
                self.line.popleft()
                self.held -= len(data)
                self.cond.notify_all()

    def wake(self) -> None:
        """Wake both threads (after stop was set)."""
        with self.cond:
            self.cond.notify_all()


class WindowRelay:
    """The relay: binds a port on 127.0.0.1 at once, relays once `serve` names the target."""

    def __init__(self, window_bytes: int, one_way_s: float) -> None:
        """Bind the listening socket (port chosen by the kernel; see `port`).

        Args:
            window_bytes: bytes in flight per connection towards the target at most
                (0: no cap).
            one_way_s: delay added to every chunk, each way.
        """
        self.window_bytes = window_bytes
        self.one_way_s = one_way_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._pipes: list[_Pipe] = []
        self.flows: list[FlowBytes] = []  # one per accepted connection, in order
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(ACCEPT_POLL_S)
        self.port: int = self._listener.getsockname()[1]
        self._acceptor: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        """The ZeroMQ endpoint a client connects to."""
        return f"tcp://127.0.0.1:{self.port}"

    def serve(self, target: tuple[str, int]) -> None:
        """Start accepting; every connection is relayed to a fresh connection to `target`.

        Args:
            target: (host, port) to relay to.
        """
        self._acceptor = threading.Thread(
            target=self._accept, args=(target,), name="window-relay-accept", daemon=True
        )
        self._acceptor.start()

    def _accept(self, target: tuple[str, int]) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(target, timeout=10.0)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            client.settimeout(None)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            flow = FlowBytes()
            with self._lock:
                if self._stop.is_set():
                    client.close()
                    server.close()
                    return
                self._sockets += [client, server]
                self.flows.append(flow)
                self._pipes.append(
                    _Pipe(client, server, self.one_way_s, self.window_bytes, self._stop,
                          lambda n, f=flow: setattr(f, "up", f.up + n))
                )  # fmt: skip
                self._pipes.append(
                    _Pipe(server, client, self.one_way_s, 0, self._stop,
                          lambda n, f=flow: setattr(f, "down", f.down + n))
                )  # fmt: skip

    def flow_bytes(self) -> list[FlowBytes]:
        """A copy of the per-connection byte counts, in the order accepted."""
        with self._lock:
            return [dataclasses.replace(f) for f in self.flows]

    def close(self) -> None:
        """Stop accepting and relaying, close every socket, wait for the threads."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets, pipes = list(self._sockets), list(self._pipes)
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for pipe in pipes:
            pipe.wake()
        threads = [t for p in pipes for t in p.threads]
        if self._acceptor is not None:
            threads.append(self._acceptor)
        for thread in threads:
            thread.join(JOIN_S)
        for s in sockets:
            s.close()

    def __enter__(self) -> WindowRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
