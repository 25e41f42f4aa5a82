"""Running one shard as a daemon process: pid file, logging, signals, readiness, clean exit.

This module owns the process around a `ShardServer`: it claims
``<data_dir>/shard-<i>/daemon.pid``, logs to stderr (and to that directory's
``daemon.log`` when run in the foreground), turns SIGTERM / SIGINT into the
server's stop event, reports readiness to a waiting parent (`daemon.notify_ready`)
once the sockets are bound, and exits 0 after the server drained and
checkpointed (1 when it could not start or failed).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import zmq

from paramserver.plumbing import daemon
from paramserver.plumbing.curve import CurveError
from paramserver.server.config import ShardConfig

logger = logging.getLogger(__name__)


def shard_dir(cfg: ShardConfig, index: int) -> Path:
    """The directory of shard `index` (pid file, log, write-ahead log, checkpoints).

    Args:
        cfg: cluster settings.
        index: shard index.

    Returns:
        ``<data_dir>/shard-<index>``.
    """
    return daemon.shard_dir(cfg.data_dir, index)


def _announce(server, index: int, finished: threading.Event) -> None:
    """Report readiness once the server has bound its sockets (or give up when it ends)."""
    while not finished.is_set():
        if server.ready.wait(0.05) and server.bound_endpoints is not None:
            router, pub = server.bound_endpoints
            logger.info("shard %d ready: router %s, pub %s", index, router, pub)
            daemon.notify_ready({"shard": index, "router": router, "pub": pub, "pid": os.getpid()})
            return


def serve_shard(
    cfg: ShardConfig,
    index: int,
    endpoints: list[tuple[str, str]] | None = None,
    router_bind: str | None = None,
    pub_bind: str | None = None,
    metrics_port: int = 0,
) -> int:
    """Serve one shard in this process until SIGTERM / SIGINT.

    Args:
        cfg: cluster settings.
        index: shard index.
        endpoints: connect addresses of every shard for the welcome (None: local layout).
        router_bind: ROUTER bind address (None: from cfg).
        pub_bind: PUB bind address (None: from cfg).
        metrics_port: serve Prometheus metrics of this shard on this port (0: off).

    Returns:
        Exit code: 0 after a clean drain, 1 on failure (logged as one line).
    """
    from paramserver.server.shard import ShardServer  # imports jax/optax: only where a shard runs

    directory = shard_dir(cfg, index)
    try:
        stop = daemon.enter_foreground(directory, cfg.log_level)
    except (daemon.DaemonError, OSError) as exc:
        logger.error("shard %d cannot start: %s", index, exc)
        return 1
    finished = threading.Event()
    metrics = None
    try:
        server = ShardServer(cfg, index, endpoints, router_bind, pub_bind)
        threading.Thread(
            target=_announce, args=(server, index, finished), name="announce", daemon=True
        ).start()
        if metrics_port:
            from paramserver.ops.metrics import MetricsError, serve_metrics

            try:
                metrics = serve_metrics(
                    metrics_port,
                    [server.router_bind.replace("*", "127.0.0.1")],
                    cfg.metrics_bind_host,
                    cfg.curve_secret_key_file,
                    cfg.metrics_token,
                    cfg.data_dir,
                )
            except MetricsError as exc:
                logger.error("shard %d cannot start: %s", index, exc)
                return 1
        try:
            server.serve(stop)
        except zmq.ZMQError as exc:
            logger.error(
                "shard %d cannot bind %s / %s: %s", index, server.router_bind, server.pub_bind, exc
            )
            return 1
        except OSError as exc:
            logger.error("shard %d failed: %s", index, exc)
            return 1
        except CurveError as exc:
            logger.error("shard %d cannot start: %s", index, exc)
            return 1
        logger.info("shard %d drained and stopped; exiting", index)
        return 0
    finally:
        finished.set()
        if metrics is not None:
            metrics.shutdown()
        daemon.release_pid_file(daemon.pid_path(directory))
        daemon.clear_ready()
