"""The client's sockets: a wake-up pair, one DEALER and one SUB per shard, one poller.

This module owns the ZeroMQ side of one island's connection and no protocol:
the context, the CURVE keys, connecting with linger 0 and a capped reconnect
interval, the poller, non-blocking sends and reads, and closing everything.
What the messages mean is `paramserver.client.io_thread`'s job; only `wake` and
`close_wake` may be called from another thread than the I/O thread.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any

import zmq

from paramserver.client.replica import ShardFeed
from paramserver.client.types import ClientConfig, ClientError
from paramserver.plumbing import curve


@dataclass
class ShardLink:
    """Connection state of one shard."""

    index: int
    router: str
    pub: str
    dealer: zmq.Socket | None = None
    sub: zmq.Socket | None = None
    heard: float = 0.0  # last message on the DEALER
    sub_heard: float = 0.0  # last message on the SUB
    up: bool = True
    attempt: int = 0  # reconnects since the shard was last heard
    next_reconnect: float = 0.0
    next_heartbeat: float = 0.0
    feed: ShardFeed | None = None


class Links:
    """Every socket of one client, and the shards they reach (`shards`, in index order)."""

    def __init__(self, cfg: ClientConfig, wake_endpoint: str) -> None:
        """Load the CURVE keys and create the context and the wake-up pair.

        Args:
            cfg: client settings (CURVE key files, reconnect cap).
            wake_endpoint: unique inproc address for the wake-up PAIR.

        Raises:
            ClientError: a CURVE key file cannot be used.
        """
        self._reconnect_cap_s = cfg.reconnect_cap_s
        self._curve: tuple[bytes, bytes, bytes] | None = None
        if cfg.curve_secret_key_file:
            try:
                public, secret = curve.load_keypair(cfg.curve_secret_key_file)
                self._curve = (public, secret, curve.load_public_key(cfg.curve_server_key_file))
            except curve.CurveError as exc:
                raise ClientError(f"client: {exc}") from None
        self._ctx = zmq.Context()
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.setsockopt(zmq.LINGER, 0)
        self._wake_rx.bind(wake_endpoint)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(wake_endpoint)
        self._wake_lock = threading.Lock()
        self._poller = zmq.Poller()
        self._poller.register(self._wake_rx, zmq.POLLIN)
        self._sockets: dict[zmq.Socket, tuple[str, ShardLink]] = {}
        self.shards: list[ShardLink] = []

    # -- any thread ---------------------------------------------------------------------

    def wake(self) -> None:
        """Make the I/O thread's next `poll` return (a no-op once `close_wake` ran)."""
        with self._wake_lock:
            if not self._wake_tx.closed:
                # Again: a wake-up is already queued, which is all we need.
                with contextlib.suppress(zmq.Again):
                    self._wake_tx.send(b"", zmq.NOBLOCK)

    def close_wake(self) -> None:
        """Close the sending end of the wake-up pair (the client is shutting down)."""
        with self._wake_lock:
            self._wake_tx.close(linger=0)

    def term(self) -> None:
        """Terminate the context (after `close` and `close_wake`)."""
        self._ctx.term()

    # -- the I/O thread ---------------------------------------------------------------------

    def poll(self, timeout_ms: int) -> list[zmq.Socket]:
        """Wait up to `timeout_ms` for messages; wake-ups are drained here.

        Returns:
            The shard sockets with messages to read.
        """
        ready = []
        for sock, _ in self._poller.poll(timeout_ms):
            if sock is self._wake_rx:
                self._drain_wake()
            else:
                ready.append(sock)
        return ready

    def owner(self, sock: zmq.Socket) -> tuple[str, ShardLink] | None:
        """("dealer" or "sub", its shard) for a socket still in use, else None (replaced)."""
        return self._sockets.get(sock)

    def open_dealer(self, shard: ShardLink) -> None:
        """Give `shard` a fresh DEALER to its ROUTER (the old one, if any, is closed)."""
        self._drop(shard.dealer)
        shard.dealer = self._connect(zmq.DEALER, shard.router, "dealer", shard)

    def open_sub(self, shard: ShardLink) -> None:
        """Give `shard` a fresh SUB to its PUB (the old one, if any, is closed)."""
        self._drop(shard.sub)
        shard.sub = self._connect(zmq.SUB, shard.pub, "sub", shard)

    def send(self, shard: ShardLink, frames: list[Any]) -> bool:
        """Send one message on a shard's DEALER without blocking.

        Returns:
            False when it did not go out (no DEALER, or its queue is full).
        """
        if shard.dealer is None:
            return False
        try:
            shard.dealer.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def recv(self, sock: zmq.Socket) -> list[Any] | None:
        """One waiting message of `sock` (zero-copy frames), or None when there is none."""
        try:
            return sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None

    def close_shards(self) -> None:
        """Close every shard socket and forget the shards."""
        for shard in self.shards:
            self._drop(shard.dealer)
            self._drop(shard.sub)
            shard.dealer = shard.sub = None
        for sock in list(self._sockets):
            self._drop(sock)
        self.shards = []

    def close(self) -> None:
        """Close every socket the I/O thread uses (the shards' and the wake-up receiver)."""
        self.close_shards()
        self._wake_rx.close(linger=0)

    def _drain_wake(self) -> None:
        while True:
            try:
                self._wake_rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _connect(self, kind: int, endpoint: str, role: str, shard: ShardLink) -> zmq.Socket:
        """A polled socket of `kind` to `endpoint`: linger 0, CURVE if set, capped reconnect."""
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            curve.secure_client(sock, *self._curve)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(self._reconnect_cap_s * 1000))
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        self._sockets[sock] = (role, shard)
        self._poller.register(sock, zmq.POLLIN)
        return sock

    def _drop(self, sock: zmq.Socket | None) -> None:
        if sock is None:
            return
        if sock in self._sockets:
            del self._sockets[sock]
            self._poller.unregister(sock)
        sock.close(linger=0)
