"""A worker thread beside an I/O loop: a first-in-first-out queue of jobs, a wake pipe, stop.

The shard's loop hands slow work (a step, a push's payload check, the log's
write and fsync) to threads so that it keeps answering; each thread tells
the loop it finished something through a pipe whose read end the loop polls
beside its sockets (`wake_fd`), and the loop collects the results on its
next turn. `LoopThread` is that shared part; a subclass says what one run
does (`_handle`) and keeps its results under `_lock`.

A subclass with `GROUPS = True` gets every job queued when it starts a run
in that one run (a group commit's write and fsync); otherwise one job per
run. `wait` waits until nothing is queued or running (the drain at stop);
`close` stops the thread after what is queued and closes the pipe, and sets
`closing` first, so a run that waits on something else (an operator's hold)
can give up.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any

_STOP = object()  # queued by close(): the thread ends after the jobs before it


class LoopThread:
    """A daemon thread that runs queued jobs in order and wakes the loop after each run."""

    GROUPS = False  # one run takes every job queued at its start (else: one job)

    def __init__(self, name: str) -> None:
        """Start the thread (a daemon: a stuck job never keeps the process alive).

        Args:
            name: the thread's name (seen in stack dumps and profiles).
        """
        self._todo: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued = 0  # submitted and not yet run
        self._idle = threading.Event()
        self._idle.set()
        self.closing = threading.Event()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def wake_fd(self) -> int:
        """A file descriptor readable once a run is done (poll it beside the sockets)."""
        return self._read_fd

    def _put(self, job: Any) -> None:
        """Queue a job (after those queued before it)."""
        with self._lock:
            self._queued += 1
            self._idle.clear()
        self._todo.put(job)

    def _drain_wake(self) -> None:
        """Empty the wake pipe (call before collecting results: a later run wakes again)."""
        try:
            while os.read(self._read_fd, 64):
                pass
        except BlockingIOError:
            pass

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued job has run (the drain at stop).

        Args:
            timeout_s: how long at most (None: until they have).

        Returns:
            Whether none is still queued or running.
        """
        return self._idle.wait(timeout_s)

    def close(self) -> None:
        """Stop the thread after the jobs queued (if any) and close the pipe."""
        self.closing.set()
        self._todo.put(_STOP)
        self._thread.join()
        os.close(self._read_fd)
        os.close(self._write_fd)

    def _handle(self, jobs: list[Any]) -> None:
        """Run one job (or, with GROUPS, the group) and keep its results under `_lock`."""
        raise NotImplementedError

    def _serve(self) -> None:
        stopping = False
        while not stopping:
            job = self._todo.get()
            if job is _STOP:
                return
            jobs = [job]
            while self.GROUPS:
                try:
                    more = self._todo.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    stopping = True
                    break
                jobs.append(more)
            self._handle(jobs)
            with self._lock:
                self._queued -= len(jobs)
                if not self._queued:
                    self._idle.set()
            os.write(self._write_fd, b"\x01")
