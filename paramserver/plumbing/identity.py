"""Which island ids a CURVE key may act as: the allow map and the `forbidden_island` rule.

This module owns the binding of island public keys to island ids on a CURVE
shard. ZeroMQ's ZAP handler (`paramserver.plumbing.curve`) admits a connection and
labels it with a User-Id, the client's z85 public key; every message on that
connection carries it (`zmq.Frame.get("User-Id")`). A `hello`, `init`,
`push`, `heartbeat` or `bye` naming an island the key is not bound to is
refused `forbidden_island` (logged at most once a minute, counted).

The binding:

- a key file NAME.key in the allow directory may act as island NAME (its stem);
- the optional allow map (`curve_allow_map`, a TOML file) grants more ids::

      # key stem (NAME of NAME.key in curve_allow_dir) = extra island ids
      isl = ["isl-b", "isl-c"]
      ops = []

  A stem in the map without a key file in the directory is an error (a typo
  would otherwise lock an island out without a word);
- the shard's own public key is admitted too (for `diloco-server status` and
  the metrics endpoint on the server host) and acts as no island.

`may_act_as` is the rule; `IslandGuard` applies it on a shard and logs.
"""

from __future__ import annotations

import logging
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

from paramserver.wire.protocol import is_island_id

logger = logging.getLogger(__name__)

LOG_EVERY_S = 60.0  # at most one forbidden_island log line per this many seconds
ACTING_KINDS = frozenset({"hello", "init", "init_begin", "init_piece", "push", "heartbeat", "bye"})


class AllowMapError(ValueError):
    """The allow map cannot be used; the message names the file and what to change."""


def read_allow_map(path: str | Path, stems: Iterable[str]) -> dict[str, frozenset[str]]:
    """Read an allow map file: key stem -> the extra island ids that key may act as.

    Args:
        path: the TOML file (format in the module docstring).
        stems: the stems of the key files in the allow directory.

    Returns:
        {stem: frozenset of island ids}, for the stems the file lists.

    Raises:
        AllowMapError: unreadable, not TOML, a stem without a key file, or a
            value that is not a list of island ids (strings of 1-128 characters).
    """
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise AllowMapError(f"cannot read curve_allow_map {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise AllowMapError(f"curve_allow_map {path} is not valid TOML: {exc}") from None
    known = set(stems)
    extra = {}
    for stem, ids in data.items():
        if stem not in known:
            raise AllowMapError(
                f"curve_allow_map {path} names key {stem!r}, but the allow directory holds no "
                f"{stem}.key (keys there: {', '.join(sorted(known)) or 'none'})"
            )
        if not isinstance(ids, list) or not all(is_island_id(i) for i in ids):
            raise AllowMapError(
                f"curve_allow_map {path}: {stem} = {ids!r}: give a list of island ids, "
                f'e.g. {stem} = ["{stem}-b"]'
            )
        extra[stem] = frozenset(ids)
    return extra


def island_ids(
    stems_by_key: Mapping[str, Iterable[str]], extra: Mapping[str, Iterable[str]]
) -> dict[str, frozenset[str]]:
    """The allow map: User-Id (z85 public key) -> the island ids that key may act as.

    Args:
        stems_by_key: z85 public key -> the stems of its key files (usually one).
        extra: stem -> additional island ids (from `read_allow_map`).

    Returns:
        {user id: its stems and their extra ids}.
    """
    allow = {}
    for key, stems in stems_by_key.items():
        ids: set[str] = set()
        for stem in stems:
            ids.add(stem)
            ids.update(extra.get(stem, ()))
        allow[key] = frozenset(ids)
    return allow


def may_act_as(
    user_id: str | None, island: str, allow_map: Mapping[str, frozenset[str]] | None
) -> bool:
    """Whether the connection authenticated as `user_id` may act as island `island`.

    Args:
        user_id: the connection's ZAP User-Id (the client's z85 public key), or
            None when the message carried none.
        island: the island id the request names.
        allow_map: `island_ids(...)`; None when the shard runs without CURVE
            (then anyone may act as any island).

    Returns:
        True without CURVE, else only when `island` is bound to `user_id`.
    """
    if allow_map is None:
        return True
    if user_id is None:
        return False
    return island in allow_map.get(user_id, frozenset())


class IslandGuard:
    """A shard's `forbidden_island` check: the allow map, key names for logs, a rate-limited log."""

    def __init__(
        self, allow_map: Mapping[str, frozenset[str]], names: Mapping[str, str], shard: int
    ) -> None:
        """Hold the binding.

        Args:
            allow_map: user id -> island ids (`island_ids`).
            names: user id -> a readable name for log lines (the key file stem).
            shard: shard index (for log lines).
        """
        self.allow_map = dict(allow_map)
        self.names = dict(names)
        self.shard = shard
        self.refused = 0
        self._logged_at: float | None = None
        self._unlogged = 0

    def refusal(self, user_id: str | None, island: str, kind: str, now: float) -> str | None:
        """The refusal detail for a request, or None when it may act as `island`.

        Args:
            user_id: the connection's User-Id (None: none on the message).
            island: the island id the request names.
            kind: the request kind (only ACTING_KINDS are checked).
            now: current time, seconds (for the log's rate limit).

        Returns:
            None to serve the request; else a one-line detail for `forbidden_island`.
        """
        if kind not in ACTING_KINDS or may_act_as(user_id, island, self.allow_map):
            return None
        self.refused += 1
        name = self.names.get(user_id or "", "an unknown key")
        allowed = sorted(self.allow_map.get(user_id or "", ()))
        detail = (
            f"key {name} may not act as island {island!r} (it may act as "
            f"{', '.join(map(repr, allowed)) or 'no island'}): use the island id of your key "
            "file's name, or bind more ids in the shard's curve_allow_map"
        )
        if self._logged_at is None or now - self._logged_at >= LOG_EVERY_S:
            more = f" ({self._unlogged} more since the last such line)" if self._unlogged else ""
            logger.warning(
                "shard %d refused %s: %s%s",
                self.shard,
                kind,
                detail,
                more,
                extra={"shard": self.shard, "island": island, "client_key": name},
            )
            self._logged_at, self._unlogged = now, 0
        else:
            self._unlogged += 1
        return detail
