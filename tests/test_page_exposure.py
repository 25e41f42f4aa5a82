"""The cluster page under the shards' rule: off loopback it needs CURVE or --insecure and asks for a token;
a flood of half-sent requests holds a fixed number of threads.

A real HTTP server from `serve_metrics` (its sampler scrapes a port where no
shard listens: the page's data is then one shard with an error, enough here).
"""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
import urllib.error
import urllib.request

import pytest
from conftest import free_port, wait_for

from paramserver.ops.metrics import serve_metrics
from paramserver.ops.page_server import PAGE_WORKERS, TOKEN_FILE
from paramserver.server.config import ShardConfig

pytestmark = pytest.mark.timeout(120)

NO_SHARD = ["tcp://127.0.0.1:9"]


def get(port: int, path: str, headers: dict | None = None) -> tuple[int, bytes, dict]:
    """(status, body, headers) of one GET to 127.0.0.1."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def answered(port: int) -> bool:
    """Whether a GET / is answered 200 (a connection closed at once is not)."""
    try:
        return get(port, "/")[0] == 200
    except OSError:
        return False


@pytest.fixture
def page():
    servers = []

    def start(**kw):
        server = serve_metrics(free_port(), NO_SHARD, **kw)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_half_sent_requests_hold_a_bounded_pool_and_time_out(page):
    server = page(host="127.0.0.1")
    port = server.server_port
    assert get(port, "/")[0] == 200
    before = threading.active_count()
    peak = before
    socks = []
    try:
        for _ in range(500):  # a request line and one header, never the blank line that ends it
            s = socket.socket()
            s.settimeout(5)
            try:
                s.connect(("127.0.0.1", port))
                s.sendall(b"GET /api/cluster HTTP/1.1\r\nHost: x\r\n")
            except OSError:  # refused or reset once the queue is full: that is the bound
                s.close()
                continue
            socks.append(s)
            peak = max(peak, threading.active_count())
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            peak = max(peak, threading.active_count())
            time.sleep(0.01)
        print(f"\n500 half-sent requests: threads {before} before, peak {peak}")
        assert peak <= before + PAGE_WORKERS + 1, (before, peak)
        # all but a worker's worth leave; the reads of those that stay time out, and an honest
        # request is answered while they are still open
        for s in socks[PAGE_WORKERS:]:
            s.close()
        wait_for(lambda: answered(port), "an honest request answered", timeout_s=60)
        assert all(s.recv(1) == b"" for s in socks[:PAGE_WORKERS])  # closed by the server
    finally:
        for s in socks:
            s.close()


def test_a_request_trickled_in_below_the_read_timeout_is_cut_at_the_deadline(page):
    server = page(host="127.0.0.1")
    server.request_deadline_s = 1.0
    s = socket.create_connection(("127.0.0.1", server.server_port), timeout=5)
    try:
        s.settimeout(0.3)

        def cut() -> bool:  # one more byte of a header that never ends, well within the timeout
            try:
                s.sendall(b"X")
                return s.recv(1) == b""
            except TimeoutError:
                return False
            except OSError:
                return True

        wait_for(cut, "the trickling connection cut", timeout_s=30, poll_s=0.0)
    finally:
        s.close()


def test_off_loopback_the_page_asks_for_its_token(page, tmp_path):
    server = page(host="0.0.0.0", data_dir=str(tmp_path / "data"))
    port = server.server_port
    token_file = tmp_path / "data" / TOKEN_FILE
    token = token_file.read_text().strip()
    assert len(token) == 32 and stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
    for path in ("/", "/api/cluster", "/metrics", "/static/page.js"):
        code, body, headers = get(port, path)
        assert code == 401 and b"token" in body, (path, code)
        assert headers["WWW-Authenticate"].startswith("Bearer")
    assert get(port, "/api/cluster", {"Authorization": "Bearer wrong"})[0] == 401
    assert get(port, "/?token=wrong")[0] == 401
    code, _, headers = get(port, f"/?token={token}")
    assert code == 200
    cookie = headers["Set-Cookie"].split(";")[0]
    assert get(port, "/api/cluster", {"Cookie": cookie})[0] == 200
    assert get(port, "/metrics", {"Authorization": f"Bearer {token}"})[0] == 200
    # a second start keeps the same token; a given one wins
    again = page(host="0.0.0.0", data_dir=str(tmp_path / "data"))
    assert get(again.server_port, "/api/cluster", {"Cookie": cookie})[0] == 200
    given = page(host="0.0.0.0", token="s3cret", data_dir=str(tmp_path / "data"))
    assert get(given.server_port, "/", {"Authorization": "Bearer s3cret"})[0] == 200
    assert get(given.server_port, "/", {"Cookie": cookie})[0] == 401


def test_a_page_off_loopback_needs_curve_or_insecure():
    with pytest.raises(ValueError, match="metrics_host") as refused:
        ShardConfig(metrics_port=9100, metrics_host="0.0.0.0")
    assert "--insecure" in str(refused.value) and "127.0.0.1" in str(refused.value)
    assert ShardConfig(metrics_port=9100, metrics_host="0.0.0.0", insecure=True).metrics_port
    assert ShardConfig(metrics_port=9100, metrics_host="127.0.0.1").metrics_port
    assert ShardConfig(metrics_port=0, metrics_host="0.0.0.0").metrics_port == 0
