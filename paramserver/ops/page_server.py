"""The supervisor's HTTP endpoint: the cluster page, its JSON, and Prometheus metrics.

This module owns the HTTP side of `--metrics-port`: one threaded server that
answers

- ``/`` the cluster page (static HTML + JS shipped in ``paramserver/ops/page/``,
  plotting with the vendored uPlot, nothing fetched from elsewhere),
- ``/static/<file>`` the page's scripts and styles (a fixed list),
- ``/api/cluster`` the page's data (`paramserver.ops.cluster_view`),
- ``/metrics`` Prometheus text (`paramserver.ops.metrics.ShardCollector`),

and 404 for anything else. A `ClusterSampler` thread asks every shard for its
status every SAMPLE_S seconds (over the wire, with the server's CURVE keys when
the cluster has them, like the metrics scrape) and keeps the newest sample and
a bounded history; `/api/cluster` reads them, so any number of open pages cost
the shards nothing more.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

import zmq

from paramserver.ops.cluster_view import History, Sample, cluster_view
from paramserver.plumbing.curve import ClientKeys
from paramserver.plumbing.probe import ProbeError, shard_status

logger = logging.getLogger(__name__)

SAMPLE_S = 2.0  # seconds between two status scrapes of the page's sampler
_STATUS_TIMEOUT_S = 2.0

# url path -> (file under page/, content type)
_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/static/page.js": ("page.js", "text/javascript; charset=utf-8"),
    "/static/page.css": ("page.css", "text/css; charset=utf-8"),
    "/static/uPlot.iife.min.js": ("vendor/uPlot.iife.min.js", "text/javascript; charset=utf-8"),
    "/static/uPlot.min.css": ("vendor/uPlot.min.css", "text/css; charset=utf-8"),
    "/static/uPlot.LICENSE.txt": ("vendor/LICENSE", "text/plain; charset=utf-8"),
}


def page_files() -> dict[str, tuple[bytes, str]]:
    """The page's files as served: url path -> (bytes, content type).

    Returns:
        Every entry of the fixed list, read from the package data.
    """
    root = resources.files("paramserver.ops") / "page"
    return {url: ((root / name).read_bytes(), kind) for url, (name, kind) in _FILES.items()}


class ClusterSampler:
    """A thread that scrapes every shard's status at an interval and keeps the page's data."""

    def __init__(
        self,
        endpoints: Sequence[str],
        curve: ClientKeys | None = None,
        interval_s: float = SAMPLE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Remember whom to ask; nothing is asked before `start`.

        Args:
            endpoints: ROUTER endpoint of each shard, in shard order.
            curve: client keys for CURVE shards (None: plain).
            interval_s: seconds between two scrapes.
            clock: wall-clock seconds (the shards report wall-clock times).
        """
        self.endpoints = list(endpoints)
        self.curve = curve
        self.interval_s = interval_s
        self.clock = clock
        self.history = History()
        self._lock = threading.Lock()
        self._latest: Sample | None = None
        self._before: Sample | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cluster-sampler", daemon=True)

    def start(self) -> None:
        """Scrape once now (so the page has data at once), then every interval."""
        self._thread.start()

    def stop(self) -> None:
        """End the thread (it finishes the scrape in progress, a few seconds at most)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=_STATUS_TIMEOUT_S * (len(self.endpoints) + 1))

    def _run(self) -> None:
        ctx = zmq.Context()
        try:
            while not self._stop.is_set():
                self.sample(ctx)
                self._stop.wait(self.interval_s)
        finally:
            ctx.destroy(linger=0)

    def sample(self, ctx: zmq.Context) -> Sample:
        """Scrape every shard once and keep the result.

        Args:
            ctx: the ZeroMQ context to scrape with.

        Returns:
            The new sample.
        """
        shards: list[dict[str, Any]] = []
        for index, endpoint in enumerate(self.endpoints):
            if self._stop.is_set():
                return self._latest or Sample(self.clock(), ())
            try:
                status = shard_status(ctx, endpoint, _STATUS_TIMEOUT_S, self.curve)
                shards.append({**status, "shard": status.get("shard", index), "endpoint": endpoint})
            except ProbeError as exc:
                shards.append({"shard": index, "endpoint": endpoint, "error": str(exc)})
        sample = Sample(self.clock(), tuple(shards))
        with self._lock:
            self.history.add(sample)
            self._before, self._latest = self._latest, sample
        return sample

    def view(self) -> dict[str, Any]:
        """The `/api/cluster` document of the newest sample.

        Returns:
            `cluster_view`'s document; before the first sample, one with no shards.
        """
        with self._lock:
            latest = self._latest or Sample(self.clock(), ())
            return cluster_view(latest, self._before, self.history, self.interval_s)


class PageServer(ThreadingHTTPServer):
    """The HTTP server; `shutdown` also stops its sampler."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        sampler: ClusterSampler,
        metrics: Callable[[str], tuple[bytes, str]],
    ) -> None:
        """Bind (raises OSError when the port is taken) and remember what to serve.

        Args:
            address: (host, port) to bind.
            sampler: where `/api/cluster` comes from.
            metrics: Accept header -> (Prometheus text, content type) for `/metrics`.
        """
        host = address[0]
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sampler = sampler
        self.metrics = metrics
        self.files = page_files()
        super().__init__(address, _Handler)

    def shutdown(self) -> None:
        """Stop serving and stop the sampler."""
        super().shutdown()
        self.sampler.stop()


class _Handler(BaseHTTPRequestHandler):
    server: PageServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = urlsplit(self.path).path
        try:
            if path in self.server.files:
                self._send(200, *self.server.files[path])
            elif path == "/api/cluster":
                body = json.dumps(self.server.sampler.view(), allow_nan=False).encode()
                self._send(200, body, "application/json", cache=False)
            elif path == "/metrics":
                self._send(200, *self.server.metrics(self.headers.get("Accept", "")), cache=False)
            else:
                text = f"not found: {path}; the cluster page is at /, its data at /api/cluster\n"
                self._send(404, text.encode(), "text/plain; charset=utf-8")
        except (BrokenPipeError, ConnectionResetError):
            logger.debug("page: the browser left before %s was sent", path)
        except Exception as exc:  # a bug answers 500 and is logged; the server stays up
            logger.exception("page: error answering %s", path)
            self._send(500, f"error: {exc}\n".encode(), "text/plain; charset=utf-8")

    def _send(self, code: int, body: bytes, kind: str, cache: bool = True) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "max-age=60" if cache and code == 200 else "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        logger.debug("page: %s", format % args)
