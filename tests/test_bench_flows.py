"""`bench.flows` and its relay: bytes arrive whole and in order, every push is acked once.

No wall-clock ratio is asserted: the figures are the bench's, on a loaded machine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from bench import flows
from bench.window_relay import WindowRelay


def _sink(listener: socket.socket, got: bytearray, done: threading.Event) -> None:
    conn, _ = listener.accept()
    with conn:
        while data := conn.recv(1 << 16):
            got.extend(data)
        conn.sendall(b"ok")
    done.set()


@pytest.mark.timeout(30)
def test_the_relay_delivers_every_byte_in_order_and_counts_them():
    payload = bytes(range(256)) * 1000  # 256,000 bytes through a 16 KiB window
    got = bytearray()
    done = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sink = threading.Thread(target=_sink, args=(listener, got, done), daemon=True)
        sink.start()
        with WindowRelay(window_bytes=16 * 1024, one_way_s=0.001) as relay:
            relay.serve(("127.0.0.1", listener.getsockname()[1]))
            with socket.create_connection(("127.0.0.1", relay.port), timeout=20) as client:
                client.sendall(payload)
                client.shutdown(socket.SHUT_WR)
                reply = b""
                while chunk := client.recv(16):
                    reply += chunk
            assert done.wait(20)
            counted = relay.flow_bytes()
    assert bytes(got) == payload
    assert reply == b"ok"
    assert [(f.up, f.down) for f in counted] == [(len(payload), 2)]


@pytest.mark.timeout(120)
def test_measure_reports_both_runs_and_every_push_acked_once():
    fragments, values, window, one_way_s, links = 3, 16 * 1024, 16 * 1024, 0.002, 2
    report = flows.measure(links, fragments, values, window, one_way_s, timeout_s=60.0)
    round_bytes = fragments * values * 4
    assert report["window_bytes"] == window
    assert report["one_way_s"] == one_way_s
    assert report["flow_cap_MB_per_s"] == pytest.approx(window / one_way_s / 1e6, abs=1e-3)
    assert (report["fragments"], report["fragment_bytes"], report["links"]) == (
        fragments, values * 4, links,
    )  # fmt: skip
    assert [r["bulk_links"] for r in report["runs"]] == [1, links]
    for r in report["runs"]:
        assert r["round_bytes"] == round_bytes
        assert r["client"]["pushes"] == fragments
        assert r["client"]["acked"] == fragments
        assert r["client"]["duplicates"] == 0
        assert r["client"]["rejected"] == {}
        assert r["shard"] == {"accepted": fragments, "duplicates": 0}
        # a control connection and the bulk ones, more only after a reconnect
        assert r["connections"] >= 1 + r["bulk_links"]
        # every frame the client sent crossed the relay (plus ZMTP framing): the init's
        # values and the round's pushes, each at least the round's bytes
        assert sum(r["bytes_up_per_connection"]) >= r["client"]["bytes_sent"]
        assert r["client"]["bytes_sent"] >= 2 * round_bytes
        assert r["join_s"] > 0 and r["round_s"] > 0
    assert set(report["speedup"]) == {"round", "join"}
    assert len(report["load_before"]) == len(report["load_after"]) == 3


def _read_all(file) -> str:
    file.seek(0)
    return file.read()


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "bench.flows", *argv]


TINY = ("--links", "2", "--fragments", "3", "--fragment-mib", "0.0625", "--one-way-ms", "2",
        "--window-kib", "16", "--timeout-s", "60")  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_command_prints_json_and_sigterm_ends_it():
    done = subprocess.run(_cli(*TINY), capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-500:]
    report = json.loads(done.stdout)
    assert [r["client"]["acked"] for r in report["runs"]] == [3, 3]

    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            _cli("--fragment-mib", "2", "--window-kib", "16"), stdout=subprocess.DEVNULL,
            stderr=err, text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while "joined" not in _read_all(err):
                assert proc.poll() is None, "the bench exited before its first join"
                assert time.monotonic() < deadline, "no join within 120 s"
                time.sleep(0.1)
            os.kill(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
