"""Thread pools of the codec: quantize, compress and decompress in parallel.

Owns one shared pool per thread count (numpy ufuncs and python-zstandard
release the GIL, so threads run on separate cores), the rule that every
thread uses its own zstd objects and scratch buffers (sharing a ZstdCompressor
across threads crashes the process), and a fork handler: a child process
starts with no pools, since the parent's worker threads do not exist there.
"""

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from .errors import CodecError

MAX_THREADS = 64
_pools: dict = {}
_lock = threading.Lock()


def check_threads(threads, what: str = "threads") -> int:
    """Validate a thread count.

    Args:
        threads: int in [0, MAX_THREADS] (0: the calling thread only).
        what: the argument's name, for the message.

    Returns:
        threads.
    """
    if not isinstance(threads, int) or isinstance(threads, bool) or not 0 <= threads <= 64:
        raise CodecError(f"{what} must be an int in [0, {MAX_THREADS}], got {threads!r}")
    return threads


def pool(threads: int) -> ThreadPoolExecutor | None:
    """The shared pool of `threads` workers, or None for 0 or 1 thread.

    Args:
        threads: worker count.

    Returns:
        ThreadPoolExecutor or None (work runs in the calling thread).
    """
    if threads <= 1:
        return None
    with _lock:
        p = _pools.get(threads)
        if p is None:
            p = _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="codec")
        return p


def run_all(executor, fn, jobs: list) -> list:
    """fn(*job) for every job, on the pool when there is one; results in order.

    Every job has finished when this returns or raises (so no job still
    writes into buffers the caller reuses); the first failure is re-raised.

    Args:
        executor: ThreadPoolExecutor or None.
        fn: the work.
        jobs: argument tuples.

    Returns:
        list of results.
    """
    if executor is None or len(jobs) < 2:
        return [fn(*job) for job in jobs]
    futures = [executor.submit(fn, *job) for job in jobs]
    errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e
    return [f.result() for f in futures]


def _after_fork() -> None:
    global _lock
    _pools.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)
