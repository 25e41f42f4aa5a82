"""ZeroMQ CURVE authentication: key files, the shard's allow-list (ZAP), and socket options.

This module owns everything CURVE: writing and reading key pairs (z85 keys in
ZeroMQ's certificate format, readable by `zmq.auth.load_certificate`), the
shard side (`CurveServer`: a ZAP authenticator thread that admits only the
island public keys found in an allow directory, plus the shard's own key, and
logs every refusal; a socket monitor that logs handshakes failing before ZAP,
e.g. a client with no key; and the `IslandGuard` that binds each key to the
island ids it may act as, `paramserver.plumbing.identity`), and the client side
(`secure_client`, `ClientKeys`, and `HandshakeWatch`, which tells an operator
tool why a shard stays silent: a CURVE mismatch or a refused key).

Key files, as `diloco-server keys --out DIR --name NAME` writes them:

    NAME.key          the public key (share it: islands' go into the server's
                      allow directory, the server's goes to every island)
    NAME.key_secret   public and secret key, mode 0600 (keep it private)

(Over 400 lines: CURVE is one concept seen from both ends of a socket; the
client half is small and shares the key-file format with the shard half.)
"""

from __future__ import annotations

import logging
import os
import threading
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from paramserver.plumbing.identity import AllowMapError, IslandGuard, island_ids, read_allow_map

logger = logging.getLogger(__name__)

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"

_HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class CurveError(ValueError):
    """A key file or key setting cannot be used; the message says which and what to do."""


def _key_text(public: bytes, secret: bytes | None) -> str:
    lines = [
        "#   ZeroMQ CURVE certificate written by diloco-server keys",
        "#   " + ("keep this file private" if secret else "public key: safe to share"),
        "metadata",
        "curve",
        f'    public-key = "{public.decode()}"',
    ]
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def check_key_name(name: str) -> None:
    """Refuse a key name that is no plain file stem.

    Args:
        name: e.g. "server" or an island id.

    Raises:
        CurveError: empty, starting with ".", or holding other than letters, digits, "-", "_", ".".
    """
    if not name or not all(ch.isalnum() or ch in "-_." for ch in name) or name.startswith("."):
        raise CurveError(f"key name {name!r}: use letters, digits, '-', '_' or '.'")


def write_keypair(out_dir: str | Path, name: str) -> tuple[Path, Path]:
    """Create a new CURVE key pair as NAME.key (public) and NAME.key_secret (mode 0600).

    Args:
        out_dir: directory (created if missing).
        name: file stem, e.g. "server" or an island id; letters, digits, "-", "_", ".".

    Returns:
        (public key file, secret key file).

    Raises:
        CurveError: a bad name, or either file exists already (never overwritten).
    """
    check_key_name(name)
    if not zmq.has("curve"):
        raise CurveError("this libzmq was built without CURVE support")
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    public_path = directory / f"{name}{PUBLIC_SUFFIX}"
    secret_path = directory / f"{name}{SECRET_SUFFIX}"
    for path in (public_path, secret_path):
        if path.exists():
            raise CurveError(f"{path} exists; choose another --name or remove it first")
    public, secret = zmq.curve_keypair()
    # The secret file is created 0600 from the start (never readable by others).
    fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(_key_text(public, secret))
    public_path.write_text(_key_text(public, None))
    return public_path, secret_path


def load_keypair(secret_file: str | Path) -> tuple[bytes, bytes]:
    """Read a key pair from a NAME.key_secret file.

    Args:
        secret_file: path written by `write_keypair`.

    Returns:
        (public key, secret key), z85 bytes.

    Raises:
        CurveError: missing, unreadable, or holding no secret key.
    """
    public, secret = _load(secret_file)
    if not secret:
        raise CurveError(f"{secret_file} holds no secret key: give the NAME{SECRET_SUFFIX} file")
    return public, secret


def load_public_key(key_file: str | Path) -> bytes:
    """Read the public key from a NAME.key (or NAME.key_secret) file.

    Args:
        key_file: path written by `write_keypair`.

    Returns:
        The public key, z85 bytes.

    Raises:
        CurveError: missing or unreadable.
    """
    return _load(key_file)[0]


def _load(path: str | Path) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise CurveError(f"cannot read CURVE key file {path}: {exc}") from None
    if not public or len(public) != 40:
        raise CurveError(f"{path} holds no valid public key")
    return public, secret


def allowed_keys(allow_dir: str | Path) -> frozenset[bytes]:
    """The public keys of every NAME.key file in a directory.

    Args:
        allow_dir: the allow-list directory.

    Returns:
        The z85 public keys.

    Raises:
        CurveError: not a directory, or no key file in it (nobody could connect).
    """
    return frozenset(key_files(allow_dir).values())


def key_files(allow_dir: str | Path) -> dict[str, bytes]:
    """The public key of every NAME.key file in a directory, by file stem.

    Args:
        allow_dir: the allow-list directory.

    Returns:
        {NAME: z85 public key}.

    Raises:
        CurveError: not a directory, or no key file in it (nobody could connect).
    """
    directory = Path(allow_dir)
    if not directory.is_dir():
        raise CurveError(f"CURVE allow directory {directory} does not exist")
    keys = {
        p.name[: -len(PUBLIC_SUFFIX)]: load_public_key(p)
        for p in sorted(directory.glob(f"*{PUBLIC_SUFFIX}"))
    }
    if not keys:
        raise CurveError(
            f"no *{PUBLIC_SUFFIX} file in {directory}: copy each island's public key there"
        )
    return keys


def island_guard(
    allow_dir: str | Path, allow_map_file: str | Path | None, own_public: bytes, shard: int
) -> IslandGuard:
    """The shard's binding of allowed keys to island ids (`paramserver.plumbing.identity`).

    Args:
        allow_dir: the allow-list directory (NAME.key may act as island NAME).
        allow_map_file: optional TOML allow map granting more ids ("" or None: none).
        own_public: the shard's public key (admitted, acts as no island).
        shard: shard index (for log lines).

    Returns:
        The guard.

    Raises:
        CurveError: the directory or the allow map cannot be used.
    """
    files = key_files(allow_dir)
    try:
        extra = read_allow_map(allow_map_file, files) if allow_map_file else {}
    except AllowMapError as exc:
        raise CurveError(str(exc)) from None
    stems: dict[str, list[str]] = defaultdict(list)
    for stem, key in files.items():
        stems[key.decode()].append(stem)
    allow = island_ids(stems, extra)
    names = {user: "/".join(sorted(s)) for user, s in stems.items()}
    own = own_public.decode()
    allow.setdefault(own, frozenset())
    names.setdefault(own, "of the server")
    return IslandGuard(allow, names, shard)


def secure_client(sock: zmq.Socket, public: bytes, secret: bytes, server_public: bytes) -> None:
    """Make a DEALER or SUB socket a CURVE client (before connect).

    Args:
        sock: the socket.
        public: this island's public key.
        secret: this island's secret key.
        server_public: the shards' public key.
    """
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_serverkey = server_public


@dataclass(frozen=True)
class ClientKeys:
    """A client's CURVE keys: its own pair and the shard's public key (z85 bytes)."""

    public: bytes
    secret: bytes
    server_public: bytes

    @classmethod
    def load(cls, secret_key_file: str | Path, server_key_file: str | Path) -> ClientKeys:
        """Read a client's key pair and the server's public key.

        Args:
            secret_key_file: the client's NAME.key_secret (an allow-listed key, or
                the server's own pair on the server host).
            server_key_file: the shards' NAME.key (or NAME.key_secret).

        Returns:
            The keys.

        Raises:
            CurveError: a file is missing or unusable.
        """
        public, secret = load_keypair(secret_key_file)
        return cls(public, secret, load_public_key(server_key_file))

    def apply(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE client with these keys (before connect).

        Args:
            sock: a DEALER or SUB socket.
        """
        secure_client(sock, self.public, self.secret, self.server_public)


_CLIENT_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILURES


class HandshakeWatch:
    """Watches one client socket's handshakes, to say why a shard stays silent."""

    def __init__(self, sock: zmq.Socket, curve: bool) -> None:
        """Start monitoring (call before connect).

        Args:
            sock: the client socket.
            curve: whether `sock` is a CURVE client.
        """
        self.curve = curve
        self.monitor = sock.get_monitor_socket(_CLIENT_EVENTS)
        self._sock = sock
        self._failure: tuple[int, int] | None = None

    def failure(self, endpoint: str) -> str | None:
        """Read pending events; a one-line explanation once a handshake failed.

        Args:
            endpoint: the address connected to (for the message).

        Returns:
            None while no handshake failed (or one succeeded since); else the
            likely cause and what to change.
        """
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._failure = None
            elif event["event"] & _HANDSHAKE_FAILURES:
                self._failure = (event["event"], event["value"])
        if self._failure is None:
            return None
        return handshake_advice(endpoint, self.curve, *self._failure)

    def close(self) -> None:
        """Stop monitoring (before the socket closes)."""
        if not self._sock.closed:
            self._sock.disable_monitor()
        self.monitor.close(linger=0)


def handshake_advice(endpoint: str, curve: bool, event: int, value: int) -> str:
    """What a failed client handshake most likely means, in one line.

    A plain client's handshake with a CURVE shard fails, usually without
    detail (the shard drops the connection first); so does a CURVE client's with
    a plain shard or with a wrong server key. A key ZAP refused fails with AUTH.

    Args:
        endpoint: the shard's address.
        curve: whether the client spoke CURVE.
        event: the monitor event (a zmq.EVENT_HANDSHAKE_FAILED_*).
        value: its value (a protocol error code, ZAP status or errno).

    Returns:
        The explanation, naming the options to change.
    """
    if not curve:
        return (
            f"the handshake with {endpoint} failed: it speaks CURVE, most likely; give "
            "--curve-secret-key-file (an allow-listed key pair, or the server's own) and "
            "--curve-server-key-file (the server's .key)"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"{endpoint} refused our CURVE key (ZAP status {value}): put its .key in the shard's "
            "curve_allow_dir, or use the server's own key pair"
        )
    mismatch = getattr(zmq, "PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH", 0x11000002)
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == mismatch:
        return f"{endpoint} does not speak CURVE (security mechanism mismatch): drop the CURVE keys"
    return (
        f"the CURVE handshake with {endpoint} failed: is --curve-server-key-file the server's "
        ".key, and does the shard run with CURVE?"
    )


class _AllowList:
    """ZAP credentials provider: admits the listed keys, logs and counts every refusal."""

    def __init__(self, keys: frozenset[bytes], shard: int) -> None:
        self.keys = keys
        self.shard = shard
        self.denied = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        self.denied += 1
        logger.warning(
            "shard %d refused a CURVE client: public key %s is not in the allow list",
            self.shard,
            key.decode(errors="replace"),
            extra={"shard": self.shard, "client_key": key.decode(errors="replace")},
        )
        return False


class CurveServer:
    """The shard's CURVE side: ZAP allow-list, server socket options, handshake-failure log."""

    def __init__(
        self,
        ctx: zmq.Context,
        secret_key_file: str,
        allow_dir: str,
        shard: int,
        allow_map_file: str = "",
    ) -> None:
        """Load the shard's key pair, the allow-list and its island binding (nothing starts yet).

        Args:
            ctx: the shard's context (the authenticator serves ZAP for it).
            secret_key_file: the shard's NAME.key_secret.
            allow_dir: directory of island NAME.key files.
            shard: shard index (for log lines).
            allow_map_file: optional TOML allow map (more island ids per key).

        Raises:
            CurveError: a key file, the allow directory or the allow map cannot be used.
        """
        self.public, self.secret = load_keypair(secret_key_file)
        self.guard = island_guard(allow_dir, allow_map_file, self.public, shard)
        # The shard's own key is admitted: operator tools on the server host use it.
        self.allow = _AllowList(allowed_keys(allow_dir) | {self.public}, shard)
        self.shard = shard
        self._ctx = ctx
        self._auth: ThreadAuthenticator | None = None
        self._watchers: list[tuple[zmq.Socket, threading.Thread]] = []
        self._stop = threading.Event()

    @property
    def denied(self) -> int:
        """Clients refused by the allow-list so far."""
        return self.allow.denied

    def start(self) -> CurveServer:
        """Start the ZAP authenticator thread.

        Returns:
            self.
        """
        self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger(f"{__name__}.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self.allow)
        logger.info(
            "shard %d: CURVE on, %d island key(s) allowed (and the server's own)",
            self.shard,
            len(self.allow.keys - {self.public}),
        )
        return self

    def secure(self, sock: zmq.Socket, role: str) -> None:
        """Make a ROUTER or PUB socket a CURVE server and log its failed handshakes (before bind).

        Args:
            sock: the socket.
            role: "router" or "pub" (for log lines).
        """
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True
        monitor = sock.get_monitor_socket(_HANDSHAKE_FAILURES)
        thread = threading.Thread(
            target=self._watch, args=(monitor, role), name=f"curve-monitor-{role}", daemon=True
        )
        thread.start()
        self._watchers.append((sock, thread))

    def _watch(self, monitor: zmq.Socket, role: str) -> None:
        try:
            while not self._stop.is_set():
                if not monitor.poll(100):
                    continue
                event = recv_monitor_message(monitor)
                if event["event"] & _HANDSHAKE_FAILURES:
                    logger.warning(
                        "shard %d %s: a client failed the CURVE handshake (%s): "
                        "no key, a wrong server key, or a key not in the allow list",
                        self.shard,
                        role,
                        event["endpoint"].decode(errors="replace"),
                    )
        except zmq.ZMQError:
            pass
        finally:
            monitor.close(linger=0)

    def stop(self) -> None:
        """Stop the monitors and the authenticator (call before closing the sockets)."""
        self._stop.set()
        for sock, thread in self._watchers:
            thread.join(2.0)
            if not sock.closed:
                sock.disable_monitor()
        self._watchers.clear()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
