"""One JAX persistent compilation cache for a test session, shared with its subprocesses.

conftest imports this first, before anything imports JAX. Many tests build the same tiny
model's train and eval steps (in-process trainers, `diloco-worker` and `diloco-bench`
subprocesses, which inherit the environment); with the cache each distinct program is
compiled once a session instead of once a trainer. A cache dir the caller set is used
as it is; the one made here is removed at the end of the session (`remove_made`).

Islands configure their own cache (`--compile-cache-dir`, default `<data_dir>/jax-cache`),
which would override this one: every island a test starts would compile its steps afresh
(~5-20 s each on 2 busy cores). So `DILOCO_WORKER_COMPILE_CACHE_DIR` (the environment layer
of `diloco-worker`'s settings, inherited by every island and DDP rank subprocess) points
them at the session cache too. A test of the default location removes it from its child's
environment (`SHARED_ENV`); an explicit flag still wins over it.
"""

from __future__ import annotations

import os
import shutil
import tempfile

MADE: str | None = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    MADE = tempfile.mkdtemp(prefix="diloco-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = MADE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
DIR = os.environ["JAX_COMPILATION_CACHE_DIR"]
SHARED_ENV = "DILOCO_WORKER_COMPILE_CACHE_DIR"
os.environ.setdefault(SHARED_ENV, DIR)


def remove_made() -> None:
    """Remove the cache dir this module made (none if the caller gave one)."""
    if MADE is not None:
        shutil.rmtree(MADE, ignore_errors=True)
