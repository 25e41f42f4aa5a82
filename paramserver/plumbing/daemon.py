"""Daemon plumbing shared by `diloco-server` and `diloco-worker`: pid files, logs, detach, signals.

This module owns the process life cycle of a daemon and nothing about what
it serves:

- a pid file (``<data dir>/daemon.pid``, the pid alone) that marks the data dir
  as in use. The daemon holds an exclusive `flock` on it for its life, so a
  live holder is told without clocks: a file nobody locks is stale when its
  process is gone, or when its pid now belongs to a process started after the
  file was written (its mtime: a reused pid; the only check for files of
  versions that did not lock, and one a wall-clock step could fool);
- logging set-up (stderr and/or a log file, one line per record);
- `detach`: start a command as a child in a new session, stdout/stderr into the
  log file, and wait until it calls `notify_ready` (it writes a ready file named
  by the ``DILOCO_READY_FILE`` environment variable) or fails;
- a failed start: the reason is one line for the terminal (`failure_reason`: the
  last line of the child's exception, the traceback stays in the log), and what
  the start created is removed (`first_missing` before it, `remove_created`);
- signals: SIGTERM / SIGINT only set a `threading.Event`; the daemon's main loop
  drains and exits 0. A second signal exits at once;
- `stop`: SIGTERM to the pid in the pid file, then wait for the process to exit.

(Over 700 lines: the steps of one life cycle, each short, which `detach` and
`stop` chain; split, every daemon would import three modules for one job.)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from paramserver.plumbing.private import (
    PRIVATE_FILE_MODE,
    open_private,
    private_dir,
    touch_private,
)

logger = logging.getLogger(__name__)

PID_FILE = "daemon.pid"
LOG_FILE = "daemon.log"
READY_ENV = "DILOCO_READY_FILE"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_POLL_S = 0.02
# a process that started later than its pid file was written (by more than this) did not
# write it: its pid was reused. The slack covers the clock ticks of both time stamps.
_CLOCK_SLACK_S = 2.0
# libraries that log at INFO what an operator cannot act on: JAX's probing of the backends
# it was built for ("Unable to initialize backend 'tpu'" on a machine without one) and its
# compilation cache; their warnings and errors still show, all of it at DEBUG
CHATTY_LOGGERS = ("jax._src.xla_bridge", "jax._src.compilation_cache", "jax._src.compiler")


class DaemonError(RuntimeError):
    """A daemon cannot be started, found or stopped; the message is one line saying what to do."""


class PortInUse(DaemonError):
    """A port a daemon would bind is already taken; nothing was started."""


class DaemonStartError(DaemonError):
    """A daemon exited (or was stopped) before it was ready.

    Attributes:
        code: its exit code (None if it was stopped for not being ready in time).
        reason: the line of its log that says why (`failure_reason`), or "".
        log_file: its log.
    """

    def __init__(self, message: str, code: int | None, reason: str, log_file: Path) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.log_file = log_file


def shard_dir(data_dir: str | Path, index: int) -> Path:
    """The directory of shard `index` of a server (pid file, log, write-ahead log, checkpoints).

    Args:
        data_dir: the server's data directory (`--data-dir`).
        index: shard index.

    Returns:
        ``data_dir / "shard-<index>"``.
    """
    return Path(data_dir) / f"shard-{index}"


def pid_path(data_dir: str | Path) -> Path:
    """The pid file of the daemon that owns `data_dir`.

    Args:
        data_dir: the daemon's data directory.

    Returns:
        ``data_dir / "daemon.pid"``.
    """
    return Path(data_dir) / PID_FILE


def log_path(data_dir: str | Path) -> Path:
    """The log file of the daemon that owns `data_dir`.

    Args:
        data_dir: the daemon's data directory.

    Returns:
        ``data_dir / "daemon.log"``.
    """
    return Path(data_dir) / LOG_FILE


def _create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


# pid file -> the open descriptor through which this process holds its lock
_HELD: dict[Path, int] = {}
# what `flock` raises on a file system that has no locks (some network and FUSE mounts)
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _locked(path: Path) -> bool | None:
    """Whether some process holds the `flock` of a pid file (None: cannot tell).

    A live daemon of this version holds it exclusively (`acquire_pid_file`), and
    the kernel drops it when the process exits, however it exits.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # also drops the shared lock just taken
    return False


def _read(path: Path) -> tuple[int, float] | None:
    """(pid, the latest time its process may have started) from a pid file, or None.

    A pid file holds the pid alone; its writer ran before it was written, so
    its process started no later than the file's mtime. A pid file of an older
    version ("PID CREATE-TIME") says that time itself.
    """
    try:
        parts = path.read_text().split()
        written = path.stat().st_mtime
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        pid = int(parts[0])
        recorded = float(parts[1]) if len(parts) > 1 else 0.0
    except (IndexError, ValueError):
        return None
    started_by = recorded if recorded > 0 else written  # 0.0: the old writer did not know
    return (pid, started_by) if pid > 0 else None


def read_pid(path: str | Path) -> int | None:
    """The pid recorded in a pid file.

    Args:
        path: the pid file.

    Returns:
        The pid, or None when the file is missing or unreadable.
    """
    entry = _read(Path(path))
    return entry[0] if entry else None


def pid_alive(pid: int) -> bool:
    """Whether a process runs (exists and is not a zombie).

    Args:
        pid: process id.

    Returns:
        True while the process is alive.
    """
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, ValueError):
        return False
    except psutil.AccessDenied:
        return True


def running_pid(path: str | Path) -> int | None:
    """The pid of the live process that holds a pid file.

    Args:
        path: the pid file.

    Returns:
        The pid, or None when the file is missing or stale (process gone, or
        nobody locks the file and the pid belongs to a process started after the
        file was written). A locked file's pid is live whatever the wall clock
        did since it was written (psutil's start times move with clock steps).
    """
    entry = _read(Path(path))
    if entry is None:
        return None
    pid, started_by = entry
    if not pid_alive(pid):
        return None
    if _locked(Path(path)):
        return pid
    created = _create_time(pid)
    if created is not None and created > started_by + _CLOCK_SLACK_S:
        return None  # the pid was reused by a process started after the file was written
    return pid


def acquire_pid_file(path: str | Path, pid: int | None = None) -> None:
    """Claim a pid file for a process; a stale file is replaced.

    When the owner is this process, it also holds the file's `flock` until
    `release_pid_file` or its exit (how `running_pid` knows it lives).

    Args:
        path: the pid file (its directory is created).
        pid: the owner, default this process.

    Raises:
        DaemonError: a live process already holds the file.
    """
    path = Path(path)
    pid = os.getpid() if pid is None else pid
    _drop_lock(path)  # a claim of our own again: the old file goes below
    private_dir(path.parent)
    for _ in range(3):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
        except FileExistsError:
            holder = running_pid(path)
            if holder is not None and holder != pid:
                raise DaemonError(
                    f"{path.parent} is in use by a running daemon (pid {holder}); "
                    f"stop it first or choose another data dir"
                ) from None
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            continue
        try:
            os.write(fd, f"{pid}\n".encode())  # the pid alone: `kill $(cat daemon.pid)` works
            if pid == os.getpid():
                try:  # a new file: nobody else has it
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as exc:
                    if isinstance(exc, BlockingIOError) or exc.errno not in _NO_LOCKS:
                        raise
                    # a file system without locks: liveness rests on the mtime check
                else:
                    _HELD[Path(os.path.abspath(path))] = fd
                    return
        except BaseException:  # also Ctrl-C: no descriptor or half-claimed file left
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        os.close(fd)
        return
    raise DaemonError(f"cannot claim pid file {path}: another process keeps re-creating it")


def _drop_lock(path: Path) -> None:
    fd = _HELD.pop(Path(os.path.abspath(path)), None)
    if fd is not None:
        os.close(fd)


def release_pid_file(path: str | Path, pid: int | None = None) -> None:
    """Remove a pid file if it still names `pid`.

    Args:
        path: the pid file.
        pid: the owner, default this process.
    """
    path = Path(path)
    pid = os.getpid() if pid is None else pid
    if read_pid(path) == pid:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    if pid == os.getpid():
        _drop_lock(path)


def setup_logging(level: str | int = "INFO", log_file: str | Path | None = None) -> None:
    """Configure the root logger: one line per record to stderr, and to `log_file` if given.

    `CHATTY_LOGGERS` are raised to WARNING unless `level` is DEBUG.

    Args:
        level: a logging level name or number.
        log_file: also append records to this file (its directory is created).
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter(LOG_FORMAT)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file is not None:
        handlers.append(logging.FileHandler(touch_private(log_file)))  # 0600
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    quiet = logging.DEBUG if root.level <= logging.DEBUG else logging.WARNING
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(quiet)


def install_signal_handlers(
    stop_event: threading.Event, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)
) -> Callable[[], None]:
    """Make SIGTERM / SIGINT set `stop_event`; a second signal exits the process at once.

    Must be called from the main thread.

    Args:
        stop_event: set on the first signal; the main loop drains and exits.
        signals: the signals to handle.

    Returns:
        A function that restores the previous handlers.
    """

    def handler(signum: int, _frame: Any) -> None:
        if stop_event.is_set():
            os.write(2, f"second signal {signum}: exiting now\n".encode())
            os._exit(128 + signum)
        stop_event.set()

    previous = {sig: signal.signal(sig, handler) for sig in signals}
    # a launcher may have blocked these (the demo blocks SIGINT while it starts daemons,
    # and a child inherits the mask): unblock them, or the daemon never hears them
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore


def enter_foreground(data_dir: str | Path, log_level: str) -> threading.Event:
    """The common start of a daemon's main loop: logging, signal handlers, pid file.

    Logs go to stderr, and also to the data dir's log file unless the process was
    started by `detach` (which already sends its output there).

    Args:
        data_dir: the daemon's data directory (pid and log files).
        log_level: logging level name.

    Returns:
        The event SIGTERM / SIGINT set.

    Raises:
        DaemonError: another live daemon holds the data dir.
        OSError: the pid file cannot be written.
    """
    detached = READY_ENV in os.environ
    setup_logging(log_level, None if detached else log_path(data_dir))
    stop = threading.Event()
    install_signal_handlers(stop)
    acquire_pid_file(pid_path(data_dir))
    return stop


def notify_ready(info: Mapping[str, Any] | None = None) -> None:
    """Tell a waiting `detach` that this daemon serves (no-op when not started by `detach`).

    Args:
        info: JSON-serialisable details written to the ready file (e.g. endpoints).
    """
    target = os.environ.get(READY_ENV)
    if not target:
        return
    tmp = Path(target + ".tmp")
    with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as fh:
        fh.write(json.dumps(dict(info or {})))
    os.replace(tmp, target)


def clear_ready() -> None:
    """Remove this daemon's ready file at exit (no-op when not started by `spawn`)."""
    target = os.environ.get(READY_ENV)
    if target:
        with contextlib.suppress(FileNotFoundError):
            Path(target).unlink()


_LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ \S+: ")
_TRACEBACK = "Traceback (most recent call last):"


def exception_line(lines: Sequence[str]) -> str | None:
    """The last line of the last Python traceback in `lines` ("Error: message"), or None.

    That is the first unindented line after the traceback's header: the
    exception's type (without its module path) and the first line of its message.

    Args:
        lines: output lines, e.g. a daemon's log.

    Returns:
        E.g. ``"DurabilityError: shard 0 cannot recover ..."``, or None without a traceback.
    """
    starts = [i for i, line in enumerate(lines) if line.strip() == _TRACEBACK]
    if not starts:
        return None
    for line in lines[starts[-1] + 1 :]:
        if line and not line[0].isspace():
            kind, colon, message = line.partition(": ")
            if kind.replace(".", "").replace("_", "").isalnum():  # a.b.SomeError -> SomeError
                kind = kind.rsplit(".", 1)[-1]
            return f"{kind}{colon}{message}".strip()
    return None


def failure_reason(log_file: str | Path, offset: int = 0) -> str:
    """Why a daemon failed, from its log since `offset`: one line without the log prefix.

    The last line of its last uncaught exception when there is one (the
    traceback goes to the log, the reason to the terminal), else its first
    ERROR record, else its last line.

    Args:
        log_file: the daemon's log.
        offset: where this run's output starts in it.

    Returns:
        The line, or "" when the log is missing or empty.
    """
    try:
        with open(log_file, "rb") as fh:
            fh.seek(offset)
            lines = fh.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    found = exception_line(lines)
    if found is None:
        errors = [line for line in lines if " ERROR " in line]
        found = (errors[0] if errors else lines[-1] if lines else "").strip()
    return _LOG_PREFIX.sub("", found)


def spawn(
    argv: Sequence[str],
    log_file: str | Path,
    ready_file: str | Path,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen:
    """Start `argv` in a new session, stdout/stderr appended to `log_file`, stdin /dev/null.

    The child learns `ready_file` from ``DILOCO_READY_FILE`` and must call
    `notify_ready` once it serves; a stale ready file is removed first. A new
    session keeps terminal signals (Ctrl-C) away from the child: its parent
    decides when it stops.

    Args:
        argv: the command (e.g. ``[sys.executable, "-m", "paramserver.ops.cli", ...]``).
        log_file: where the child's output goes (directory created).
        ready_file: the file the child writes when ready.
        env: the child's environment (default: this process's).

    Returns:
        The child process.
    """
    log_file, ready_file = Path(log_file), Path(ready_file)
    touch_private(log_file)  # 0600, in 0700 directories made here
    private_dir(ready_file.parent)
    with contextlib.suppress(FileNotFoundError):
        ready_file.unlink()
    child_env = dict(os.environ if env is None else env)
    child_env[READY_ENV] = str(ready_file)
    with open(log_file, "ab") as log:
        offset = log.tell()
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env,
            start_new_session=True,
            close_fds=True,
        )
    proc.log_offset = offset  # where this run's output starts, for error messages
    return proc


def check_ready(
    proc: subprocess.Popen, ready_file: str | Path, log_file: str | Path
) -> dict[str, Any] | None:
    """Whether a `spawn`ed child has called `notify_ready` yet (does not wait).

    Args:
        proc: the child.
        ready_file: its ready file.
        log_file: its log (quoted in errors).

    Returns:
        The info the child passed to `notify_ready`, or None while it is starting.

    Raises:
        DaemonStartError: the child exited before it was ready (the message
            ends with the reason from its log, `failure_reason`).
    """
    ready_file = Path(ready_file)
    if ready_file.exists():
        try:
            return dict(json.loads(ready_file.read_text() or "{}"))
        except (OSError, ValueError, TypeError):
            return {}
    code = proc.poll()
    if code is not None:
        reason = failure_reason(log_file, getattr(proc, "log_offset", 0))
        raise DaemonStartError(
            f"exited with code {code} before it was ready"
            + (f": {reason}" if reason else f"; see {log_file}"),
            code,
            reason,
            Path(log_file),
        )
    return None


def wait_ready(
    proc: subprocess.Popen, ready_file: str | Path, log_file: str | Path, timeout_s: float
) -> dict[str, Any]:
    """Wait until a `spawn`ed child has called `notify_ready`.

    Args:
        proc: the child.
        ready_file: its ready file.
        log_file: its log (quoted in errors).
        timeout_s: how long to wait.

    Returns:
        The info the child passed to `notify_ready`.

    Raises:
        DaemonStartError: the child exited first (the message ends with the
            reason from its log), or was not ready in time (it is then terminated).
    """
    deadline = time.monotonic() + timeout_s
    while (info := check_ready(proc, ready_file, log_file)) is None:
        if time.monotonic() > deadline:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5.0)
            raise DaemonStartError(
                f"was not ready within {timeout_s:g}s and was stopped; see {log_file}",
                None,
                "",
                Path(log_file),
            )
        time.sleep(_POLL_S)
    return info


def detach(
    argv: Sequence[str],
    log_file: str | Path,
    ready_file: str | Path,
    timeout_s: float = 60.0,
    env: Mapping[str, str] | None = None,
    created: Path | None = None,
) -> tuple[int, dict[str, Any]]:
    """Start `argv` as a daemon (`spawn`) and wait until it is ready (`wait_ready`).

    Args:
        argv: the command.
        log_file: where the child's output goes.
        ready_file: the file the child writes when ready.
        timeout_s: how long to wait for readiness.
        env: the child's environment (default: this process's).
        created: what this start creates (`first_missing` of the data dir, taken
            before anything was written): removed when the child fails to start.

    Returns:
        (child pid, the info the child passed to `notify_ready`).

    Raises:
        DaemonStartError: the child exited before it was ready (with the reason
            from its log), or did not become ready in time (it is then terminated).
    """
    proc = spawn(argv, log_file, ready_file, env)
    try:
        info = wait_ready(proc, ready_file, log_file, timeout_s)
    except DaemonStartError as exc:
        if proc.poll() is not None:  # gone: nothing of the failed start is left running
            remove_created(created)
        raise DaemonStartError(f"daemon {exc}", exc.code, exc.reason, exc.log_file) from None
    return proc.pid, info


def first_missing(path: str | Path) -> Path | None:
    """The outermost directory on the way to `path` that does not exist yet.

    Taken before a start, it is everything the start will create (a data dir
    and its missing parents), so that a failed start can remove exactly that
    (`remove_created`) and nothing it did not create.

    Args:
        path: a directory a daemon is about to use.

    Returns:
        That directory, or None when `path` exists already.
    """
    path = Path(path).absolute()
    if path.exists():
        return None
    while not path.parent.exists() and path.parent != path:
        path = path.parent
    return path


def remove_created(created: Path | None) -> None:
    """Remove what a failed start created (a `first_missing` directory); None: nothing.

    Args:
        created: the directory, or None.
    """
    if created is not None and created.is_dir():
        logger.debug("removing %s: created by a start that failed", created)
        shutil.rmtree(created, ignore_errors=True)


def wait_exit(pid: int, timeout_s: float) -> bool:
    """Wait until a process has exited.

    Args:
        pid: process id (need not be a child).
        timeout_s: how long to wait.

    Returns:
        True when it exited within the timeout.
    """
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True


def stop(data_dir: str | Path, timeout_s: float = 30.0) -> int:
    """Stop the daemon that owns `data_dir`: SIGTERM (and SIGCONT), then wait for it to exit.

    Args:
        data_dir: the daemon's data directory (holding ``daemon.pid``).
        timeout_s: how long to wait for the exit.

    Returns:
        The pid that was stopped.

    Raises:
        DaemonError: no pid file, a stale one (removed), or the daemon did not exit in time.
    """
    path = pid_path(data_dir)
    recorded = read_pid(path)
    if recorded is None:
        raise DaemonError(f"no daemon running for {data_dir}: no pid file at {path}")
    pid = running_pid(path)
    if pid is None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        raise DaemonError(
            f"no daemon running for {data_dir}: pid {recorded} in {path} is gone; removed the stale file"
        )
    logger.info("sending SIGTERM to pid %d (%s)", pid, data_dir)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGCONT)  # a SIGSTOPped daemon acts on it too
    if not wait_exit(pid, timeout_s):
        raise DaemonError(
            f"daemon pid {pid} did not exit within {timeout_s:g}s of SIGTERM; "
            f"see {log_path(data_dir)}, or kill -9 {pid} to force"
        )
    release_pid_file(path, pid)
    return pid
