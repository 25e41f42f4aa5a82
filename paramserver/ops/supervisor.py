"""The local-cluster supervisor behind `diloco-server start`: N shard processes on one host.

This module owns starting the shard processes (each in its own session, with
its own pid file and log under ``<data_dir>/shard-<i>/``, and glibc's malloc
capped at `paramserver.plumbing.heap.ARENA_ENV` arenas unless the environment
sets MALLOC_ARENA_MAX already), waiting until they
all serve, watching them, and on SIGTERM / SIGINT forwarding one SIGTERM to
each and waiting for them to drain. It also owns the checks made before a
start (data dir not in use, ports free) and `stop_server`.

Layout of a data dir::

    <data_dir>/daemon.pid, daemon.log      the supervisor
    <data_dir>/shard-<i>/daemon.pid, ...   shard i (log, write-ahead log, checkpoints)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from urllib.parse import urlsplit

from paramserver.plumbing import daemon, dir_kind
from paramserver.plumbing.daemon import DaemonError, PortInUse
from paramserver.plumbing.heap import ARENA_ENV
from paramserver.server.config import ShardConfig, bind_endpoints, local_endpoints

logger = logging.getLogger(__name__)

READY_FILE = "ready.json"
DRAIN_TIMEOUT_S = 60.0
_WATCH_S = 0.1


def shard_argv(cfg: ShardConfig, index: int) -> list[str]:
    """The command that runs shard `index` of a local cluster as its own process.

    Args:
        cfg: the resolved cluster settings (passed on as JSON, not re-read).
        index: shard index.

    Returns:
        argv for `daemon.spawn`.
    """
    return [
        sys.executable,
        "-m",
        "paramserver.ops.cli",
        "shard",
        "--index",
        str(index),
        "--settings-json",
        json.dumps(asdict(cfg)),
    ]


def shard_dirs(data_dir: Path) -> list[Path]:
    """Every ``shard-<i>`` directory below a data dir.

    Args:
        data_dir: the server's data dir.

    Returns:
        The directories, sorted by shard index.
    """
    found = [p for p in data_dir.glob("shard-*") if p.is_dir() and p.name[6:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[6:]))


def check_not_running(data_dir: Path) -> None:
    """Refuse a data dir that a running server (supervisor or shard) holds.

    Args:
        data_dir: the server's data dir.

    Raises:
        DaemonError: naming the pid and how to stop it.
    """
    for directory in [data_dir, *shard_dirs(data_dir)]:
        pid = daemon.running_pid(daemon.pid_path(directory))
        if pid is not None:
            raise DaemonError(
                f"data dir {data_dir} is in use by a running diloco-server (pid {pid}); "
                f"run `diloco-server stop --data-dir {data_dir}` or choose another --data-dir"
            )


def port_in_use(host: str, port: int) -> bool:
    """Whether a TCP port cannot be bound on `host` right now.

    Args:
        host: bind address ("*" means all interfaces).
        port: TCP port.

    Returns:
        True when binding fails with "address in use".
    """
    host = "0.0.0.0" if host in ("*", "") else host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def check_binds(binds: list[tuple[str, str]]) -> None:
    """Refuse to start when a tcp bind address is already taken.

    Args:
        binds: (what, endpoint) pairs, e.g. ("shard 0 ROUTER", "tcp://127.0.0.1:5555").

    Raises:
        PortInUse: naming the endpoint and what to change.
    """
    for what, endpoint in binds:
        parts = urlsplit(endpoint)
        if parts.scheme != "tcp" or parts.port is None:
            continue
        if port_in_use(parts.hostname or "*", parts.port):
            raise PortInUse(
                f"port {parts.port} ({what}, {endpoint}) is already in use; "
                "choose another --port or stop what holds it"
            )


def local_binds(cfg: ShardConfig) -> list[tuple[str, str]]:
    """What every shard of a local cluster binds.

    Args:
        cfg: cluster settings.

    Returns:
        (what, endpoint) pairs for `check_binds`.
    """
    binds = []
    for i in range(cfg.shards):
        router, pub = bind_endpoints(cfg, i)
        binds += [(f"shard {i} ROUTER", router), (f"shard {i} PUB", pub)]
    return binds


def _terminate(procs: list[subprocess.Popen], timeout_s: float) -> list[int | None]:
    """SIGTERM every live process, then wait for each; kill what does not exit in time.

    Each SIGTERM is followed by a SIGCONT: a shard someone SIGSTOPped acts on it too.
    """
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
                proc.send_signal(signal.SIGCONT)
    codes: list[int | None] = []
    deadline = time.monotonic() + timeout_s
    for i, proc in enumerate(procs):
        try:
            codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            logger.error("shard %d did not drain within %gs: killing it", i, timeout_s)
            proc.kill()
            proc.wait()
            codes.append(None)
    return codes


def run_local(cfg: ShardConfig, ready_timeout_s: float = 120.0, created: Path | None = None) -> int:
    """Supervise a local cluster in this process until SIGTERM / SIGINT.

    A start that fails (a shard exits or is not ready in time, the metrics port
    is taken) leaves nothing it created: the ``shard-<i>`` directories that did
    not exist before, and `created`. What existed before is kept as it was
    (their logs say why the start failed).

    Args:
        cfg: cluster settings.
        ready_timeout_s: how long the shards may take to start.
        created: what the caller's start creates (`daemon.first_missing` of the
            data dir, taken before anything was written), or None.

    Returns:
        Exit code: 0 after every shard drained, 1 when a shard failed.
    """
    data_dir = Path(cfg.data_dir)
    fresh = [d for i in range(cfg.shards) if not (d := daemon.shard_dir(data_dir, i)).exists()]
    try:
        stop = daemon.enter_foreground(data_dir, cfg.log_level)
    except (DaemonError, OSError) as exc:
        logger.error("cannot start: %s", exc)
        daemon.remove_created(created)
        return 1
    procs: list[subprocess.Popen] = []
    metrics = None
    failed = False
    ready = False
    try:
        for i in range(cfg.shards):
            directory = daemon.shard_dir(data_dir, i)
            procs.append(
                daemon.spawn(
                    shard_argv(cfg, i),
                    daemon.log_path(directory),
                    directory / READY_FILE,
                    env={**ARENA_ENV, **os.environ},  # malloc arenas capped unless set already
                )
            )
        infos, reason = _wait_all_ready(procs, data_dir, ready_timeout_s, stop)
        if infos is not None:
            endpoints = local_endpoints(cfg)
            if cfg.metrics_port:
                from paramserver.ops.metrics import MetricsError, serve_metrics

                try:
                    metrics = serve_metrics(
                        cfg.metrics_port,
                        [r for r, _ in endpoints],
                        cfg.metrics_bind_host,
                        cfg.curve_secret_key_file,
                        cfg.metrics_token,
                        cfg.data_dir,
                    )
                except MetricsError as exc:
                    reason = str(exc)
            if metrics is not None or not cfg.metrics_port:
                logger.info(
                    "cluster ready: %d shard(s), islands connect to %s",
                    cfg.shards,
                    endpoints[0][0],
                )
                daemon.notify_ready(
                    {
                        "pid": os.getpid(),
                        "endpoints": endpoints,
                        "shard_pids": [p.pid for p in procs],
                        **({"page": page_url(cfg)} if metrics is not None else {}),
                    }
                )
                ready = True
                dir_kind.mark(data_dir, dir_kind.SERVER)
                failed = _watch(procs, stop)
        if not ready:
            logger.info("start failed: stopping the %d shard(s) it started", len(procs))
            _terminate(procs, DRAIN_TIMEOUT_S)
            logger.error("not started: %s", reason)  # the last line: what the terminal shows
            return 1
        logger.info("stopping: SIGTERM to %d shard(s), waiting for them to drain", len(procs))
        codes = _terminate(procs, DRAIN_TIMEOUT_S)
        bad = [(i, c) for i, c in enumerate(codes) if c != 0]
        for i, code in bad:
            logger.error(
                "shard %d exited with code %s; see %s", i, code, daemon.shard_dir(data_dir, i)
            )
        if not bad:
            logger.info("all %d shard(s) drained and stopped; exiting", len(procs))
        return 1 if failed or bad else 0
    finally:
        if metrics is not None:
            metrics.shutdown()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        daemon.release_pid_file(daemon.pid_path(data_dir))
        daemon.clear_ready()
        if not ready:  # a failed start leaves nothing it created
            for directory in [*fresh, created]:
                daemon.remove_created(directory)


def _wait_all_ready(
    procs: list[subprocess.Popen], data_dir: Path, timeout_s: float, stop: threading.Event
) -> tuple[list[dict] | None, str]:
    """Wait for every shard's ready file.

    Returns:
        (their ready infos, ""), or (None, why not) when a shard failed, the
        shards were not ready in time, or stop was set.
    """
    infos: list[dict | None] = [None] * len(procs)
    deadline = time.monotonic() + timeout_s
    while any(info is None for info in infos):
        for i, proc in enumerate(procs):
            if infos[i] is not None:
                continue
            directory = daemon.shard_dir(data_dir, i)
            try:
                infos[i] = daemon.check_ready(
                    proc, directory / READY_FILE, daemon.log_path(directory)
                )
            except daemon.DaemonStartError as exc:
                return None, (
                    f"shard {i} failed before it was ready (exit code {exc.code}): "
                    + (exc.reason or f"see {exc.log_file}")
                )
        if stop.is_set():
            return None, "stopped while the shards were starting"
        if time.monotonic() > deadline:
            return None, (
                f"shards not ready within {timeout_s:g}s; see {data_dir}/shard-*/daemon.log"
            )
        time.sleep(0.02)
    return [info for info in infos if info is not None], ""


def page_url(cfg: ShardConfig) -> str:
    """The address of the cluster page a server with `metrics_port` serves.

    Args:
        cfg: the server's settings (`metrics_port` set).

    Returns:
        ``http://HOST:PORT/``: the bind host, or this host's name when it binds every interface.
    """
    host = cfg.metrics_bind_host
    if host in ("0.0.0.0", "::", "[::]"):
        host = socket.gethostname()
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{cfg.metrics_port}/"


def _watch(procs: list[subprocess.Popen], stop: threading.Event) -> bool:
    """Wait for stop; returns True if a shard exited on its own first (the cluster then stops)."""
    while not stop.wait(_WATCH_S):
        for i, proc in enumerate(procs):
            code = proc.poll()
            if code is not None:
                logger.error(
                    "shard %d exited unexpectedly with code %d; stopping the cluster", i, code
                )
                return True
    logger.info("stop signal received")
    return False


def stop_server(data_dir: str | Path, timeout_s: float = DRAIN_TIMEOUT_S) -> list[int]:
    """Stop the server of a data dir: its supervisor, else every shard daemon found there.

    Args:
        data_dir: the server's data dir.
        timeout_s: how long to wait for each to drain and exit.

    Returns:
        The pids stopped.

    Raises:
        DaemonError: nothing running there (stale pid files are removed), or a
            daemon did not exit in time.
    """
    data_dir = Path(data_dir)
    if daemon.running_pid(daemon.pid_path(data_dir)) is not None:
        return [daemon.stop(data_dir, timeout_s)]
    stopped = [
        daemon.stop(d, timeout_s)
        for d in shard_dirs(data_dir)
        if daemon.running_pid(daemon.pid_path(d)) is not None
    ]
    if stopped:
        with contextlib.suppress(FileNotFoundError):  # a supervisor killed with -9 left it
            daemon.pid_path(data_dir).unlink()
        return stopped
    stale = [
        p for p in (daemon.pid_path(d) for d in [data_dir, *shard_dirs(data_dir)]) if p.exists()
    ]
    for path in stale:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    note = f" (removed {len(stale)} stale pid file(s))" if stale else ""
    raise DaemonError(f"no diloco-server is running for data dir {data_dir}{note}")
