"""The island side: `worker.join` turns any JAX training loop into an island (`worker.session`).

`join` and `Session` load on first use, so that `import worker` (and the
daemon's control commands, which import no JAX) stay cheap.
"""

from typing import Any

__all__ = ["Session", "SessionClosed", "join"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from worker import session

        return getattr(session, name)
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
