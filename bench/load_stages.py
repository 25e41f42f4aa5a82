"""Where `diloco-bench load`'s ack latency comes from, stage by stage, and its needless re-sends.

An ack's latency (push call to ack) is the sum of:

- the service time of one push when nothing else waits: the client's frames out,
  the shard's decode, log append, fsync and ack (`unloaded_ack_ms`, measured
  before the load by one island pushing one delta at a time);
- the queueing behind the other deltas in flight: with L deltas outstanding on
  average and acks coming at λ per second, each waits about L / λ (Little's law,
  `queueing_ms`), whatever queue holds them (the client process's sockets, the
  shards' inputs, their group commits);
- refusals by the shards' request limits (`shard_throttled`, `shard_dropped`,
  reported beside): a throttled push waits its `retry_after_s`.

`OutstandingSampler` samples L while the islands push; `stages` puts the
figures together with the CPU the client process and the shards used (one
process at ~1 core is bound by its own interpreter, not by the shards).
`resent_while_acked` is the re-sends the shards answered `duplicate`: their
first copy was accepted, its ack was on its way.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from bench.load_meters import milliseconds, percentile
from paramserver.client import Client

PROBE_PUSHES = 20  # deltas the unloaded probe pushes, one at a time
_SAMPLE_S = 0.05


class OutstandingSampler(threading.Thread):
    """Samples the deltas outstanding (pushed, not acked) over all clients until `stop_event`."""

    def __init__(self, clients: Sequence[Client]) -> None:
        """Args:
        clients: the islands' clients.
        """
        super().__init__(daemon=True)
        self.clients = list(clients)
        self.samples: list[int] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(_SAMPLE_S):
            self.samples.append(sum(c.stats()["pending"] for c in self.clients))


def probe_unloaded(
    client: Client, fragment: int, first_round: int, frames: list[Any]
) -> list[float]:
    """Push `PROBE_PUSHES` deltas one at a time, each after the previous one's ack.

    Args:
        client: a joined client with nothing pending.
        fragment: the fragment to push.
        first_round: the first round id (the probe uses the next `PROBE_PUSHES`).
        frames: the delta's codec frames.

    Returns:
        The ack latencies, seconds.
    """
    client.ack_latencies()  # start empty
    for i in range(PROBE_PUSHES):
        client.push(fragment, first_round + i, 0, 1000, 10, frames)
        client.wait_settled(timeout_s=30.0)
    return client.ack_latencies()


def stages(
    unloaded: list[float],
    latencies: list[float],
    outstanding: list[int],
    acked: int,
    elapsed_s: float,
    cores: dict[str, Any],
) -> dict[str, Any]:
    """The latency stages of a run (see the module docstring).

    Args:
        unloaded: the probe's ack latencies, seconds.
        latencies: the load's ack latencies, seconds.
        outstanding: samples of the deltas outstanding over all islands.
        acked: deltas acked in the run.
        elapsed_s: the run's length.
        cores: `CpuMeter.stop` (keys "load" and "shard_<i>").

    Returns:
        unloaded_ack_ms (p50), outstanding_mean, acks_per_s, queueing_ms (Little:
        outstanding / acks per second), ack_latency_mean_ms, client_process_cores
        and shard_cores (each shard's cores busy).
    """
    rate = acked / elapsed_s if elapsed_s > 0 else 0.0
    mean_outstanding = sum(outstanding) / len(outstanding) if outstanding else None
    queueing = mean_outstanding / rate if mean_outstanding is not None and rate > 0 else None
    return {
        "unloaded_ack_ms": milliseconds(percentile(unloaded, 50)),
        "outstanding_mean": None if mean_outstanding is None else round(mean_outstanding, 1),
        "acks_per_s": round(rate, 1),
        "queueing_ms": milliseconds(queueing),
        "ack_latency_mean_ms": milliseconds(sum(latencies) / len(latencies) if latencies else None),
        "client_process_cores": cores.get("load"),
        "shard_cores": [v for k, v in sorted(cores.items()) if k.startswith("shard_")],
    }
