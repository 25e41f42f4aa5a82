"""A whole cluster's CURVE keys in one command (`diloco-server keys --islands`), and the lines using them.

This module owns the layout of a key set and writing it; the key files
themselves are `paramserver.plumbing.curve`'s. Under OUT (NAME: `--name`,
default server)::

    OUT/NAME.key, OUT/NAME.key_secret        the shards' pair (the secret stays on shard hosts)
    OUT/allow/ISLAND.key                     each island's public key: the shards' allow dir
    OUT/islands/ISLAND/ISLAND.key(_secret)   an island's pair, and a copy of the shards'
    OUT/islands/ISLAND/NAME.key              public key: copy this directory to its host

Nothing is overwritten: an existing server pair is kept (islands can be added
later; the shards read their allow dir when they start), and every other file
must not exist yet; all of that is checked before the first file is written.
Secret files are created with mode 0600.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from paramserver.plumbing.curve import (
    PUBLIC_SUFFIX,
    SECRET_SUFFIX,
    CurveError,
    check_key_name,
    load_keypair,
    write_keypair,
)

ALLOW_DIR = "allow"
ISLANDS_DIR = "islands"


@dataclass(frozen=True)
class KeySet:
    """Where a written key set lies."""

    server_secret: Path  # the shards' NAME.key_secret
    server_public: Path  # the shards' NAME.key
    allow_dir: Path  # the islands' public keys (curve_allow_dir)
    island_dirs: dict[str, Path]  # island -> its directory (its pair and the shards' .key)
    server_kept: bool  # the server pair existed already and was kept

    def island_secret(self, island: str) -> Path:
        """An island's NAME.key_secret."""
        return self.island_dirs[island] / f"{island}{SECRET_SUFFIX}"

    def island_server_key(self, island: str) -> Path:
        """The copy of the shards' public key in an island's directory."""
        return self.island_dirs[island] / self.server_public.name


def parse_islands(text: str) -> list[str]:
    """The island ids of `--islands a,b,c`.

    Args:
        text: comma-separated ids.

    Returns:
        The ids, in order.

    Raises:
        CurveError: an empty list or entry, a repeated id, or an id that is no file stem.
    """
    islands = [part.strip() for part in text.split(",")]
    if not any(islands) or "" in islands:
        raise CurveError(f"--islands {text!r}: give island ids separated by commas, e.g. a,b")
    for island in islands:
        check_key_name(island)
        if islands.count(island) > 1:
            raise CurveError(f"--islands {text!r}: island {island!r} is listed twice")
    return islands


def _planned(out: Path, islands: list[str], server: str) -> KeySet:
    return KeySet(
        server_secret=out / f"{server}{SECRET_SUFFIX}",
        server_public=out / f"{server}{PUBLIC_SUFFIX}",
        allow_dir=out / ALLOW_DIR,
        island_dirs={island: out / ISLANDS_DIR / island for island in islands},
        server_kept=(out / f"{server}{SECRET_SUFFIX}").exists(),
    )


def _new_files(keys: KeySet) -> list[Path]:
    """Every file the islands' part of a key set writes."""
    files = []
    for island, directory in keys.island_dirs.items():
        files += [keys.allow_dir / f"{island}{PUBLIC_SUFFIX}", keys.island_server_key(island)]
        files += [directory / f"{island}{PUBLIC_SUFFIX}", keys.island_secret(island)]
    return files


def _copy_new(source: Path, target: Path) -> None:
    """Copy a public key file to a path that must not exist yet."""
    data = source.read_bytes()
    with open(target, "xb") as fh:  # "x": never overwrite
        fh.write(data)


def write_key_set(out: str | Path, islands: list[str], server: str = "server") -> KeySet:
    """Write the shards' pair (or keep it), one pair per island and the allow dir.

    Args:
        out: the key directory (created if missing).
        islands: island ids (file stems; `parse_islands`).
        server: stem of the shards' pair.

    Returns:
        Where the files lie.

    Raises:
        CurveError: a bad name, an island named like the server pair, half a
            server pair, an unreadable kept pair, or a file that exists already
            (nothing was written then).
    """
    check_key_name(server)
    for island in islands:
        check_key_name(island)
    if server in islands:
        raise CurveError(f"island {server!r} has the server pair's name: choose another --name")
    keys = _planned(Path(out), islands, server)
    if keys.server_kept != keys.server_public.exists():
        present = keys.server_secret if keys.server_kept else keys.server_public
        raise CurveError(f"{present} exists without its pair; remove it or choose another --name")
    for path in _new_files(keys):
        if path.exists():
            raise CurveError(f"{path} exists; keys are never overwritten: remove it or use --out")
    if keys.server_kept:
        load_keypair(keys.server_secret)  # a kept pair must be usable
    else:
        write_keypair(out, server)
    keys.allow_dir.mkdir(parents=True, exist_ok=True)
    for island, directory in keys.island_dirs.items():
        public, _secret = write_keypair(directory, island)
        _copy_new(public, keys.allow_dir / public.name)
        _copy_new(keys.server_public, keys.island_server_key(island))
    return keys


def usage_lines(keys: KeySet, connect: str) -> list[str]:
    """The commands that use a key set: the shards, each island, and status.

    Args:
        keys: a written key set.
        connect: shard 0's ROUTER as the islands reach it, e.g. tcp://HOST:5555.

    Returns:
        Shell lines (paths quoted where needed), the shards' start line first.
    """
    q = shlex.quote
    lines = [
        "diloco-server start --host 0.0.0.0 "
        f"--curve-secret-key-file {q(str(keys.server_secret))} "
        f"--curve-allow-dir {q(str(keys.allow_dir))}"
    ]
    for island in keys.island_dirs:
        lines.append(
            f"diloco-worker start --island {q(island)} --connect {q(connect)} "
            f"--curve-secret-key-file {q(str(keys.island_secret(island)))} "
            f"--curve-server-key-file {q(str(keys.island_server_key(island)))}"
        )
    lines.append(
        f"diloco-server status --connect {q(connect)} "
        f"--curve-secret-key-file {q(str(keys.server_secret))} "
        f"--curve-server-key-file {q(str(keys.server_public))}"
    )
    return lines
