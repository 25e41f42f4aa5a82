"""The client's sockets: a wake-up pair and one socket per link (a shard's DEALER or SUB).

This module owns the ZeroMQ side of one island's connection and no protocol:
the context, the CURVE keys, connecting with linger 0 and a capped reconnect
interval, the poller, non-blocking sends and reads, and closing everything.
Sockets are named by the link numbers the client's core picks
(`paramserver.client.effects`); what the messages mean is the core's job. Only
`wake` and `close_wake` may be called from another thread than the I/O thread.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import zmq

from paramserver.client.types import ClientConfig, ClientError
from paramserver.plumbing import curve


class Links:
    """Every socket of one client, by link number."""

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
        self._sockets: dict[int, zmq.Socket] = {}  # link -> socket
        self._links: dict[zmq.Socket, int] = {}  # socket -> link

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

    def poll(self, timeout_ms: int) -> list[int]:
        """Wait up to `timeout_ms` for messages; wake-ups are drained here.

        Returns:
            The links with messages to read.
        """
        ready = []
        for sock, _ in self._poller.poll(timeout_ms):
            if sock is self._wake_rx:
                self._drain_wake()
            elif sock in self._links:
                ready.append(self._links[sock])
        return ready

    def open(self, link: int, role: str, endpoint: str) -> None:
        """Open link `link`: a DEALER ("dealer") or a subscribe-all SUB ("sub") to `endpoint`."""
        self.close(link)
        kind = zmq.DEALER if role == "dealer" else zmq.SUB
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            curve.secure_client(sock, *self._curve)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(self._reconnect_cap_s * 1000))
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        self._sockets[link] = sock
        self._links[sock] = link
        self._poller.register(sock, zmq.POLLIN)

    def is_open(self, link: int) -> bool:
        """Whether link `link` has a socket."""
        return link in self._sockets

    def send(self, link: int, frames: list[Any]) -> bool:
        """Send one message on a link without blocking.

        Returns:
            False when it did not go out (no such link, or its queue is full).
        """
        sock = self._sockets.get(link)
        if sock is None:
            return False
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def recv(self, link: int) -> list[Any] | None:
        """One waiting message of a link (zero-copy frames), or None when there is none."""
        sock = self._sockets.get(link)
        if sock is None:
            return None
        try:
            return sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None

    def close(self, link: int) -> None:
        """Close link `link` (linger 0), if it is open."""
        sock = self._sockets.pop(link, None)
        if sock is None:
            return
        del self._links[sock]
        self._poller.unregister(sock)
        sock.close(linger=0)

    def close_all(self) -> None:
        """Close every socket the I/O thread uses (the links' and the wake-up receiver)."""
        for link in list(self._sockets):
            self.close(link)
        self._wake_rx.close(linger=0)

    def _drain_wake(self) -> None:
        while True:
            try:
                self._wake_rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
