"""Drop the unreadable entries of the JAX compilation cache `./dev fast` keeps between runs.

JAX writes a cache entry in place (no temporary file and rename). A process killed while
it writes one (Ctrl-C of a run, a test's kill -9 of an island) leaves a truncated entry,
which every later run would read, warn about and compile again. Before each run `./dev
fast` calls `python tests/kept_jax_cache.py DIR`: an entry that does not decompress is
removed. Only `*-cache` files are read; nothing else in the dir is touched.
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

try:
    import zstandard
except ImportError:  # JAX compresses with zlib when zstandard is missing
    zstandard = None


def _readable(blob: bytes) -> bool:
    try:
        if zstandard is not None:
            zstandard.ZstdDecompressor().decompress(blob)
        else:
            zlib.decompress(blob)
    except Exception:  # any decoder error: the entry is unreadable
        return False
    return True


def drop_broken(cache_dir: Path) -> int:
    """Remove the entries of cache_dir that do not decompress.

    Args:
        cache_dir: a JAX persistent compilation cache dir.

    Returns:
        How many entries were removed.
    """
    dropped = 0
    for entry in cache_dir.glob("*-cache"):
        if not _readable(entry.read_bytes()):
            entry.unlink(missing_ok=True)
            dropped += 1
    return dropped


if __name__ == "__main__":
    n = drop_broken(Path(sys.argv[1]))
    if n:
        print(f"./dev: dropped {n} unreadable entries of the kept JAX cache {sys.argv[1]}")
