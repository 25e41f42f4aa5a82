"""The client side: what an island uses to join, push deltas and receive updates.

The public import path is this package: `from paramserver.client import Client,
ClientConfig`. Its modules: `core` (the `Client` API), `types` (config,
errors, results), `io_thread` (the one thread that owns the sockets), `join`
(the join conversation), `links`/`shared` (sockets and counters), `outbox`
(the pure ledger of unacked pushes), `ack_timer` (the adaptive re-send timeout),
`replica`/`decode` (applying published versions), `unacked` (what is handed back
on close). Nothing here imports `paramserver.server`.
"""

from paramserver.client.core import Client
from paramserver.client.types import (
    ClientConfig,
    ClientConfigError,
    ClientError,
    JoinResult,
    PushRequest,
    Update,
)

__all__ = [
    "Client",
    "ClientConfig",
    "ClientConfigError",
    "ClientError",
    "JoinResult",
    "PushRequest",
    "Update",
]
