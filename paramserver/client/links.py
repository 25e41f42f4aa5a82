"""The client's sockets (`Links`), which only its I/O thread drives.

`Links` holds them: the context, the CURVE keys, a wake-up pair and one
socket per link (a shard's DEALER or SUB) named by the link numbers the core
picks (`paramserver.client.shards`), connecting with linger 0 and a capped
reconnect interval, the poller, non-blocking sends and reads, and closing
everything. A bulk DEALER is watched by a ZeroMQ socket monitor: a connection
that dies under it is reported (`poll`) to the core
(`ClientCore.on_link_down`), which replaces the link and sends again what it
carried. Only `wake` and `close_wake` may be called from another thread than
the I/O thread (`paramserver.client.io_thread`). The one client module that
imports zmq.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from paramserver.client.shards import flow_buffer_bytes
from paramserver.client.types import ClientConfig, ClientError
from paramserver.plumbing import curve


def _kernel_max() -> int:
    """The largest socket buffer this host lets a process set (net.core.wmem_max, rmem_max)."""
    sizes = []
    for name in ("wmem_max", "rmem_max"):
        try:
            sizes.append(int(Path(f"/proc/sys/net/core/{name}").read_text()))
        except (OSError, ValueError):
            return 0
    return min(sizes)


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
        flows = cfg.bulk_flows
        self._bulk_buffer = flow_buffer_bytes(cfg.link_bdp_bytes, max(1, flows), _kernel_max())
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
        self._monitors: dict[zmq.Socket, int] = {}  # a bulk link's monitor -> link

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

    def poll(self, timeout_ms: int) -> tuple[list[int], list[int]]:
        """Wait up to `timeout_ms` for messages; wake-ups are drained here.

        Returns:
            (the links with messages to read, the bulk links whose connection died).
        """
        ready, down = [], []
        for sock, _ in self._poller.poll(timeout_ms):
            if sock is self._wake_rx:
                self._drain_wake()
            elif sock in self._links:
                ready.append(self._links[sock])
            elif sock in self._monitors and self._disconnected(sock):
                down.append(self._monitors[sock])
        return ready, down

    def _disconnected(self, monitor: zmq.Socket) -> bool:
        """Whether a bulk link's monitor reported a connection that died (its events read)."""
        died = False
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return died
            died = died or event["event"] == zmq.EVENT_DISCONNECTED

    def open(self, link: int, role: str, endpoint: str) -> None:
        """Open link `link` to `endpoint`: a DEALER ("dealer"), a bulk DEALER ("bulk": its
        buffers sized from the link's bandwidth-delay product) or a subscribe-all SUB ("sub")."""
        self.close(link)
        kind = zmq.SUB if role == "sub" else zmq.DEALER
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if role == "bulk" and self._bulk_buffer:
            sock.setsockopt(zmq.SNDBUF, self._bulk_buffer)
            sock.setsockopt(zmq.RCVBUF, self._bulk_buffer)
        if role == "bulk":
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._monitors[monitor] = link
            self._poller.register(monitor, zmq.POLLIN)
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
        for monitor in [m for m, of in self._monitors.items() if of == link]:
            del self._monitors[monitor]
            self._poller.unregister(monitor)
            sock.disable_monitor()
            monitor.close(linger=0)
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
