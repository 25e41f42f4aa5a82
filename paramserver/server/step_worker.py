"""The shard's step thread: runs one outer step's arithmetic while the serving loop goes on.

A step's cost grows with its fragment (seconds at a billion parameters); the
answers to heartbeats, acks and status must not. The loop hands a step's
work (`paramserver.server.state.StepWork`, begun by `ShardCore.start_step`)
to this thread, keeps serving, and books the result (`ShardCore.finish_step`:
the step's record is logged and fsynced, then its update published) on the
first turn after the thread says it is done. The thread touches only the
stepping fragment's arrays; numpy, numba and XLA release the GIL while they
work, so the loop is answered within a GIL switch interval.

One step at a time. The thread wakes the loop through a pipe whose read end
the loop polls beside its sockets (`wake_fd`).
"""

from __future__ import annotations

import os
import queue
import threading

from paramserver.server.state import StepWork


class StepWorker:
    """One thread that runs submitted steps in turn; see the module docstring."""

    def __init__(self) -> None:
        """Start the thread (a daemon: a stuck step never keeps the process alive)."""
        self._todo: queue.SimpleQueue[StepWork | None] = queue.SimpleQueue()
        self._done: StepWork | None = None
        self._running: StepWork | None = None
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        self._thread = threading.Thread(target=self._serve, name="outer-step", daemon=True)
        self._thread.start()

    @property
    def wake_fd(self) -> int:
        """A file descriptor readable once a step is done (poll it beside the sockets)."""
        return self._read_fd

    @property
    def busy(self) -> bool:
        """Whether a step was submitted and not yet taken back (`take`)."""
        with self._lock:
            return self._running is not None or self._done is not None

    def submit(self, work: StepWork) -> None:
        """Run a step's arithmetic in the thread.

        Args:
            work: the step (from `ShardCore.start_step`).

        Raises:
            RuntimeError: a step is still under way or not taken back.
        """
        with self._lock:
            if self._running is not None or self._done is not None:
                raise RuntimeError("a step is already under way")
            self._running = work
            self._finished.clear()
        self._todo.put(work)

    def take(self) -> StepWork | None:
        """The step that finished running, once (then the worker is free).

        Returns:
            The run work (its `error` set if the arithmetic raised), or None
            while it runs or when none was submitted.
        """
        try:
            while os.read(self._read_fd, 64):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            done, self._done = self._done, None
        return done

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the step under way to finish running (the drain at stop).

        Args:
            timeout_s: how long at most (None: until it finishes).

        Returns:
            Whether no step is running now.
        """
        with self._lock:
            if self._running is None:
                return True
        return self._finished.wait(timeout_s)

    def close(self) -> None:
        """Stop the thread after the step under way (if any) and close the pipe."""
        self._todo.put(None)
        self._thread.join()
        os.close(self._read_fd)
        os.close(self._write_fd)

    def _serve(self) -> None:
        while (work := self._todo.get()) is not None:
            work.run()  # keeps an exception in work.error for finish_step
            with self._lock:
                self._running, self._done = None, work
                self._finished.set()
            os.write(self._write_fd, b"\x01")
