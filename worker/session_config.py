"""A session's settings: the island options of the exchange, validated by `IslandConfig`.

`worker.join(..., **settings)` takes the island options that concern the
exchange with the daemon's names (`SESSION_SETTINGS`); `session_config`
builds an `IslandConfig` from them, so every value goes through the same
validation as `diloco-worker start --FLAG`. Options of the daemon's own model,
data and loop (model, data, lr, speed, ...) have no meaning for a user's
training loop and are refused by name.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import codec
from worker.config import IslandConfig

# Island options a Session uses (the rest of IslandConfig is the daemon's model, data, loop).
SESSION_SETTINGS = (
    "exchange",
    "codec",
    "block_size",
    "topk_density",
    "topk_bits",
    "topk_ef_decay",
    "streaming",
    "overlap_rounds",
    "skip_stale_pushes",
    "merge_rule",
    "max_unacked",
    "flush_timeout_s",
    "join_timeout_s",
    "heartbeat_interval_s",
    "curve_secret_key_file",
    "curve_server_key_file",
    "insecure",
    "compile_cache_dir",
)


def session_config(
    connect: str,
    island: str,
    inner_steps: int,
    data_dir: str | Path | None,
    settings: dict[str, Any],
) -> IslandConfig:
    """The IslandConfig of a session (validated like the daemon's flags).

    Args:
        connect: ROUTER endpoint of any shard.
        island: the island id.
        inner_steps: calls of `Session.step` per round (>= 1).
        data_dir: where metrics and the outbox go; None = nowhere.
        settings: `SESSION_SETTINGS` names -> values.

    Returns:
        The config.

    Raises:
        ValueError: an unknown name, a daemon-only option, or a bad value
            (`IslandConfigError`, naming the field).
    """
    fields = {f.name for f in dataclasses.fields(IslandConfig)}
    for name in settings:
        if name not in fields:
            raise ValueError(
                f"unknown setting {name!r}: a session takes {', '.join(SESSION_SETTINGS)}"
            )
        if name not in SESSION_SETTINGS:
            raise ValueError(
                f"setting {name!r} is the island daemon's (its own model, data or loop); "
                f"a session trains your model and takes {', '.join(SESSION_SETTINGS)}"
            )
    if isinstance(inner_steps, bool) or not isinstance(inner_steps, int) or inner_steps < 1:
        raise ValueError(f"inner_steps must be an int >= 1 (steps per round), got {inner_steps!r}")
    if not isinstance(island, str):
        raise ValueError(f"island must be a str (the island id), got {island!r}")
    return IslandConfig(
        connect=connect,
        island=island,
        inner_steps=inner_steps,
        data_dir="" if data_dir is None else str(data_dir),
        **settings,
    )


def make_codec(cfg: IslandConfig) -> codec.Codec:
    """The delta codec an island config asks for.

    Args:
        cfg: island settings (`codec`, `block_size`, `topk_density`, `topk_bits`,
            `topk_ef_decay`).

    Returns:
        A codec object with init/encode.
    """
    kwargs = {"block_size": cfg.block_size} if cfg.block_size else {}
    if cfg.codec == "int8":
        # without zstd: it saved ~7% of an int8 delta's bytes (under the 10% it would have to
        # save) and cost ~3.5x a memcpy of the parameters to undo on the shard's accept path,
        # where frames without zstd are checked by their crc32 and logged as they are
        return codec.int8(zstd_level=None, **kwargs)
    if cfg.codec == "int4":
        return codec.int4(**kwargs)
    if cfg.codec == "topk":
        chunk = {"chunk": cfg.block_size} if cfg.block_size else {}
        return codec.topk(
            density=cfg.topk_density, bits=cfg.topk_bits, ef_decay=cfg.topk_ef_decay, **chunk
        )
    return codec.raw(cfg.codec)
