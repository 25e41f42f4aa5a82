"""An island's session token, ``<data_dir>/session.token``: how a restarted island proves it is the same.

Every `hello` carries the client's `session` (docs/protocol.md, section 9): a
shard lets a hello take an island id over from the connection it is bound to
at once when both carry the same token, and otherwise only after that
connection fell silent for two heartbeat intervals. A token drawn anew per
process would make an island restarted after a kill -9 wait for its dead
connection to fall silent (`island_in_use` refusals meanwhile); this module
keeps the token in the island's data dir instead: created once (32 random
hex digits from `secrets`, file mode 0600: whoever reads it can take the
island id over while the island runs), re-used by every later run with that
data dir. A second live process with the same island id and another data dir
has another token and is still refused.

While a session is open it holds an exclusive lock (`flock`) on the file, so
two live processes never share one data dir's token; the lock goes with the
process (kill -9 included).
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

TOKEN_FILE = "session.token"
TOKEN_MAX = 128  # the protocol's limit on `session`


class TokenInUse(RuntimeError):
    """Another live process holds the data dir's session token."""


def is_token(text: str) -> bool:
    """Whether `text` can be a session token: 1-128 printable characters, no whitespace."""
    return 1 <= len(text) <= TOKEN_MAX and text.isprintable() and not any(c.isspace() for c in text)


@dataclass
class HeldToken:
    """A data dir's token and the open, locked file that proves this process holds it."""

    value: str
    path: Path
    fd: int | None

    def release(self) -> None:
        """Unlock and close the file (the token stays for the next run)."""
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "replace").strip()


def _lock(fd: int, path: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise TokenInUse(
            f"{path} is held by another running island: give each island (and each "
            "process of a multi-process island) its own data dir"
        ) from None


def hold(data_dir: Path) -> HeldToken:
    """The data dir's session token, created on first use, locked until `release`.

    Args:
        data_dir: the island's data dir (exists).

    Returns:
        The held token.

    Raises:
        TokenInUse: another live process holds it.
        OSError: the file cannot be created or read.
    """
    path = data_dir / TOKEN_FILE
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        _lock(fd, path)
        text = _read(fd)
        if not text:  # new (or emptied by a crash before its first write)
            text = secrets.token_hex(16)
            os.ftruncate(fd, 0)
            os.pwrite(fd, (text + "\n").encode(), 0)
            os.fsync(fd)
            dir_fd = os.open(data_dir, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
            logger.info("new session token in %s", path)
            return HeldToken(text, path, fd)
        if is_token(text):
            mode = os.fstat(fd).st_mode & 0o777
            if mode & 0o077:
                logger.warning(
                    "%s is readable by others (mode %o): whoever reads it can take this "
                    "island id over while it runs; chmod 600 it",
                    path,
                    mode,
                )
            return HeldToken(text, path, fd)
        aside = path.with_name(f"{path.name}.unused-{time.time_ns()}")
        os.replace(path, aside)
        os.close(fd)
        logger.warning("%s does not hold a session token; kept as %s, a new one is made",
                       path, aside)  # fmt: skip
