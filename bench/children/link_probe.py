"""The regions bench's own TCP probe: round-trip time and throughput of one emulated link.

    python -m bench.children.link_probe serve --host IP --port P
    python -m bench.children.link_probe measure --host IP --port P [--seconds 2 | --bytes N]
                                                [--pings 15]

`serve` (inside the target region's namespace) accepts connections; the first
byte of each says what it wants: ``E`` echo (64-byte pings sent back as they
come), ``S`` sink (reads to end of stream, then answers with the bytes it
read and the seconds from the first byte to the last, as 8-byte unsigned +
8-byte double, network order). It prints ``ready`` once listening and runs
until SIGTERM.

`measure` (inside the source region's namespace, through the WAN relay)
times `--pings` pings, then streams for `--seconds` (or exactly `--bytes`:
what the link should carry in the time wanted, so that what the relay and
the socket buffers hold does not drag the probe on) and prints one JSON
line: {"rtt_ms_median", "rtt_ms_min", "rtt_ms_max", "bytes", "seconds",
"mbit_s"}. The rate is the receiver's: bytes after the first chunk over the
time from the first chunk to the last, so the queue the sender filled is
not counted as carried.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import sys
import threading
import time

from bench.child import say_ready, stop_on_signals

PING = 64
BLOCK = 256 * 1024
REPLY = struct.Struct("!Qd")
TIMEOUT_S = 30.0


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("closed early")
        buf += part
    return bytes(buf)


def _serve_one(conn: socket.socket) -> None:
    with conn:
        conn.settimeout(TIMEOUT_S)
        try:
            mode = _recv_exact(conn, 1)
            if mode == b"E":
                while True:
                    conn.sendall(_recv_exact(conn, PING))
            elif mode == b"S":
                first_at = last_at = 0.0
                total = first = 0
                while data := conn.recv(BLOCK):
                    last_at = time.monotonic()
                    if not total:
                        first_at, first = last_at, len(data)
                    total += len(data)
                conn.sendall(REPLY.pack(total - first, max(last_at - first_at, 0.0)))
        except (OSError, ConnectionError):
            pass


def serve(host: str, port: int) -> int:
    """Serve pings and sinks until SIGTERM.

    Args:
        host: address to listen on.
        port: TCP port.

    Returns:
        0.
    """
    stop = stop_on_signals()
    listener = socket.create_server((host, port), reuse_port=False)
    listener.settimeout(0.2)
    say_ready()
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        except OSError:
            break
        threading.Thread(target=_serve_one, args=(conn,), daemon=True).start()
    listener.close()
    return 0


def measure(host: str, port: int, seconds: float, pings: int, nbytes: int = 0) -> dict[str, float]:
    """Ping, then stream, through the link to a `serve` at host:port.

    Args:
        host: the address that routes through the link (the relay's pair address).
        port: the probe server's port.
        seconds: how long to stream.
        pings: how many pings to time.
        nbytes: stream exactly this many bytes instead (when > 0).

    Returns:
        RTT figures (ms) and the receiver's rate.
    """
    rtts = []
    with socket.create_connection((host, port), timeout=TIMEOUT_S) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(b"E")
        payload = b"p" * PING
        for _ in range(pings):
            t0 = time.perf_counter()
            sock.sendall(payload)
            _recv_exact(sock, PING)
            rtts.append((time.perf_counter() - t0) * 1000.0)
    block = b"\0" * BLOCK
    with socket.create_connection((host, port), timeout=TIMEOUT_S) as sock:
        sock.sendall(b"S")
        end = time.monotonic() + seconds
        left = nbytes
        while (left > 0) if nbytes > 0 else (time.monotonic() < end):
            sock.sendall(block[:left] if 0 < left < BLOCK else block)
            left -= BLOCK
        sock.shutdown(socket.SHUT_WR)
        nbytes, elapsed = REPLY.unpack(_recv_exact(sock, REPLY.size))
    return {
        "rtt_ms_median": statistics.median(rtts) if rtts else 0.0,
        "rtt_ms_min": min(rtts, default=0.0),
        "rtt_ms_max": max(rtts, default=0.0),
        "bytes": nbytes,
        "seconds": elapsed,
        "mbit_s": nbytes * 8 / elapsed / 1e6 if elapsed > 0 else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (1 when the measurement failed)."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.children.link_probe", description=__doc__
    )
    parser.add_argument("mode", choices=["serve", "measure"])
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--bytes", type=int, default=0, help="stream this many bytes instead")
    parser.add_argument("--pings", type=int, default=15)
    args = parser.parse_args(argv)
    if args.mode == "serve":
        return serve(args.host, args.port)
    try:
        print(
            json.dumps(measure(args.host, args.port, args.seconds, args.pings, args.bytes)),
            flush=True,
        )
    except (OSError, ConnectionError) as exc:
        print(f"link_probe: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
