"""Private files: what a daemon writes (parameters, deltas, logs, pid files) only its user reads.

Directories are made 0700 and files 0600 whatever the process's umask (an
umask only removes bits, and the modes here grant nothing to group or
others). A file or directory the daemon owns that already exists with a
wider mode (written by an older build) is tightened when it is opened;
a directory the user made (a data dir given on the command line) keeps
its mode, its new subdirectories are private.
"""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700


def private_dir(path: str | os.PathLike, tighten: bool = False) -> Path:
    """Create a directory and its missing parents, each 0700.

    Args:
        path: the directory.
        tighten: also set an existing `path` to 0700 (a directory the daemon owns).

    Returns:
        The directory as a Path.
    """
    path = Path(path)
    missing = []
    probe = path
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:  # made meanwhile by another process
            continue
        os.chmod(directory, PRIVATE_DIR_MODE)  # (an umask may have removed owner bits)
    if tighten and not missing:
        os.chmod(path, PRIVATE_DIR_MODE)
    return path


def open_private(path: str | os.PathLike, flags: int) -> int:
    """`os.open` a file as 0600 (created so, or tightened when it exists).

    Args:
        path: the file.
        flags: os.open flags (O_CREAT and others as needed).

    Returns:
        The file descriptor.
    """
    fd = os.open(path, flags, PRIVATE_FILE_MODE)
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def touch_private(path: str | os.PathLike) -> Path:
    """Make sure a file exists with mode 0600 (e.g. before a log handler appends to it).

    Args:
        path: the file (its missing directories are made 0700).

    Returns:
        The file as a Path.
    """
    path = Path(path)
    private_dir(path.parent)
    os.close(open_private(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND))
    return path
