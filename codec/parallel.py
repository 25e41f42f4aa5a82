"""The codec's thread pools: one shared pool per thread count, and a fork handler.

`run_all` spreads jobs over a `pool`'s threads and the calling thread (encode
quantizes and compresses on it, decode decompresses and dequantizes); a child
process starts without its parent's threads, so a fork drops the pools.
"""

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from .format import CodecError

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


class Pool:
    """`threads` workers: the calling thread plus threads - 1 pool threads.

    Attributes:
        executor: ThreadPoolExecutor of the helper threads.
        helpers: threads - 1.
    """

    def __init__(self, threads: int):
        self.helpers = threads - 1
        self.executor = ThreadPoolExecutor(self.helpers, thread_name_prefix="codec")


def pool(threads: int) -> Pool | None:
    """The shared pool of `threads` workers, or None for 0 or 1 thread.

    Args:
        threads: worker count, the calling thread included.

    Returns:
        Pool or None (work runs in the calling thread).
    """
    if threads <= 1:
        return None
    with _lock:
        p = _pools.get(threads)
        if p is None:
            p = _pools[threads] = Pool(threads)
        return p


def run_all(workers: Pool | None, fn, jobs: list) -> list:
    """fn(*job) for every job, spread over the pool's threads; results in order.

    The calling thread works too, and every thread takes the next job from a
    shared counter (one wake-up per helper per call, not one per job). Every
    job has run when this returns or raises, so none still writes into
    buffers the caller reuses; the failure of the first failing job (in job
    order) is re-raised.

    Args:
        workers: Pool or None.
        fn: the work.
        jobs: argument tuples.

    Returns:
        list of results.
    """
    if workers is None or len(jobs) < 2:
        return [fn(*job) for job in jobs]
    results: list = [None] * len(jobs)
    errors: list = []
    order = iter(range(len(jobs)))
    take = threading.Lock()

    def loop() -> None:
        while True:
            with take:
                i = next(order, None)
            if i is None:
                return
            try:
                results[i] = fn(*jobs[i])
            except BaseException as e:  # re-raised in the caller below
                errors.append((i, e))

    helpers = [workers.executor.submit(loop) for _ in range(min(workers.helpers, len(jobs) - 1))]
    loop()
    for h in helpers:
        h.result()
    if errors:
        raise min(errors, key=lambda pair: pair[0])[1]
    return results


def _after_fork() -> None:
    global _lock
    _pools.clear()  # the parent's helper threads do not exist in the child
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)
