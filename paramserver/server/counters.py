"""What a shard counts for `status`: accepted, duplicates, rejections, drops, bytes, steps, credit.

Plain data and its arithmetic; `paramserver.server.outcomes` decides how a
refusal is counted, `paramserver.server.state` counts steps and accepts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ShardCounters:
    """What `status` reports; `accepted`, `staleness` and `steps` are rebuilt by replay."""

    accepted: int = 0
    duplicates: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    bytes_in: int = 0
    bytes_out: int = 0
    staleness: dict[int, int] = field(default_factory=dict)
    steps: int = 0
    clipped: int = 0  # deltas scaled down by robust aggregation (clip_norm_multiple)
    # requests from islands the shard does not know (answered unknown_island: "say
    # hello"); expected after a restart or before an island's first hello here, so
    # they are not rejections
    hello_requests: int = 0
    # requests dropped unanswered, by reason (throttled, or a header that did not decode:
    # malformed, bad_version, unknown_kind): over max_refusals_per_s (paramserver.server.throttle)
    dropped: dict[str, int] = field(default_factory=dict)
    # island -> tokens that entered the model: merged tokens * fragment share (no g(s))
    credited: dict[str, float] = field(default_factory=dict)

    def add_step(self, staleness: list[int], credits: dict[str, float]) -> None:
        """Count one outer step.

        Args:
            staleness: the staleness of each delta it merged.
            credits: island -> tokens that entered the model in this step.
        """
        self.steps += 1
        for s in staleness:
            self.staleness[s] = self.staleness.get(s, 0) + 1
        for island, credit in credits.items():
            self.credited[island] = self.credited.get(island, 0.0) + credit

    def report(self) -> dict[str, Any]:
        """The counters as status fields (JSON-ready, str keys).

        Returns:
            accepted, duplicates, rejected (reason -> count), hello_requests,
            dropped (reason -> requests left unanswered), bytes_in, bytes_out, staleness_histogram, steps, clipped and credited_tokens (island ->
            merged tokens * fragment share, staleness not counted, rounded to 3 decimals).
        """
        return {
            "accepted": self.accepted,
            "duplicates": self.duplicates,
            "rejected": dict(sorted(self.rejected.items())),
            "hello_requests": self.hello_requests,
            "dropped": dict(sorted(self.dropped.items())),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "staleness_histogram": {str(k): v for k, v in sorted(self.staleness.items())},
            "steps": self.steps,
            "clipped": self.clipped,
            "credited_tokens": {k: round(v, 3) for k, v in sorted(self.credited.items())},
        }

    def drop(self, reason: str) -> None:
        """Count a request dropped unanswered.

        Args:
            reason: why it was refused (throttled, malformed, bad_version, unknown_kind).
        """
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
