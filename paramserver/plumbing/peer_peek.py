"""What answers at an endpoint that stays silent: nothing, a shard's PUB port, CURVE, not ZeroMQ.

A DEALER connected to the wrong port hears nothing and ZeroMQ says nothing
(a refused connection is retried quietly; a PUB peer fails the handshake
without detail). When a join or a probe times out, `silence_cause` opens a
plain TCP connection and reads the peer's ZMTP 3 greeting (RFC 23): the
security mechanism it speaks and, under NULL security, the socket type in
its READY command (``Socket-Type``), and says in one phrase what that
means for `--connect`. It sends only its own greeting, never a command, and
reads at most one command; nothing here keeps state or imports our code.
"""

from __future__ import annotations

import socket
import struct

# ZMTP 3.0 greeting: signature, version 3.0, mechanism NULL, as-server 0, filler (64 bytes)
_GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + bytes(32)
_COMMAND_FLAG, _LONG_FLAG = 0x04, 0x02


def _recv_exactly(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _properties(body: bytes) -> dict[str, bytes]:
    """The metadata of a READY command body (name length, name, then properties)."""
    at = 1 + body[0]
    props = {}
    while at < len(body):
        size = body[at]
        name = body[at + 1 : at + 1 + size].decode("ascii", "replace")
        (length,) = struct.unpack(">I", body[at + 1 + size : at + 5 + size])
        props[name.lower()] = body[at + 5 + size : at + 5 + size + length]
        at += 5 + size + length
    return props


def peer_kind(host: str, port: int, timeout_s: float = 1.0) -> str:
    """What speaks at host:port, read from its ZMTP greeting.

    Args:
        host: the peer's host name or address.
        port: its TCP port.
        timeout_s: bound on connecting and on each read.

    Returns:
        "refused" (nothing listens), "unreachable", "silent" (no greeting in
        time), "not-zmtp", "curve" (or another mechanism's name in lower case),
        or the socket type of a NULL-security peer ("ROUTER", "PUB", ...).
    """
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(_GREETING)
            greeting = _recv_exactly(sock, 64)
            if greeting[0] != 0xFF or greeting[9] != 0x7F:
                return "not-zmtp"
            mechanism = greeting[12:32].rstrip(b"\x00").decode("ascii", "replace")
            if mechanism != "NULL":
                return mechanism.lower()
            flags = _recv_exactly(sock, 1)[0]
            if not flags & _COMMAND_FLAG:
                return "not-zmtp"
            size_bytes = _recv_exactly(sock, 8 if flags & _LONG_FLAG else 1)
            size = struct.unpack(">Q", size_bytes)[0] if flags & _LONG_FLAG else size_bytes[0]
            body = _recv_exactly(sock, size)
            kind = _properties(body).get("socket-type", b"")
            return kind.decode("ascii", "replace").upper() or "not-zmtp"
    except ConnectionRefusedError:
        return "refused"
    except (TimeoutError, EOFError):
        return "silent"
    except (OSError, IndexError, struct.error):
        return "unreachable"


def _host_port(endpoint: str) -> tuple[str, int] | None:
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://") :].rsplit(";", 1)[-1].rpartition(":")
    if not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port)


def silence_cause(endpoint: str, timeout_s: float = 1.0, curve: bool = False) -> str | None:
    """Why a shard's ROUTER at `endpoint` may not answer, in one phrase, or None if unknown.

    Args:
        endpoint: the --connect endpoint (only tcp:// is examined).
        timeout_s: bound on the look.
        curve: the caller spoke CURVE (a CURVE peer is then no news: None).

    Returns:
        e.g. "tcp://h:5556 answered like a PUB socket (a shard's update port) ...";
        None for a ROUTER (it is a shard, silent for another reason), a non-tcp
        endpoint, or a peer that says nothing.
    """
    where = _host_port(endpoint)
    if where is None:
        return None
    host, port = where
    kind = peer_kind(host, port, timeout_s)
    if kind == "refused":
        return f"nothing listens at {host}:{port} (connection refused): is the server running?"
    if kind == "PUB":
        return (
            f"{endpoint} answered like a PUB socket (a shard's update port), not a shard's "
            f"ROUTER: --connect takes the ROUTER port (shard i: --port + 2i; try port {port - 1})"
        )
    if kind == "curve" and not curve:
        return f"{endpoint} speaks CURVE: give the CURVE key files"
    if kind == "not-zmtp":
        return f"{endpoint} answered, but not as a ZeroMQ socket: is it the server's port?"
    if kind.isupper() and kind != "ROUTER":
        return f"{endpoint} answered like a {kind} socket, not a shard's ROUTER"
    return None
