"""The island side: `worker.join` turns any JAX training loop into an island (`worker.session`).

`worker.global_model` reads the cluster's global model as the user's tree
(`worker.global_read`). They load on first use, so that `import worker` (and
the daemon's control commands, which import no JAX) stay cheap.
"""

from typing import Any

__all__ = ["PushFailed", "Session", "SessionClosed", "join", "global_model"]


def __getattr__(name: str) -> Any:
    if name == "global_model":
        from worker.global_read import global_model

        return global_model
    if name in __all__:
        from worker import session

        return getattr(session, name)
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
