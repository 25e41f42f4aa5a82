"""The exchange beside training (`overlap_rounds`, `worker.push_thread`).

A round-end `step` returns while its push is still in flight; the pushed bytes
equal those of the synchronous exchange (`overlap_rounds=0`) for the same
inputs; a step past the bound waits and that wait is lost time; the session's
per-round state stays bounded over many rounds. Real shards in threads
(`conftest.Cluster`), real sockets on 127.0.0.1.
"""

from __future__ import annotations

import threading

import jax
import mlp_helpers as mlp
import numpy as np
import pytest
from client_helpers import RecordingClient
from conftest import Cluster, wait_for

import worker
from paramserver.client import ClientError
from worker import outbox
from worker.session import Session
from worker.session_config import session_config

pytestmark = pytest.mark.timeout(120)
FAST = {"heartbeat_interval_s": 0.2, "join_timeout_s": 20.0, "flush_timeout_s": 1.0}


def _run(tmp_path, exchange: str, overlap: int, rounds: int = 3, inner: int = 2):
    """Train an MLP through a sync cluster; returns (pushes relative to the first round, params)."""
    cluster = Cluster(tmp_path / f"{exchange}-{overlap}", shards=2, mode="sync")
    clients: list[RecordingClient] = []

    def factory(cfg):
        clients.append(RecordingClient(cfg))
        return clients[-1]

    try:
        settings = {"exchange": exchange, "overlap_rounds": overlap, **FAST}
        cfg = session_config(cluster.connect, "a", inner, None, settings)
        with Session(cfg, mlp.init_mlp(0), client_factory=factory) as session:
            params, opt_state = session.params, mlp.OPTIMIZER.init(session.params)
            rng = np.random.default_rng(7)
            for _ in range(rounds * inner):
                x, y = mlp.batch(rng)
                params, opt_state, _ = mlp.train_step(params, opt_state, x, y)
                params = session.step(params, tokens=mlp.BATCH)
            assert (session.pusher is not None) == (overlap > 0)
    finally:
        cluster.stop()
    first = clients[0].pushes[0].round
    pushed = [
        (p.fragment, p.round - first, p.base_version, p.tokens, p.steps, p.frames)
        for p in clients[0].pushes
    ]
    return pushed, [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(params)]


@pytest.mark.parametrize("exchange", ["device", "host"])
def test_the_background_exchange_pushes_the_synchronous_exchanges_bytes(tmp_path, exchange):
    sync_pushed, sync_params = _run(tmp_path, exchange, overlap=0)
    bg_pushed, bg_params = _run(tmp_path, exchange, overlap=1)
    assert len(bg_pushed) == len(sync_pushed) >= 3
    assert bg_pushed == sync_pushed  # fields and frames, byte for byte
    assert all(np.array_equal(a, b) for a, b in zip(bg_params, sync_params, strict=True))


def test_a_round_end_step_returns_while_its_push_is_in_flight_and_the_next_one_waits(tmp_path):
    cluster = Cluster(tmp_path, shards=1, mode="async")
    data_dir = tmp_path / "island"
    stop = threading.Event()
    session = worker.join(cluster.connect, island="a", params=mlp.init_mlp(0), inner_steps=1,
                          data_dir=data_dir, max_unacked=1, stop=stop, **FAST)  # fmt: skip
    try:
        assert len(session.sizes) >= 2
        cluster.stop()  # nothing acks: the round's second fragment waits for a slot
        p = jax.tree_util.tree_map(lambda x: x - 0.1, session.params)
        p = session.step(p, tokens=1)  # a round's end: returns with its push in flight
        assert session.stats["rounds_in_flight"] == 1
        # the thread persists the round, pushes its first fragment, waits for a slot
        wait_for(lambda: session.client.stats()["pushes"] == 1, timeout_s=30.0)
        saved = outbox.load(data_dir / outbox.OUTBOX_FILE)  # persisted before it left
        assert saved is not None and len(saved.deltas) == len(session.sizes)
        assert session.stats["rounds_in_flight"] == 1
        done = threading.Event()

        def next_round() -> None:
            session.step(jax.tree_util.tree_map(lambda x: x - 0.1, p), tokens=1)
            done.set()

        owner = threading.Thread(target=next_round)
        owner.start()
        assert not done.wait(0.5)  # past overlap_rounds (1): the step waits for the thread
        stop.set()  # ends the wait: the blocked push queues past the limit
        owner.join(30)
        assert done.is_set()
        assert session.goodput_clock.wait_s > 0  # that wait is lost time
    finally:
        session.close()
    saved = outbox.load(data_dir / outbox.OUTBOX_FILE)
    assert saved is not None and len(saved.deltas) == 2 * len(session.sizes)  # nothing lost


class RefusingClient(RecordingClient):
    """A real client whose pushes fail once `refuse` is set (as a client closed meanwhile)."""

    refuse = False

    def push_request(self, request, stop=None):
        if self.refuse:
            raise ClientError("push refused by the test")
        return super().push_request(request, stop=stop)


def test_a_failed_background_push_surfaces_on_the_next_step_and_keeps_the_delta(tmp_path):
    cluster = Cluster(tmp_path, shards=1, mode="async")
    clients: list[RefusingClient] = []

    def factory(cfg):
        clients.append(RefusingClient(cfg))
        return clients[-1]

    data_dir = tmp_path / "island"
    try:
        cfg = session_config(cluster.connect, "a", 1, data_dir, dict(FAST))
        session = Session(cfg, mlp.init_mlp(0), client_factory=factory)
        clients[0].refuse = True
        p = session.step(session.params, tokens=1)  # returns: the push fails on the thread
        with pytest.raises(worker.PushFailed) as err:
            session.wait_pushed(30.0)
        assert err.value.island == "a" and isinstance(err.value.cause, ClientError)
        with pytest.raises(worker.PushFailed):  # and on every later step: never silent
            session.step(p, tokens=1)
        session.close()
        saved = outbox.load(data_dir / outbox.OUTBOX_FILE)
        assert saved is not None and len(saved.deltas) == len(session.sizes)  # kept
        assert {(d.round, d.fragment) for d in saved.deltas} == {
            (d.round, d.fragment) for d in session.unsent
        }
    finally:
        cluster.stop()


def test_per_round_state_stays_bounded_over_many_rounds(tmp_path):
    cluster = Cluster(tmp_path, shards=2, mode="async")
    rounds = 150
    try:
        with worker.join(cluster.connect, island="a", params=mlp.init_mlp(0), inner_steps=1,
                         data_dir=tmp_path / "island", **FAST) as session:  # fmt: skip
            session.mark_start()  # compiles every push, fold and refund a round may call for
            exchange = session.exchange
            compiled = (len(exchange._pushes), len(exchange._folds), len(exchange._refunds))
            p = session.params
            for k in range(rounds):
                p = session.step(jax.tree_util.tree_map(lambda x: x - 1e-3, p), tokens=1)
                if k % 50 == 49:
                    session.wait_pushed(30.0)
            fragments = len(session.sizes)
            clock = session.goodput_clock
            # each round's records are dropped once settled: far fewer than the rounds
            assert len(clock.ledger) <= 4 * fragments * 16
            assert len(clock.step_times) <= 256
            assert len(session.pushed_at) == fragments
            assert session.outbox is not None and len(session.outbox.live) <= 2 * 16
            assert len(session.pusher._jobs) <= session.pusher.max_in_flight
            assert session.unsent == []
            assert len(session.client._core.ledger) <= 16  # max_unacked
            assert session.stats["pushes"] >= rounds * fragments
            # no round compiled a function the warm-up did not (each one stays in memory)
            assert (len(exchange._pushes), len(exchange._folds), len(exchange._refunds)) == compiled
            readout = session.client._core.readout
            assert sum(len(v) for v in readout._awaiting.values()) <= 16  # acked, merge unseen
    finally:
        cluster.stop()


class CountingClient(RecordingClient):
    """A real client that counts `stats` calls (each one takes the client's lock)."""

    stats_calls = 0

    def stats(self):
        self.stats_calls += 1
        return super().stats()


def test_a_step_that_pushes_nothing_asks_the_client_for_no_counters(tmp_path):
    # goodput: a step call's time is lost time; the quorum skip needs the client's counters
    # (shards down) only when a fragment is due, not at each of a round's other calls
    cluster = Cluster(tmp_path, shards=2, mode="quorum", quorum=1)
    clients: list[CountingClient] = []

    def factory(cfg):
        clients.append(CountingClient(cfg))
        return clients[-1]

    try:
        cfg = session_config(cluster.connect, "a", 5, None, dict(FAST))
        with Session(cfg, mlp.init_mlp(0), client_factory=factory) as session:
            assert session.mode == "quorum"
            p = session.params
            for round_ in range(3):
                before = clients[0].stats_calls
                for _ in range(4):  # the round's calls before its end: nothing due
                    p = session.step(jax.tree_util.tree_map(lambda x: x - 1e-3, p), tokens=1)
                assert clients[0].stats_calls == before, round_
                p = session.step(jax.tree_util.tree_map(lambda x: x - 1e-3, p), tokens=1)
                assert clients[0].stats_calls > before  # its end: the skip asks, the row reads
            session.wait_pushed(30.0)
            assert session.stats["pushes"] >= len(session.sizes)  # (later ones may be skipped)
    finally:
        cluster.stop()
