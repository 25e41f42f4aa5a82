"""The client fixture of tests against real shards (shards in threads: conftest's `cluster`).

- `clients()`: the body of a `client` fixture whose `client(connect, island,
  **overrides)` makes a Client with fast heartbeats, closed at teardown (a test
  module defines the fixture: `yield from clients()`).
- `RecordingClient`: a real Client that also keeps every push it is handed, as
  a `PushRequest` with its frames frozen to bytes (passed as an island's
  `client_factory`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from conftest import WAIT_S

from paramserver.client import Client, ClientConfig, PushRequest


def clients() -> Iterator[Callable[..., Client]]:
    """Body of a `client` fixture: yields client(connect, island, **overrides); closes them after."""
    made = []

    def make(connect: str, island: str, **overrides) -> Client:
        settings = {"heartbeat_interval_s": 0.2, "join_timeout_s": WAIT_S, **overrides}
        cfg = ClientConfig(connect=connect, island=island, **settings)
        c = Client(cfg)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close(flush_timeout_s=1.0)


class RecordingClient(Client):
    """A real client that also keeps every push: `pushes` holds a PushRequest each."""

    def __init__(self, cfg: ClientConfig) -> None:
        super().__init__(cfg)
        self.pushes: list[PushRequest] = []

    def push_request(self, request, stop=None):
        frozen = [bytes(memoryview(f)) for f in request.frames]
        r = request
        self.pushes.append(
            PushRequest(r.fragment, r.round, r.base_version, r.tokens, r.steps, frozen)
        )
        return super().push_request(request, stop=stop)
