"""The client's I/O thread (`IOThread`): the one thread that moves an island's bytes.

It touches the island's sockets (`paramserver.client.links.Links`) and no
protocol: it polls, hands each message and the time to the core
(`paramserver.client.core`), performs the effects the core returns (open,
close, send), ticks the core's timers, and runs the commands the API
(`paramserver.client.api.Client`) posts to it (join, push effects, close).
Every call into the core, here and in the API, holds `lock`, a Condition that
is notified after each one, so the API's waits (back-pressure) wake up when the
ledger shrinks. `failure` (set under the lock) says why the thread died, if it
did. At most every `heap.TRIM_EVERY_S` it gives its own malloc arena's free top back
to the OS (`paramserver.plumbing.heap.trim_thread_top`): pyzmq copies a frame
under 64 KiB into a message this thread allocates, so the re-sends of a cut
link's unacked deltas (all of them, for `tiny`) left that top higher at each cut.
It keeps its newest received frames of 16 KiB to 1 MiB (`heap.keep_for_release`)
and frees them in that call: the top of libzmq's own I/O thread's arena (what it
received, a paused island's backlog) shrinks with them.
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
from typing import Any

import numpy as np

from paramserver.client.core import ClientCore
from paramserver.client.links import Links
from paramserver.client.shards import Close, Effect, Open, Send
from paramserver.client.types import ClientConfig, ClientError, PushRequest
from paramserver.plumbing import heap

logger = logging.getLogger(__name__)

# A wait sleeps on the I/O thread's Condition (notified after every message) in slices
# this long, so that it sees a `stop` event (which notifies nobody) and so that Ctrl-C
# reaches a main thread that waits; a flush at close looks at its `stop` as often.
STOP_POLL_S = 0.05

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
        self._trimmed_at = time.monotonic()
        self._trim_release: list[Any] = []  # received frames `_trim_heap` frees
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
                        future.result(timeout=STOP_POLL_S)
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
                heap.keep_for_release(self._trim_release, frames)
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
        self._trim_heap(time.monotonic())

    def _trim_heap(self, now: float) -> None:
        """Give this thread's arena's free top back to the OS, and that of the arena holding
        the frames kept (`heap.keep_for_release`), at most every `heap.TRIM_EVERY_S`."""
        if now - self._trimmed_at >= heap.TRIM_EVERY_S:
            heap.trim_thread_top(self._trim_release)
            self._trimmed_at = now

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
