"""Flat memory for days (issue 37): an island keeps no per-round state forever.

One island (`worker.join`: the test MLP, a data dir, the push thread) runs
many one-step rounds against two real shards in threads on 127.0.0.1. After
every round each per-round structure of the island is within a bound computed
from the settings, and
the memory the island's own threads allocated from round `MEASURE_FROM` on
and still hold at the end (tracemalloc, started there; traces filtered to
those with a frame in `worker/` or `paramserver/client/`: the shards' threads
are left out; allocations made inside JAX itself, its tracing and dispatch
caches, are left out too: they are bounded LRUs that a loaded run fills to
100-300 KiB, not the island's per-round state) is under `GROWTH_BOUND`. On
failure the message names the ten largest allocation sites. (That over-counts growth: what the
island freed of its older memory is not subtracted.)

Why `GROWTH_BOUND` is 256 KiB: the rounds measured push
`(ROUNDS - MEASURE_FROM) * fragments` = 120 * 4 = 480 deltas of 4 KiB or more of
frames each (over 1.9 MB): keeping any per-delta record with its payload would pass
it many times; keeping only a small per-delta record (a dict entry, a tuple,
a float: ~200 bytes) would add ~95 KiB, so the bound also leaves room for the
bounded caches that fill up once (the ack timer's spurious-resend memory, the
allocator's free lists), but not for a record per round per fragment that
keeps a payload.
"""

from __future__ import annotations

import gc
import time
import tracemalloc

import jax
import mlp_helpers as mlp
import pytest
from conftest import Cluster

import worker
from paramserver.client.replica import _WATCHED_MERGE_ROUNDS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROUNDS = 220  # 120 rounds measured: 480 deltas (tracemalloc slows each round)
MEASURE_FROM = 100  # the first snapshot (warm: compiled, caches filled)
MAX_UNACKED = 4
MAX_PENDING_PER_ISLAND = 2  # the shards'
OVERLAP = 2
GROWTH_BOUND = 256 * 1024
SETTINGS = {
    "heartbeat_interval_s": 0.5,
    "join_timeout_s": 20.0,
    "flush_timeout_s": 2.0,
    "max_unacked": MAX_UNACKED,
    "overlap_rounds": OVERLAP,
}
ISLAND_CODE = ("*/worker/*", "*/paramserver/client/*")
# allocations made inside JAX itself (its tracing and dispatch caches, bounded LRUs that a
# long run fills once) are not the island's per-round state
LIBRARY_CACHES = ("*/jax/*", "*/jaxlib/*")


def island_bytes() -> tuple[int, str]:
    """Bytes traced (allocated since `tracemalloc.start`) still live, with island code on the stack.

    Returns:
        The bytes, and the ten largest allocation sites (for the failure message).
    """
    gc.collect()
    snap = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, pattern, all_frames=True) for pattern in ISLAND_CODE]
        + [tracemalloc.Filter(False, pattern) for pattern in LIBRARY_CACHES]
    )
    stats = snap.statistics("traceback")
    sites = "\n".join(
        f"{stat.size} B in {stat.count} blocks: "
        + " -> ".join(
            f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno}"
            for frame in list(stat.traceback)[-6:]
        )
        for stat in stats[:10]
    )
    return sum(stat.size for stat in stats), sites


def assert_bounded(session, settled: bool) -> None:
    """Every per-round structure of the island is within its bound from the settings."""
    fragments = len(session.sizes)
    # deltas not final yet: the client's unacked ones, the batches queued or framing
    # on the push thread (OVERLAP rounds of every fragment), one round being taken, and
    # the acked ones whose merge has not reached the island: at most the shards' pending
    # per island and fragment, plus one step of each fragment on its way
    unmerged = (MAX_PENDING_PER_ISLAND + 1) * fragments
    in_flight = MAX_UNACKED + (OVERLAP + 1) * fragments + unmerged
    ledger = session.ledger
    assert len(ledger) <= (fragments if settled else in_flight)
    assert len(ledger._newest) <= fragments
    assert ledger._resolved is not None and len(ledger._resolved) <= in_flight
    clock = session.goodput_clock
    assert len(clock.step_times) <= 256 and len(clock.work_at) <= fragments
    assert len(session.pushed_at) == fragments
    assert session.outbox is not None and len(session.outbox.live) <= in_flight
    pusher = session.pusher
    assert pusher is not None and len(pusher._jobs) + pusher._running <= OVERLAP
    assert len(session.unsent) <= (0 if settled else fragments)  # the job being pushed
    core = session.client._core
    assert len(core.ledger) <= MAX_UNACKED
    readout = core.readout
    assert sum(len(w) for w in readout._awaiting.values()) <= in_flight
    assert len(readout._merge_targets) <= _WATCHED_MERGE_ROUNDS  # the ledger keeps its own
    assert len(readout._ack_latencies) <= in_flight  # an island never takes them
    assert len(readout._refused) == 0 and len(readout._updates) <= fragments
    assert len(core._shards.requests) <= 2 * fragments  # hellos and snapshot pieces
    assert len(core.ledger._resent_latency) <= in_flight


def test_an_island_keeps_no_per_round_state_forever(tmp_path):
    cluster = Cluster(
        tmp_path, shards=2, mode="async", max_pending_per_island=MAX_PENDING_PER_ISLAND
    )
    try:
        with worker.join(cluster.connect, island="a", params=mlp.init_mlp(0), inner_steps=1,
                         data_dir=tmp_path / "island", **SETTINGS) as session:  # fmt: skip
            p = session.params
            for k in range(ROUNDS):
                if k == MEASURE_FROM:
                    assert session.wait_pushed(30.0)
                    assert_bounded(session, settled=False)
                    gc.collect()  # traced from here on: what is still alive at the end grew
                    tracemalloc.start(16)  # enough frames to reach the island's code
                p = session.step(jax.tree_util.tree_map(lambda x: x - 1e-3, p), tokens=1)
                assert_bounded(session, settled=False)
            assert session.wait_pushed(60.0)
            deadline = time.monotonic() + 60.0  # every delta's fate known, every merge seen
            while len(session.ledger) > len(session.sizes) or session.client.stats()["pending"]:
                assert time.monotonic() < deadline, "the island's deltas did not settle"
                session.ledger.wait(lambda: False, lambda: False, timeout_s=0.2)
            assert_bounded(session, settled=True)
            grown, sites = island_bytes()
            stats = session.stats
            assert stats["pushes"] >= ROUNDS * len(session.sizes)
        assert grown < GROWTH_BOUND, f"the island's memory grew by {grown} bytes:\n{sites}"
    finally:
        tracemalloc.stop()
        cluster.stop()
