"""The supervisor's HTTP endpoint: the cluster page, its JSON, and Prometheus metrics.

This module owns the HTTP side of `--metrics-port`: one threaded server that
answers

- ``/`` the cluster page (static HTML + JS shipped in ``paramserver/ops/page/``,
  plotting with the vendored uPlot, nothing fetched from elsewhere),
- ``/static/<file>`` the page's scripts and styles (a fixed list),
- ``/api/cluster`` the page's data (`paramserver.ops.cluster_view`),
- ``/metrics`` Prometheus text (`paramserver.ops.metrics.ShardCollector`),

and 404 for anything else. Bound off loopback (`exposure.is_loopback`), every
path asks for the page's token (`page_token`: the `metrics_token` setting,
or one generated at the first start and kept, mode 0600, in
``<data_dir>/metrics.token``): as ``Authorization: Bearer TOKEN`` (a
Prometheus scrape's `authorization`), as ``?token=TOKEN`` (a browser; the
reply sets a cookie, so the page's own requests carry it), or as that
cookie; without it the answer is 401. Requests are served by a pool of
PAGE_WORKERS threads, each read times out after READ_TIMEOUT_S, and at most
PAGE_QUEUE connections wait for a worker (more are closed at once), and a
connection a worker still serves REQUEST_DEADLINE_S after taking it (a peer
that trickles its request, or reads the answer byte by byte) is cut: a flood
of half-sent requests holds a fixed number of threads, each for a bounded time.

A `ClusterSampler` thread asks every shard for its
status every SAMPLE_S seconds (over the wire, with the server's CURVE keys when
the cluster has them, like the metrics scrape) and keeps the newest sample and
a bounded history; `/api/cluster` reads them, so any number of open pages cost
the shards nothing more.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, HTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import zmq

from paramserver.ops.cluster_view import History, Sample, cluster_view
from paramserver.plumbing.curve import ClientKeys
from paramserver.plumbing.exposure import is_loopback
from paramserver.plumbing.private import open_private, private_dir
from paramserver.plumbing.probe import ProbeError, shard_status

logger = logging.getLogger(__name__)

SAMPLE_S = 2.0  # seconds between two status scrapes of the page's sampler
PAGE_WORKERS = 8  # threads answering HTTP requests
PAGE_QUEUE = 64  # accepted connections waiting for a worker; more are closed at once
READ_TIMEOUT_S = 5.0  # a request whose next bytes take longer is dropped
REQUEST_DEADLINE_S = 30.0  # a connection still open this long after it was taken is cut
TOKEN_FILE = "metrics.token"
COOKIE = "diloco_page_token"
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


def page_token(host: str, given: str = "", data_dir: str | os.PathLike = "") -> str | None:
    """The token the page asks for when bound at `host`, or None on loopback (no token).

    Args:
        host: the bind address.
        given: the `metrics_token` setting ("": use or make the data dir's).
        data_dir: where `metrics.token` is kept (made 0600 at the first start);
            "": a fresh token kept in memory only.

    Returns:
        None for a loopback host; else `given`, or the data dir's token.

    Raises:
        OSError: the token file cannot be made or read.
    """
    if is_loopback(host):
        return None
    if given:
        return given
    if not data_dir:
        return secrets.token_hex(16)
    path = Path(private_dir(data_dir)) / TOKEN_FILE
    for _ in range(50):  # another process (a shard's endpoint) may be writing it: wait a little
        try:
            token = path.read_text().strip()
        except FileNotFoundError:
            token = _new_token(path)
        if token:
            return token
        time.sleep(0.02)
    raise OSError(errno.EINVAL, f"{path} holds no token: remove it to make a new one")


def _new_token(path: Path) -> str:
    """Write a fresh token to `path` (0600) unless it appears meanwhile; return what it holds."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    token = secrets.token_hex(16)
    with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as fh:
        fh.write(token + "\n")
    try:
        os.link(tmp, path)  # atomic, and never replaces one another process made
    except FileExistsError:
        token = path.read_text().strip()
    finally:
        tmp.unlink(missing_ok=True)
    return token


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


class PageServer(HTTPServer):
    """The HTTP server (a bounded pool of workers); `shutdown` also stops its sampler."""

    request_queue_size = 128  # the listen backlog
    request_deadline_s = REQUEST_DEADLINE_S

    def __init__(
        self,
        address: tuple[str, int],
        sampler: ClusterSampler,
        metrics: Callable[[str], tuple[bytes, str]],
        token: str | None = None,
    ) -> None:
        """Bind (raises OSError when the port is taken) and remember what to serve.

        Args:
            address: (host, port) to bind.
            sampler: where `/api/cluster` comes from.
            metrics: Accept header -> (Prometheus text, content type) for `/metrics`.
            token: what every request must carry (None: nothing, on loopback).
        """
        host = address[0]
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sampler = sampler
        self.metrics = metrics
        self.token = token
        self.files = page_files()
        self._pool = ThreadPoolExecutor(PAGE_WORKERS, thread_name_prefix="page")
        self._slots = threading.BoundedSemaphore(PAGE_WORKERS + PAGE_QUEUE)
        self._serving: dict[Any, float] = {}  # connection -> when a worker took it
        self._serving_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Hand a connection to the pool, or close it when PAGE_QUEUE already wait."""
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        self._pool.submit(self._work, request, client_address)

    def _work(self, request: Any, client_address: Any) -> None:
        with self._serving_lock:
            self._serving[request] = time.monotonic()
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            with self._serving_lock:
                self._serving.pop(request, None)
            self.shutdown_request(request)
            self._slots.release()

    def service_actions(self) -> None:
        """Cut the connections served longer than request_deadline_s (serve_forever's loop)."""
        cutoff = time.monotonic() - self.request_deadline_s
        with self._serving_lock:
            late = [conn for conn, began in self._serving.items() if began < cutoff]
        for conn in late:  # its worker's read or write ends at once, and it closes the rest
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Log a failed request at DEBUG (a peer that left), not on stderr."""
        logger.debug("page: request from %s failed", client_address, exc_info=True)

    def shutdown(self) -> None:
        """Stop serving, the workers and the sampler."""
        super().shutdown()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.sampler.stop()


class _Handler(BaseHTTPRequestHandler):
    server: PageServer
    timeout = READ_TIMEOUT_S  # each read of the request (StreamRequestHandler sets it)

    def _presented(self, query: str) -> tuple[str | None, bool]:
        """The token the request carries, and whether it came in the query (set the cookie)."""
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            return auth[len("Bearer ") :].strip(), False
        given = parse_qs(query).get("token")
        if given:
            return given[0], True
        try:
            cookie = SimpleCookie(self.headers.get("Cookie", ""))
        except CookieError:
            return None, False
        return (cookie[COOKIE].value if COOKIE in cookie else None), False

    def _authorized(self, query: str) -> bool:
        """Whether the request may be answered; sets `_cookie` when it brought the token."""
        self._cookie = ""
        token = self.server.token
        if token is None:
            return True
        got, from_query = self._presented(query)
        if got is None or not hmac.compare_digest(got.encode(), token.encode()):
            return False
        if from_query:
            self._cookie = f"{COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict"
        return True

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        parts = urlsplit(self.path)
        path = parts.path
        try:
            if not self._authorized(parts.query):
                text = (
                    "this page asks for its token: open /?token=TOKEN (the metrics_token "
                    f"setting, or the data dir's {TOKEN_FILE}); scrapers send "
                    "'Authorization: Bearer TOKEN'\n"
                )
                self._send(401, text.encode(), "text/plain; charset=utf-8", auth=True)
            elif path in self.server.files:
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

    def _send(
        self, code: int, body: bytes, kind: str, cache: bool = True, auth: bool = False
    ) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        if auth:
            self.send_header("WWW-Authenticate", 'Bearer realm="diloco"')
        if getattr(self, "_cookie", ""):
            self.send_header("Set-Cookie", self._cookie)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "max-age=60" if cache and code == 200 else "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        logger.debug("page: %s", format % args)
