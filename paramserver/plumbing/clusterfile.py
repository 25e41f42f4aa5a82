"""The cluster file of a multi-host deployment: where every shard listens and how it is reached.

This module owns reading and checking that file. Format (TOML)::

    # Settings shared by every shard (any ShardConfig field; `shards` is implied).
    [server]
    mode = "quorum"
    data_dir = "/var/lib/diloco"

    # One table per shard, in shard order (shard 0 first).
    [[shard]]
    router = "tcp://10.0.0.1:5555"       # what islands connect to (ROUTER)
    pub = "tcp://10.0.0.1:5556"          # what islands subscribe to (PUB)
    router_bind = "tcp://*:5555"         # optional; default: router
    pub_bind = "tcp://*:5556"            # optional; default: pub

    [[shard]]
    router = "tcp://10.0.0.2:5555"
    pub = "tcp://10.0.0.2:5556"

Each host runs ``diloco-server start --cluster FILE --shard I``; islands
connect to shard 0's router and learn the rest from its welcome.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paramserver.plumbing.settings import SettingsError, read_toml
from paramserver.plumbing.validate import endpoint_problem

SHARD_KEYS = ("router", "pub", "router_bind", "pub_bind")


@dataclass(frozen=True)
class ShardAddress:
    """Where one shard binds and how islands reach it."""

    router: str
    pub: str
    router_bind: str
    pub_bind: str


@dataclass(frozen=True)
class ClusterFile:
    """A parsed cluster file: the shared [server] settings and one address per shard."""

    path: Path
    server: dict[str, Any]
    shards: tuple[ShardAddress, ...]


def _endpoint(path: Path, where: str, value: object) -> str:
    problem = endpoint_problem(value, ("tcp://", "ipc://"))
    if problem is not None:
        raise SettingsError(
            f"{path}:{where}: bad value {value!r}: {problem}; "
            "expected an endpoint like tcp://10.0.0.1:5555"
        )
    return value


def load_cluster_file(path: str | Path) -> ClusterFile:
    """Read and check a cluster file.

    Args:
        path: the TOML file.

    Returns:
        The parsed file.

    Raises:
        SettingsError: missing file, bad TOML, unknown table or key, a missing
            or malformed endpoint, or no shard at all.
    """
    path = Path(path)
    data = read_toml(path)
    unknown = sorted(set(data) - {"server", "shard"})
    if unknown:
        raise SettingsError(
            f"{path}:{unknown[0]}: unknown table; a cluster file has [server] and [[shard]]"
        )
    server = data.get("server", {})
    if not isinstance(server, dict):
        raise SettingsError(f"{path}:server must be a table ([server])")
    entries = data.get("shard", [])
    if not isinstance(entries, list) or not entries:
        raise SettingsError(f"{path}: list every shard as a [[shard]] table with router and pub")
    shards = []
    for i, entry in enumerate(entries):
        where = f"shard[{i}]"
        if not isinstance(entry, dict):
            raise SettingsError(f"{path}:{where} must be a table")
        extra = sorted(set(entry) - set(SHARD_KEYS))
        if extra:
            raise SettingsError(
                f"{path}:{where}.{extra[0]}: unknown key; valid keys: {', '.join(SHARD_KEYS)}"
            )
        for key in ("router", "pub"):
            if key not in entry:
                raise SettingsError(f"{path}:{where}: missing {key} endpoint")
        router = _endpoint(path, f"{where}.router", entry["router"])
        pub = _endpoint(path, f"{where}.pub", entry["pub"])
        shards.append(
            ShardAddress(
                router,
                pub,
                _endpoint(path, f"{where}.router_bind", entry.get("router_bind", router)),
                _endpoint(path, f"{where}.pub_bind", entry.get("pub_bind", pub)),
            )
        )
    return ClusterFile(path, server, tuple(shards))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_cluster_file(server: dict[str, Any], shards: list[ShardAddress]) -> str:
    """The TOML text of a cluster file (the inverse of `load_cluster_file`).

    Args:
        server: shared ShardConfig settings for the [server] table (str, int, float, bool).
        shards: one address per shard, in shard order.

    Returns:
        TOML text.
    """
    lines = ["[server]", *(f"{key} = {_toml_value(value)}" for key, value in server.items())]
    for shard in shards:
        lines.append("[[shard]]")
        lines += [f"{key} = {_toml_value(getattr(shard, key))}" for key in SHARD_KEYS]
    return "\n".join(lines) + "\n"
