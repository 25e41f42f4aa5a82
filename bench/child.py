"""Helper processes of the bench harnesses: start, "ready" handshake, stop; and their signals.

Both sides of one small protocol live here. A helper (a relay, the meter, the
DDP reducer, a DDP rank) makes SIGTERM / SIGINT set an event through
`paramserver.plumbing.daemon` (`stop_on_signals`) and prints the line
``ready`` on stdout once it listens (`say_ready`). A harness starts it with
`start` (which waits for that line when asked to; after it the helper
writes nothing more to stdout), and `Child.stop` sends
SIGTERM, waits, then SIGKILLs what did not exit. A helper's stderr goes to a
temporary file, never a pipe nobody reads, and its tail explains a failure.

`sigterm_unwinds` is the harness side: SIGTERM raises `SystemExit`, so the
`with` blocks that own daemons and network namespaces unwind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from paramserver.plumbing import daemon

READY = "ready"


class LaunchError(RuntimeError):
    """A process of a harness could not be started; the message says which and why."""


class PortTaken(LaunchError):
    """A server refused to start because a port it was given is taken (exit 3): nothing
    was started, and the same start on other ports may succeed."""


def say_ready() -> None:
    """Tell the harness that started this helper that it serves (one line on stdout)."""
    print(READY, flush=True)


def stop_on_signals() -> threading.Event:
    """An event that SIGTERM / SIGINT set (a second signal exits at once); main thread only.

    Returns:
        The event; the helper's loop ends once it is set.
    """
    stop = threading.Event()
    daemon.install_signal_handlers(stop)
    return stop


@dataclasses.dataclass
class Child:
    """A started helper process and where its stderr went."""

    proc: subprocess.Popen
    what: str
    stderr: IO[bytes]

    def error_tail(self, chars: int = 300) -> str:
        """The last non-empty line of its stderr (at most `chars` characters)."""
        self.stderr.flush()
        self.stderr.seek(0)
        lines = self.stderr.read().decode(errors="replace").strip().splitlines()
        return lines[-1][-chars:] if lines else ""

    def stop(self, grace_s: float = 30.0) -> int:
        """SIGTERM (if it still runs), wait up to `grace_s`, then SIGKILL; closes its files.

        Args:
            grace_s: how long it may take to exit after SIGTERM.

        Returns:
            Its exit code (negative: the signal that ended it).
        """
        self.terminate()
        return self.wait_or_kill(grace_s)

    def terminate(self) -> None:
        """Send SIGTERM unless it already exited (to stop several at once, then wait)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_or_kill(self, grace_s: float) -> int:
        """Wait up to `grace_s` for the exit, then SIGKILL and reap it.

        Args:
            grace_s: how long to wait.

        Returns:
            Its exit code.
        """
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode


def _wait_ready_line(child: Child, timeout_s: float) -> None:
    out = child.proc.stdout
    deadline = time.monotonic() + timeout_s
    line = ""
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([out], [], [], min(left, 0.5))
        if readable:
            line = out.readline().strip()
            break
    if line != READY:
        child.stop(5.0)
        said = child.error_tail() or (f"said {line!r}" if line else f"no line in {timeout_s:g}s")
        raise LaunchError(f"{child.what} did not start: {said}")


def start(
    argv: Sequence[str],
    what: str,
    *,
    ready_timeout_s: float | None = 60.0,
    log: Path | None = None,
) -> Child:
    """Start a helper and, unless `ready_timeout_s` is None, wait for its ``ready`` line.

    Args:
        argv: the command.
        what: its name in errors ("chaos relay").
        ready_timeout_s: bound on the handshake; None: no handshake (the caller
            watches the process's own output instead).
        log: a file for its stderr (and, without a handshake, its stdout), truncated
            first (default: stderr to a temporary file, stdout to /dev/null).

    Returns:
        The running child.

    Raises:
        LaunchError: it exited, said something else, or was silent past the bound
            (it is then stopped); the message ends with its last stderr line.
    """
    # the file outlives this call: error_tail reads it
    err = open(log, "w+b") if log is not None else tempfile.TemporaryFile()  # noqa: SIM115
    if ready_timeout_s is not None:
        out: IO[bytes] | int = subprocess.PIPE
    else:
        out = err if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=err,
        text=ready_timeout_s is not None,
    )
    child = Child(proc, what, err)
    if ready_timeout_s is not None:
        _wait_ready_line(child, ready_timeout_s)
    return child


@contextlib.contextmanager
def running(
    argv: Sequence[str], what: str, grace_s: float = 30.0, **kwargs: Any
) -> Iterator[Child]:
    """`start` a helper for the body of a `with`; stop it on the way out.

    Args:
        argv: the command.
        what: its name in errors.
        grace_s: how long it may take to exit after SIGTERM.
        **kwargs: further `start` arguments.

    Yields:
        The running child.
    """
    child = start(argv, what, **kwargs)
    try:
        yield child
    finally:
        child.stop(grace_s)


def module_argv(module: str, *args: str) -> list[str]:
    """The command that runs a Python module of this project with this interpreter.

    Args:
        module: dotted module name ("bench.children.relay").
        *args: its arguments.

    Returns:
        argv.
    """
    return [sys.executable, "-m", module, *args]


def _unwind(signum: int, _frame: Any) -> None:
    signal.signal(signum, _while_unwinding)
    raise SystemExit(128 + signum)


def _while_unwinding(signum: int, _frame: Any) -> None:
    """A later SIGTERM while the first one unwinds: ignored, so the cleanup runs to its end.

    (`timeout` sends two: one to the command, one to its process group. A Python
    handler, not SIG_IGN, so that the stop commands the cleanup runs keep the default.)
    """


def sigterm_unwinds() -> None:
    """From now on SIGTERM raises `SystemExit(143)` in the main thread (no-op elsewhere).

    A harness calls it first (`bench.cli` does for every subcommand), so that
    SIGTERM unwinds the `with` blocks that own its daemons, helpers and network
    namespaces, as Ctrl-C does; a further SIGTERM during that unwind is ignored.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _unwind)
