"""The client's network thread: it moves bytes and time between the sockets and the core.

This module owns the one thread that touches an island's sockets
(`paramserver.client.io_thread`) and no protocol: it polls, hands each message
and the time to the client's sans-I/O core (`paramserver.client.core`),
performs the effects the core returns (open, close, send), ticks the core's
timers, and runs the API's commands (join, push effects, close). Every call
into the core, here and in the API (`paramserver.client.api`), holds `lock`,
a Condition that is notified after each one, so the API's waits
(back-pressure) wake up when the ledger shrinks. `failure` (set under the
lock) says why the thread died, if it did.

`Links` holds those sockets: the context, the CURVE keys, a wake-up pair and
one socket per link (a shard's DEALER or SUB) named by the link numbers the
core picks (`paramserver.client.shards`), connecting with linger 0 and a
capped reconnect interval, the poller, non-blocking sends and reads, and
closing everything. A bulk DEALER is watched by a ZeroMQ socket monitor: a
connection that dies under it is reported (`poll`) to the core
(`ClientCore.on_link_down`), which replaces the link and sends again what it
carried. Only `wake` and `close_wake` may be called from another
thread than the I/O thread.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import secrets
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import parse_monitor_message

from paramserver.client.core import ClientCore
from paramserver.client.shards import Close, Effect, Open, Send, flow_buffer_bytes
from paramserver.client.types import ClientConfig, ClientError, PushRequest
from paramserver.plumbing import curve

logger = logging.getLogger(__name__)

_STOP_POLL_S = 0.05  # how often a flush at close looks at its `stop`
_MAX_BATCH = 256  # messages read from one socket per poll round, so no socket starves the rest


class IOThread(threading.Thread):
    """The one thread that touches the client's sockets."""

    def __init__(self, cfg: ClientConfig, wake_endpoint: str) -> None:
        """Create the core and the wake-up sockets (links are opened as the core asks).

        Args:
            cfg: client settings.
            wake_endpoint: unique inproc address for the wake-up PAIR.
        """
        super().__init__(name=f"diloco-client-{cfg.island}", daemon=True)
        self.lock = threading.Condition()  # guards `core` and `failure`
        self.core = ClientCore(cfg, secrets.token_hex(8))
        self.failure: str | None = None
        self.stop_join = threading.Event()  # set by the API: a join in progress gives up
        self._links = Links(cfg, wake_endpoint)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._join: Future | None = None  # the join in progress
        self._closing: Future | None = None  # the close in progress
        self._finished = False
        self._tick_s = min(0.1, cfg.heartbeat_interval_s / 4)

    # -- API side (any thread) -----------------------------------------------------------

    def submit(self, command: tuple[str, Any, Future | None]) -> None:
        """Queue a command for the I/O thread and wake it.

        Args:
            command: ("join", flat params, future), ("effects", effects of a core
                call the API made, None) or ("close", flush timeout, future).
        """
        self._commands.put(command)
        self._links.wake()

    def shutdown(
        self, flush_timeout_s: float, stop: threading.Event | None = None
    ) -> list[PushRequest]:
        """Flush (bounded), stop the thread, close every socket and the context.

        Args:
            flush_timeout_s: how long to wait for unacked deltas (less when every
                shard that holds one is down).
            stop: once set, the flush ends at once (a Ctrl-C while it waits).

        Returns:
            The deltas dropped unacked, in push order.
        """
        dropped: list[PushRequest] = []
        if self.is_alive():
            future: Future = Future()
            self.submit(("close", max(0.0, float(flush_timeout_s)), future))
            deadline = time.monotonic() + flush_timeout_s + 10.0
            try:
                while not future.done() and time.monotonic() < deadline:
                    if stop is not None and stop.is_set():
                        self.submit(("close", 0.0, None))  # cut the flush
                        stop = None
                    with contextlib.suppress(FutureTimeout):
                        future.result(timeout=_STOP_POLL_S)
                dropped = future.result(timeout=0)
            except Exception as exc:  # the thread failed while closing
                logger.warning("client close: %s", exc)
            self.join(timeout=10.0)
        if not self.is_alive():  # a thread that failed left its ledger to us
            with self.lock:
                dropped += self.core.ledger.drop_all()
        self._links.close_wake()
        if not self.is_alive():
            self._links.term()
        return dropped

    # -- thread body -----------------------------------------------------------------

    def run(self) -> None:
        """Serve commands and sockets until closed; record a failure for the API."""
        try:
            while not self._finished:
                self._iteration()
        except Exception as exc:
            logger.exception("client I/O thread failed")
            with self.lock:
                self.failure = str(exc) or type(exc).__name__
                self.lock.notify_all()
            self._fail_commands(exc)
        finally:
            self._links.close_all()

    def _iteration(self) -> None:
        """Poll once, hand what arrived to the core, run commands and the core's timers."""
        with self.lock:
            active = self.core.has_links
        timeout_ms = int(self._tick_s * 1000) if active else 1000
        ready, down = self._links.poll(timeout_ms)
        for link in ready:  # first: what a dead link got before it died is still read
            for _ in range(_MAX_BATCH):
                frames = self._links.recv(link)
                if frames is None:
                    break
                self._call(self.core.on_message, time.monotonic(), link, frames)
                if not self._links.is_open(link):  # replaced while handling the message
                    break
        for link in down:
            self._call(self.core.on_link_down, time.monotonic(), link)
        self._run_commands()
        if self.stop_join.is_set():
            self.stop_join.clear()
            self._call(self.core.stop_join)
        self._call(self.core.on_tick, time.monotonic())
        self._settle()

    def _call(self, method: Any, *args: Any) -> None:
        """Call the core under the lock, perform the effects it returns, wake the API."""
        with self.lock:
            self.perform(method(*args))
            self.lock.notify_all()

    def perform(self, effects: Sequence[Effect]) -> None:
        """Perform the core's effects in order (with `lock` held)."""
        for effect in effects:
            if isinstance(effect, Send):
                went_out = self._links.send(effect.link, effect.frames)
                self.core.on_sent(effect, went_out, time.monotonic())
            elif isinstance(effect, Open):
                self._links.open(effect.link, effect.role, effect.endpoint)
            elif isinstance(effect, Close):
                self._links.close(effect.link)

    def _queued(self) -> Iterator[tuple[str, Any, Future | None]]:
        """The commands queued so far, taken off the queue one by one."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_commands(self) -> None:
        for name, arg, future in self._queued():
            if name == "effects":
                with self.lock:
                    self.perform(arg)
            elif name == "join":
                self._start_join(arg, future)
            elif name == "close":  # future None: the flush of the close in progress is cut
                if future is not None:
                    self._closing = future
                self._call(self.core.begin_close, time.monotonic(), arg)

    def _start_join(self, flat: Mapping[str, np.ndarray], future: Future) -> None:
        with self.lock:
            try:
                self.perform(self.core.start_join(time.monotonic(), flat))
            except ClientError as exc:
                future.set_exception(exc)
                return
        self._join = future

    def _settle(self) -> None:
        """Resolve the join's and close's futures once the core says they ended."""
        with self.lock:
            outcome, closed = self.core.join_outcome, self.core.closed
            if outcome is not None:
                self.core.join_outcome = None
            dropped = self.core.dropped
        if outcome is not None and self._join is not None:
            if isinstance(outcome, ClientError):
                self._join.set_exception(outcome)
            else:
                self._join.set_result(outcome)
            self._join = None
        if closed and self._closing is not None:
            self._closing.set_result(dropped)
            self._finished = True

    def _fail_commands(self, exc: Exception) -> None:
        error = ClientError(f"client I/O thread failed: {exc}")
        if self._join is not None and not self._join.done():
            self._join.set_exception(error)
        for name, _arg, future in self._queued():
            if name == "close":
                self._closing = future
            elif future is not None and not future.done():
                future.set_exception(error)
        if self._closing is not None and not self._closing.done():
            with self.lock:
                self._closing.set_result(self.core.ledger.drop_all())


# -- the sockets ------------------------------------------------------------------------


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
