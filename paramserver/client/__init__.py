"""The client side: what an island uses to join, push deltas and receive updates.

The public import path is this package: `from paramserver.client import Client,
ClientConfig`. Its modules: `api` (the `Client` API), `io_thread` (the one
thread that moves bytes, `IOThread`), `links` (the sockets it owns), `types`
(config, errors, results), `core` (`ClientCore`, the sans-I/O protocol state:
join, ledger, replica, acks, re-sends), `joining` (a join in progress) and
`handshake` (its states up to an initialised cluster; a shard's init in
pieces: `init_upload`), `welcome` (checks of a
shard's welcome), `shards` (the connections to the shards: their state,
links, flows and requests in flight, and the effects the core asks the I/O
loop to perform), `ledger` (the one ledger of pending deltas and its adaptive
re-send timeout), `replica` (what the island keeps of the global model:
applying published versions, the shards' update feeds, and the counters,
updates and outcomes the API reads). Nothing here imports
`paramserver.server`.
"""

from paramserver.client.api import Client
from paramserver.client.types import (
    ClientConfig,
    ClientConfigError,
    ClientError,
    JoinResult,
    JoinTimeout,
    PlanMismatch,
    PushRequest,
    Update,
)

__all__ = [
    "Client",
    "ClientConfig",
    "ClientConfigError",
    "ClientError",
    "JoinResult",
    "JoinTimeout",
    "PlanMismatch",
    "PushRequest",
    "Update",
]
