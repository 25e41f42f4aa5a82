"""`Session.abandon` from another thread (the watchdog's) while the owner thread steps.

Real shards in threads (`conftest.Cluster`), real sockets on 127.0.0.1. The owner
thread must end with `SessionClosed` and nothing else, and the session must be
left whole: its client closed, every unacked delta (and every delta the push
thread persisted but could not hand to the closed client) in the outbox file, one final
metrics row, the island id and the data dir free for the next session.
"""

from __future__ import annotations

import threading
import time

import jax
import mlp_helpers as mlp
import pytest
from conftest import Cluster

import worker
from paramserver.client import ClientError
from worker import island_files, outbox
from worker.session import SessionClosed

pytestmark = pytest.mark.timeout(90)
FAST = {"heartbeat_interval_s": 0.2, "join_timeout_s": 20.0, "flush_timeout_s": 5.0}


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path, shards=2, mode="async")
    yield c
    c.stop()


def step_until_closed(session, params, errors: list[BaseException], steps: list[int]) -> None:
    """The owner thread: step until the session says it is closed; record what ended it."""
    p = params
    try:
        while True:
            p = session.step(jax.tree_util.tree_map(lambda x: x - 0.01, p), tokens=1)
            steps[0] += 1
    except BaseException as exc:  # the test asserts which one
        errors.append(exc)


def wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def assert_left_whole(session, data_dir) -> set[tuple[int, int]]:
    """Closed client, unacked deltas kept, one final row; returns the kept (round, fragment)s."""
    assert session.closed
    with pytest.raises(ClientError, match="closed"):
        session.client.poll_updates()
    unacked = {(d.round, d.fragment) for d in session.client.unacked()}
    # persisted by the push thread, never handed to the closed client: kept as well
    unacked |= {(d.round, d.fragment) for d in session.unsent}
    saved = outbox.load(data_dir / outbox.OUTBOX_FILE)
    kept = {(d.round, d.fragment) for d in saved.deltas} if saved is not None else set()
    assert kept == unacked
    finals = [row for row in island_files.read_rows(data_dir) if row.get("final")]
    assert len(finals) == 1
    return kept


@pytest.mark.parametrize("after_steps", [1, 4, 9])
def test_abandon_during_steps_ends_step_with_session_closed_and_leaves_no_half_state(
    cluster, tmp_path, after_steps
):
    params = mlp.init_mlp(0)
    data_dir = tmp_path / "island"
    session = worker.join(cluster.connect, island="a", params=params, inner_steps=2,
                          data_dir=data_dir, **FAST)  # fmt: skip
    errors: list[BaseException] = []
    steps = [0]
    owner = threading.Thread(
        target=step_until_closed, args=(session, session.params, errors, steps)
    )
    owner.start()
    try:
        wait_for(lambda: steps[0] >= after_steps or errors)
        session.abandon(flush_timeout_s=2.0)  # as the watchdog's thread does
    finally:
        owner.join(30)
    assert not owner.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], SessionClosed), errors
    assert errors[0].abandoned and errors[0].island == "a"
    kept = assert_left_whole(session, data_dir)
    session.close()  # the owner's own close afterwards changes nothing
    with worker.join(cluster.connect, island="a", params=params, inner_steps=2,
                     data_dir=data_dir, **FAST) as again:  # fmt: skip
        assert again.resending == len(kept)


def test_abandon_ends_a_push_blocked_on_back_pressure(cluster, tmp_path):
    params = mlp.init_mlp(0)
    data_dir = tmp_path / "island"
    session = worker.join(cluster.connect, island="a", params=params, inner_steps=1,
                          data_dir=data_dir, max_unacked=1, **FAST)  # fmt: skip
    cluster.stop()  # nothing acks: the round's second push waits for a slot (push_timeout_s: 300 s)
    errors: list[BaseException] = []
    steps = [0]
    owner = threading.Thread(
        target=step_until_closed, args=(session, session.params, errors, steps)
    )
    owner.start()
    try:
        wait_for(lambda: session.client.stats()["pending"] >= 1 or errors)  # a fragment each
        session.abandon(flush_timeout_s=0.2)
    finally:
        owner.join(30)
    assert not owner.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], SessionClosed), errors
    kept = assert_left_whole(session, data_dir)
    assert len(kept) >= 1  # what was pushed and never acked stays in the data dir
