"""Processes a test starts that start daemons of their own: owned by a fixture, stopped in every outcome.

A test that runs an example, the demo or a CLI that starts a detached server
cannot stop that server by killing its own child: `diloco-server start --detach`
runs the server in a new session, out of the child's process group. The helpers
here stop both:

- `started(argv)`: a context manager that starts `argv` in its own session and,
  on the way out (the test passed, failed or timed out), kills that session's
  whole process group, then every daemon whose pid file lies under the given
  roots.
- `stop_daemons_under(root)`: SIGTERM every live daemon whose ``daemon.pid`` lies
  under `root` (a server and its shards, islands), then SIGKILL the process
  group of any that is still alive after a grace period.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from paramserver.plumbing import daemon

GRACE_S = 15.0  # how long a SIGTERMed daemon may drain before its group is killed


def _alive(pid: int) -> bool:
    return daemon.pid_alive(pid)


def _killpg(pid: int, sig: int) -> None:
    """Signal `pid`'s process group (never our own: then only `pid`), then `pid`."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        group = os.getpgid(pid)
        if group != os.getpgid(0):
            os.killpg(group, sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def live_daemons_under(root: Path) -> list[int]:
    """The pids of the live daemons whose pid file lies anywhere under `root`.

    Args:
        root: a directory holding data dirs (servers, shards, islands).

    Returns:
        Their pids (a stale pid file counts as none).
    """
    if not Path(root).is_dir():
        return []
    pids = (daemon.running_pid(path) for path in Path(root).rglob(daemon.PID_FILE))
    ours = {os.getpid(), os.getppid(), 1}  # a test may write a pid file naming itself
    return sorted({pid for pid in pids if pid is not None and pid not in ours})


def stop_daemons_under(root: Path, grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM every live daemon under `root`; SIGKILL the group of those alive after `grace_s`.

    Args:
        root: a directory holding data dirs (servers, shards, islands).
        grace_s: how long the daemons may drain after SIGTERM.

    Returns:
        The pids that were running (empty: nothing was left).
    """
    pids = live_daemons_under(root)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            _killpg(pid, signal.SIGKILL)
    return pids


@contextlib.contextmanager
def started(
    argv: Sequence[str], daemon_roots: Sequence[Path] = (), **popen: Any
) -> Iterator[subprocess.Popen]:
    """Start `argv` in its own session; on exit kill its process group and the daemons it left.

    Args:
        argv: the command.
        daemon_roots: directories whose daemons (found by pid file) the command may start.
        popen: more `subprocess.Popen` arguments (stdout, text, env, ...).

    Yields:
        The process (its pid is also its process group id).
    """
    proc = subprocess.Popen(list(argv), start_new_session=True, **popen)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            _killpg(proc.pid, signal.SIGKILL)
        else:  # the leader is gone; helpers it left in its group (pgid = its pid) may not be
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=GRACE_S)
        for root in daemon_roots:
            stop_daemons_under(root)
        for stream in (proc.stdout, proc.stderr, proc.stdin):
            if stream is not None:
                stream.close()
