"""The chaos relay between a real client and a live shard: injected faults fire and are survived.

The relay runs in a thread of the test (its `Relay` class, real sockets on
127.0.0.1); the shard's welcome advertises the relay's address, so every
request and reply of the island passes through it.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import RunningShard, free_port, wait_for
from shard_helpers import small_flat

import codec
from bench.children.chaos_relay import Relay
from bench.faults import Fault
from paramserver.client import Client, ClientConfig
from paramserver.client.ledger import DECODE_RETRIES
from paramserver.server.config import ShardConfig
from paramserver.server.shard import ShardServer
from worker import island_files

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def relayed(tmp_path):
    """Factory: relayed(faults) -> (shard, relay, client endpoint); all stopped at teardown."""
    made = []

    def make(faults):
        base = free_port(3)  # three distinct ports
        router, pub, front = (f"tcp://127.0.0.1:{base + i}" for i in range(3))
        cfg = ShardConfig(
            data_dir=str(tmp_path / "server"),
            fsync=False,
            mode="async",
            heartbeat_interval_s=5.0,
            liveness=20,
        )
        shard = RunningShard(ShardServer(cfg, 0, [(front, pub)], router, pub))
        t0 = tmp_path / "t0"
        t0.write_text(f"{time.time() - 1.0:.6f}")
        relay = Relay([(front, router)], faults, t0, seed=0)
        stop = threading.Event()
        thread = threading.Thread(target=relay.serve, args=(stop,), daemon=True)
        thread.start()
        made.append((shard, relay, stop, thread))
        return shard, relay, front

    yield make
    for shard, relay, stop, thread in made:
        stop.set()
        thread.join(10)
        relay.close()
        shard.stop()


def _push_one(front):
    client = Client(ClientConfig(connect=front, island="a", heartbeat_interval_s=5.0, liveness=20))
    plan = client.join(small_flat()).plan
    frames, _ = codec.int8().encode({"delta": np.full(plan.fragments[0].size, 0.1, np.float32)})
    client.push(0, 1, 0, 100, 1, frames)
    wait_for(lambda: client.stats()["pending"] == 0, "no pending push", timeout_s=30)
    return client


def test_a_push_corrupted_on_every_attempt_is_retried_then_rejected(relayed):
    shard, relay, front = relayed([Fault("corrupt", "a", 0.0, 1e9, prob=1.0)])
    client = _push_one(front)
    try:
        stats = client.stats()
        assert stats["acked"] == 0 and stats["rejected"] == {"codec_error": 1}
        assert stats["resent"] >= DECODE_RETRIES
        counters = shard.server.state.counters
        assert counters.rejected == {"codec_error": 1 + DECODE_RETRIES}  # caught by checksum
        assert counters.accepted == 0 and shard.server.state.versions() == {0: 0, 1: 0}
        assert relay.fired == {"corrupt@0.0": 1 + DECODE_RETRIES}
    finally:
        client.close(0)


def test_a_duplicated_push_is_applied_once(relayed):
    shard, relay, front = relayed([Fault("duplicate", "a", 0.0, 1e9, prob=1.0)])
    client = _push_one(front)
    try:
        wait_for(lambda: shard.server.state.counters.duplicates == 1, "a duplicate", timeout_s=30)
        counters = shard.server.state.counters
        assert counters.accepted == 1 and counters.duplicates == 1
        assert client.stats()["acked"] == 1
        assert relay.fired["duplicate@0.0"] >= 1
        acked = {tuple(a[:3]) for a in relay.acked_by_shard}
        assert acked == {("a", 0, 1)}
    finally:
        client.close(0)


def _island_goodput(front, data_dir):
    """Run a real tiny Island through the relay for 2 rounds; return its final metrics row."""
    from worker.config import IslandConfig
    from worker.island import Island

    cfg = IslandConfig(
        connect=front, island="a", data_dir=str(data_dir), model="tiny", batch_size=4,
        seq_len=32, inner_steps=4, max_rounds=2, eval_every=0, heartbeat_interval_s=1.0,
        flush_timeout_s=20.0,
    )  # fmt: skip
    # (an island beat of 1 s: the in-process shard's first step compiles next to the
    # island's own training, and a turn over the island's 5-beat window would make it
    # reconnect, then wait out this shard's 100 s liveness as island_in_use)
    island = Island(cfg)
    assert island.run(threading.Event()) == 0
    return island_files.read_rows(data_dir)[-1]


@pytest.mark.slow
@pytest.mark.parametrize("corrupted", [True, False])
def test_an_island_whose_deltas_are_all_rejected_has_goodput_zero(relayed, tmp_path, corrupted):
    # every push corrupted in transit: the shard rejects each one (codec_error), nothing
    # enters the model, so goodput is 0; the same island on a clean link has goodput > 0
    faults = [Fault("corrupt", "a", 0.0, 1e9, prob=1.0)] if corrupted else []
    shard, _relay, front = relayed(faults)
    final = _island_goodput(front, tmp_path / "island")
    assert final["final"] and final["pushes"] == 2 * 2  # 2 rounds x 2 fragments
    if corrupted:
        assert final["rejected"] == final["pushes"] and final["acked"] == 0
        assert final["credited_tokens"] == 0 and final["goodput"] == 0.0
        assert shard.server.state.versions() == {0: 0, 1: 0}
    else:
        assert final["acked"] == final["pushes"] and final["goodput"] > 0
        # an ack no longer waits for the step (it runs in the shard's step thread), so the
        # island's last row may precede the merge of its last pushes: the shard credits them
        wait_for(lambda: shard.server.state.counters.credited.get("a", 0) > 0, "the credit")


def test_a_replaced_connection_takes_what_it_queued_along(tmp_path, peer):
    # the shard is down; island "a" says hello on a connection, then reconnects (a fresh
    # DEALER, as the client does) and says hello again. Both wait in the relay's backends;
    # once the shard is up, only the new connection's hello may reach it (the old one died
    # with its TCP connection), else the shard binds "a" to a dead connection.
    base = free_port(3)
    router, pub, front = (f"tcp://127.0.0.1:{base + i}" for i in range(3))
    relay = Relay([(front, router)], [], tmp_path / "t0", seed=0)
    stop = threading.Event()
    thread = threading.Thread(target=relay.serve, args=(stop,), daemon=True)
    thread.start()
    shard = None
    try:
        old, new = peer(front, "a"), peer(front, "a")
        old.send({"kind": "hello", "island": "a"})
        wait_for(lambda: len(relay.island_of) == 1, "the old connection's hello at the relay")
        rid = new.send({"kind": "hello", "island": "a"})
        wait_for(lambda: len(relay.island_of) == 2, "the new connection's hello at the relay")
        cfg = ShardConfig(data_dir=str(tmp_path / "server"), fsync=False, heartbeat_interval_s=5.0)
        shard = RunningShard(ShardServer(cfg, 0, [(front, pub)], router, pub))
        reply, _ = new.recv()
        assert (reply["kind"], reply["id"]) == ("welcome", rid)
        assert not old.sock.poll(1000), "the replaced connection's hello reached the shard"
        assert len(relay.closed) == 1
    finally:
        stop.set()
        thread.join(10)
        relay.close()
        if shard is not None:
            shard.stop()


def test_an_islands_bulk_link_attaching_leaves_its_control_link_open(relayed):
    # The client keeps a control DEALER and a bulk DEALER per shard (ClientConfig's
    # control_link, bulk_links). A bulk link's attach is a hello of the same session: the
    # relay must not take it for a reconnect and close the control link's backend (its
    # heartbeats were then dropped, and an island with no push in flight read its shards
    # as silent, reconnected, attached and closed its new control link again).
    shard, relay, front = relayed([])
    client = _push_one(front)
    try:
        assert client.stats()["acked"] == 1
        assert relay.closed == set()
        assert len({ident for (_, ident), island in relay.island_of.items() if island == "a"}) == 2
    finally:
        client.close(0)
