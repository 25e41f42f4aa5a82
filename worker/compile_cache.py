"""JAX's persistent compilation cache for an island (and the DDP baseline's ranks).

An island restarted after a crash pays the JAX import and the compile of its
train and eval steps again before its first step. With the cache on, the
compiled executables are written to disk on the first start and read back on
the next, so a restart skips the XLA compile (not the import, not the tracing).

Where: ``<data_dir>/jax-cache`` by default (`--compile-cache-dir ""`), a shared
directory given by `--compile-cache-dir DIR` (islands of one machine then
compile once between them), or nowhere with `--compile-cache-dir off`. JAX
treats the cache as trusted code: never point it at a directory others can
write to.

`enable` must run before the process's first jit (the island calls it before it
builds its model). This module imports JAX only inside `enable`, so resolving
the setting stays cheap for control commands.

One cache per process: JAX's cache is process-wide, so the first `enable` of a
process sets it and every later one (islands as threads of one process, each
`worker.join` session) reuses it as it is, whatever it asks for; a different
setting asked later is logged once at DEBUG. Re-pointing the cache while other
threads compile and read it is what once showed a zstd decompression warning
(issue 34, item 7). To give threads of one process one shared directory, pass
the same `compile_cache_dir` to each (or let the first one's win).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

OFF = "off"
DEFAULT_SUBDIR = "jax-cache"


class CompileCacheError(ValueError):
    """The compilation cache directory cannot be used (the message names it and why)."""


def resolve(setting: str, data_dir: str | Path) -> Path | None:
    """The cache directory a `compile_cache_dir` setting asks for.

    Args:
        setting: "" for the data dir's default, "off" for no cache, else a directory.
        data_dir: the island's data directory.

    Returns:
        The directory, or None when the cache is off.
    """
    if setting.strip().lower() == OFF:
        return None
    return Path(setting) if setting else Path(data_dir) / DEFAULT_SUBDIR


class _ProcessCache:
    """The one setting of this process's cache: set by the first `enable`, kept after."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.set = False
        self.path: Path | None = None
        self.told: set[Path | None] = set()  # later settings already logged


_PROCESS = _ProcessCache()


def enable(setting: str, data_dir: str | Path) -> Path | None:
    """Turn JAX's persistent compilation cache on (or off) for this process, once.

    The first call of a process decides (first caller wins); later calls
    return that decision and change nothing, logging once at DEBUG a
    different setting they asked for. Every compile is cached, however small
    or fast (the tiny model's steps compile in well under JAX's default 1 s
    threshold).

    Args:
        setting: the island's `compile_cache_dir` ("" = `<data_dir>/jax-cache`, "off").
        data_dir: the island's data directory.

    Returns:
        The cache directory the process uses, or None when off.

    Raises:
        CompileCacheError: the first call's directory cannot be created.
    """
    asked = resolve(setting, data_dir)
    with _PROCESS.lock:
        if _PROCESS.set:
            used = _PROCESS.path
            wanted = asked.resolve() if asked is not None else None
            if wanted != used and wanted not in _PROCESS.told:
                _PROCESS.told.add(wanted)
                logger.debug(
                    "compilation cache: %s asked, this process keeps %s (one cache per "
                    "process: the first setting wins)",
                    wanted or "off",
                    used or "off",
                )
            return used
        _PROCESS.path = _configure(asked)
        _PROCESS.set = True
        return _PROCESS.path


def _configure(path: Path | None) -> Path | None:
    """Point JAX's process-wide cache at `path` (None: off); returns the resolved dir."""
    if path is not None:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CompileCacheError(
                f"cannot use --compile-cache-dir {path}: {exc.strerror or exc}; "
                f"give a writable directory or 'off'"
            ) from None
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()  # the next compile reads the settings below afresh
    jax.config.update("jax_enable_compilation_cache", path is not None)
    if path is None:
        return None
    path = path.resolve()
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size floor
    return path


def entries(path: str | Path) -> list[Path]:
    """The compiled executables stored in a cache directory (none if it does not exist).

    Args:
        path: the cache directory.

    Returns:
        The entry files (named ``<key>-cache`` by JAX), sorted; its access-time
        and lock side files are left out.
    """
    path = Path(path)
    if not path.is_dir():
        return []
    return sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith("-cache"))
