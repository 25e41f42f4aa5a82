"""Durability of one shard (placeholder until the write-ahead log lands): no-op log, no checkpoints."""

from __future__ import annotations

from paramserver.config import ShardConfig
from paramserver.state import Event, ShardState


class Durability:
    """Keeps nothing yet: recover() returns an empty state."""

    def __init__(self, cfg: ShardConfig, index: int) -> None:
        self.cfg = cfg
        self.index = index

    def recover(self) -> ShardState:
        return ShardState(self.cfg, self.index)

    def append(self, event: Event) -> None:
        pass

    def sync(self) -> None:
        pass

    def maybe_checkpoint(self, state: ShardState, now: float) -> None:
        pass

    def checkpoint(self, state: ShardState, now: float) -> None:
        pass

    def close(self) -> None:
        pass
