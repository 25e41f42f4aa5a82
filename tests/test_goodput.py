"""Goodput as Decoupled DiLoCo defines it: the share of an island's wall time spent on
inner steps whose work entered the model (staleness costs nothing, waiting does).

The pure pieces (`worker.goodput`, `worker.goodput.RoundClock`) with values
computed by hand; then islands (`worker.join`) against real shards in threads
(`conftest.Cluster`), real sockets on 127.0.0.1.
"""

from __future__ import annotations

import threading

import mlp_helpers as mlp
import numpy as np
import pytest
from conftest import Cluster

import worker
from paramserver.client.replica import Readout, ReplicaFragment
from paramserver.plumbing import probe
from worker.deltas import ACKED, MERGED, PENDING, REJECTED, DeltaLedger
from worker.goodput import RoundClock, session_goodput
from worker.session import Session
from worker.session_config import session_config

pytestmark = pytest.mark.timeout(60)
FAST = {"heartbeat_interval_s": 0.2, "join_timeout_s": 20.0, "flush_timeout_s": 5.0}


def test_ledger_settles_merged_as_useful_rejected_as_lost_and_keeps_the_rest_in_flight():
    ledger = DeltaLedger()
    ledger.taken(1, 0, 0, tokens=8, steps=2, work_s=2.0)
    ledger.taken(1, 1, 0, tokens=8, steps=2, work_s=1.0)
    ledger.taken(2, 0, 0, tokens=8, steps=2, work_s=3.0)
    ledger.taken(3, 0, 0, tokens=8, steps=2, work_s=0.5)
    for key, outcome in {(1, 0): MERGED, (1, 1): REJECTED, (2, 0): ACKED}.items():
        ledger.on_outcome(*key, outcome)  # as the client's I/O thread tells it
    assert (ledger.useful_s, ledger.lost_s) == (2.0, 1.0)
    assert ledger.in_flight_s == 3.5 and len(ledger) == 2  # (2, 0) acked, (3, 0) pending
    assert ledger.round_done(1) and not ledger.round_done(2)
    assert ledger.newest_outcomes([0, 1]) == ({0: 3, 1: 1}, {(3, 0): PENDING, (1, 1): REJECTED})
    # closed: an acked delta is its shard's to merge (useful), an unacked one is lost
    ledger.settle_final()
    assert (ledger.useful_s, ledger.lost_s, ledger.in_flight_s) == (5.0, 1.5, 0.0)


def test_session_goodput_leaves_unsettled_time_out_and_stays_in_0_1():
    # 12 s of wall time, 2 s of it in flight: 8 useful of the 10 settled
    assert session_goodput(8.0, 12.0, [1.5, 0.5]) == pytest.approx(0.8)
    assert session_goodput(0.0, 3.0, [3.0]) is None  # nothing settled yet
    assert session_goodput(5.0, 4.9, []) == 1.0  # rounding never reads above 1


def test_round_clock_splits_step_time_by_fragment_share_and_counts_waits_and_warm_up_lost():
    clock = RoundClock(0.0)  # no warm-up: the time to the first step call is lost
    clock.step_started(1.0)
    clock.step_ended(1.0)
    clock.step_started(3.0)  # 2 s of inner step
    assert clock.pushed(0, 0.25) == 0.5  # fragment 0 carries 0.5 s, fragment 1 1.5 s
    assert clock.pushed(1, 0.75) == 1.5
    clock.ledger.taken(7, 0, 0, tokens=1, steps=1, work_s=0.5)
    clock.ledger.taken(7, 1, 0, tokens=1, steps=1, work_s=1.5)
    clock.step_ended(4.0)  # 1 s inside step (a sync wait, back-pressure): lost
    clock.step_started(6.0)  # 2 s more, not pushed yet
    assert clock.ledger.in_flight_s == 2.0
    clock.ledger.on_outcome(7, 0, MERGED)
    clock.ledger.on_outcome(7, 1, REJECTED)
    row = clock.fields({}, tokens=20, steps=2, now=6.0, shares=[0.25, 0.75])
    # wall 6 s, 2 s unpushed left out: 0.5 useful of 4 settled; lost 1 + 1.5 + 1 s
    assert row["goodput"] == pytest.approx(0.5 / 4)
    assert (row["useful_s"], row["in_flight_s"], row["lost_s"]) == (0.5, 2.0, 3.5)
    clock.drop_unpushed([0.25, 0.75])  # the session closed without pushing them
    assert clock.fields({}, 20, 2, 6.0, [0.25, 0.75])["goodput"] == pytest.approx(0.5 / 6)


def test_mark_start_makes_the_first_interval_an_ordinary_step():
    warmed = RoundClock(10.0, last_end=10.0)
    warmed.step_started(12.0)
    assert warmed.work_s == 2.0 and warmed.step_times == [2.0]
    cold = RoundClock(10.0)
    cold.step_started(12.0)
    assert cold.work_s == 0.0 and cold.step_times == []


def test_the_callers_own_time_is_out_of_the_time_base_inside_a_step_and_between_steps():
    told = RoundClock(0.0, last_end=0.0)  # warmed up
    told.step_started(2.0)  # a 2 s inner step
    told.caller_time(1.5, between_steps=False)  # the row hook's evaluation, inside `step`
    told.step_ended(4.0)  # 2 s in `step`: 1.5 s the caller's, 0.5 s the exchange's
    told.caller_time(3.0, between_steps=True)  # a checkpoint from 4 s to 7 s
    told.step_started(9.0)  # a 2 s inner step (7 s to 9 s), not 5 s
    assert told.work_s == 4.0 and told.step_times == [2.0, 2.0]
    # the same times untold: the hook's time is lost, the checkpoint's is inner-step time
    untold = RoundClock(0.0, last_end=0.0)
    untold.step_started(2.0)
    untold.step_ended(4.0)
    untold.step_started(9.0)
    assert untold.work_s == 7.0
    rows = []
    for clock in (told, untold):
        clock.ledger.taken(1, 0, 0, tokens=2, steps=2, work_s=clock.pushed(0, 1.0))
        clock.ledger.on_outcome(1, 0, MERGED)
        rows.append(clock.fields({}, tokens=2, steps=2, now=9.0, shares=[1.0]))
    # told: wall 9 - 4.5 s = 4.5 s, 4 s useful, 0.5 s lost (the exchange's time in `step`)
    assert (rows[0]["caller_s"], rows[0]["useful_s"], rows[0]["lost_s"]) == (4.5, 4.0, 0.5)
    assert rows[0]["goodput"] == pytest.approx(4.0 / 4.5)
    # untold: wall 9 s, 7 s useful, 2 s lost
    assert (rows[1]["caller_s"], rows[1]["useful_s"], rows[1]["lost_s"]) == (0.0, 7.0, 2.0)
    assert rows[1]["goodput"] == pytest.approx(7.0 / 9.0)


def test_a_delta_is_merged_only_once_the_replica_holds_the_version_that_includes_it():
    progress = Readout()
    assert progress.delta_outcome(5, 0) == PENDING  # pushed, no ack yet
    ack = {"outcome": "accepted", "round": 5, "fragment": 0, "version": 3, "merged_version": 4}
    progress.record_ack(ack, latency_s=0.01)
    progress.replica[0] = ReplicaFragment(3, None)
    assert progress.delta_outcome(5, 0) == ACKED  # the shard holds it; version 4 not here yet
    progress.replica[0] = ReplicaFragment(4, None)
    assert progress.delta_outcome(5, 0) == MERGED
    bad = {"outcome": "rejected", "reason": "non_finite", "round": 5, "fragment": 1, "version": 3}
    progress.record_ack(bad, latency_s=0.01)
    assert progress.delta_outcome(5, 1) == REJECTED


def _island(connect, name, seconds_per_step, steps, inner_steps, data_dir, out, errors):
    """An island whose inner step takes `seconds_per_step` (an MLP step plus a fixed
    stand-in for the rest of the step's compute); keeps its final metrics row."""
    try:
        rng = np.random.default_rng(len(name))
        with worker.join(
            connect, island=name, params=mlp.init_mlp(0), inner_steps=inner_steps,
            data_dir=data_dir, exchange="host", **FAST,
        ) as session:  # fmt: skip
            params = session.params
            opt_state = mlp.OPTIMIZER.init(params)
            x, y = mlp.batch(rng)
            mlp.train_step(params, opt_state, x, y)  # compile before the clock starts
            session.mark_start()
            pause = threading.Event()
            for _ in range(steps):
                x, y = mlp.batch(rng)
                params, opt_state, _loss = mlp.train_step(params, opt_state, x, y)
                pause.wait(seconds_per_step)  # the step's compute (never set)
                params = session.step(params, tokens=mlp.BATCH)
            out[name] = {"mid": session.last_row}
        out[name]["final"] = session.last_row
    except BaseException as exc:  # surfaced by the test
        errors.append(exc)


def _run_islands(cluster, tmp_path, speeds, steps, inner_steps):
    # initialise the cluster and take its first outer step (the shard compiles it) first:
    # islands that join meanwhile would wait for the parameters and their first acks
    init = mlp.init_mlp(0)
    with worker.join(cluster.connect, island="init", params=init, inner_steps=1, **FAST) as s:
        s.step(s.params, tokens=1)
    probe.wait_merged(cluster.connect, timeout_s=20.0)
    out: dict = {}
    errors: list[BaseException] = []
    threads = [
        threading.Thread(
            target=_island,
            args=(cluster.connect, name, s, steps, inner_steps, tmp_path / name, out, errors),
        )
        for name, s in speeds.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert not errors, errors
    return out


@pytest.mark.slow
@pytest.mark.serial  # goodput is a ratio of measured times: a busy machine adds waits
def test_an_island_that_never_waits_has_goodput_1_even_when_its_deltas_are_stale(tmp_path):
    # Two async islands push in turn, so many deltas are a version stale, and the
    # shard damps them hard (g(1) = 0.25): the model takes smaller steps, but every
    # inner step's work entered it. Tolerance 0.1: the session's own time inside
    # `step` (encode, fold, push, the metrics row) is lost by definition; it is
    # about 1 ms a step, several with three busy threads on a loaded 2-core machine.
    cluster = Cluster(tmp_path, shards=1, mode="async", staleness_exponent=2.0)
    try:
        out = _run_islands(cluster, tmp_path, {"a": 0.03, "b": 0.03}, steps=30, inner_steps=2)
        status = probe.cluster_status(cluster.connect)
    finally:
        cluster.stop()
    stale = sum(n for s, n in status["shards"][0]["staleness_histogram"].items() if int(s) > 0)
    assert stale >= 5, status["shards"][0]["staleness_histogram"]
    for name in ("a", "b"):
        final, mid = out[name]["final"], out[name]["mid"]
        assert final["final"] and final["rejected"] == 0 and final["wait_s"] == 0
        assert final["goodput"] >= 0.9, final
        assert mid["goodput"] >= 0.9, mid  # during the run too: the last round is in flight
        assert final["useful_s"] >= 30 * 0.03  # every step's time, and no more than the wall
        assert final["useful_s"] <= final["time_s"]


@pytest.mark.slow
@pytest.mark.serial  # goodput is a ratio of measured times: a busy machine adds waits
def test_an_island_that_waits_for_a_slower_partner_in_sync_mode_reads_below_1(tmp_path):
    # Sync: the fast island (10 ms steps) waits each round for the slow one (40 ms):
    # about three quarters of its wall time is waiting, lost.
    cluster = Cluster(tmp_path, shards=1, mode="sync")
    try:
        out = _run_islands(cluster, tmp_path, {"fast": 0.01, "slow": 0.04}, steps=24, inner_steps=4)
    finally:
        cluster.stop()
    fast, slow = out["fast"]["final"], out["slow"]["final"]
    assert fast["wait_s"] > 0.3, fast
    assert fast["goodput"] < 0.6, fast
    assert fast["goodput"] < slow["goodput"], (fast, slow)
    assert fast["lost_s"] >= fast["wait_s"] * 0.9


def _evaluating_island(connect, name, how, rounds, data_dir, out, errors):
    """An async island of 20 ms steps, 2 a round, that evaluates for 0.1 s each round:
    in the metrics row's hook (`how` "hook", as the island daemon does), between `step`
    calls in `Session.caller_time` ("marked") or between them unmarked ("unmarked")."""
    pause = threading.Event()  # never set: waits stand for compute

    def evaluate(_round: int) -> dict:
        pause.wait(0.1)
        return {"eval": 1.0}

    try:
        cfg = session_config(connect, name, 2, data_dir, {"exchange": "host", **FAST})
        hook = evaluate if how == "hook" else None
        with Session(cfg, mlp.init_mlp(0), row_fields=hook) as session:
            params = session.params
            session.mark_start()
            for step in range(2 * rounds):
                pause.wait(0.02)
                params = session.step(params, tokens=mlp.BATCH)
                if step % 2 == 1 and how == "marked":
                    with session.caller_time():
                        evaluate(step)
                elif step % 2 == 1 and how == "unmarked":
                    evaluate(step)
            out[name] = session.last_row
    except BaseException as exc:  # surfaced by the test
        errors.append(exc)


@pytest.mark.slow
@pytest.mark.serial  # goodput is a ratio of measured times: a busy machine adds waits
def test_an_evaluation_the_session_is_told_of_is_neither_useful_nor_lost(tmp_path):
    # 10 rounds of 2 x 20 ms steps and a 0.1 s evaluation each: 1 s of evaluation
    # against 0.4 s of inner steps. Told of (the row hook, `caller_time`), the
    # evaluation leaves the time base; unmarked between steps, it is inner-step time.
    cluster = Cluster(tmp_path, shards=1, mode="async")
    rounds = 10
    try:
        out: dict = {}
        errors: list[BaseException] = []
        threads = [
            threading.Thread(
                target=_evaluating_island,
                args=(cluster.connect, how, how, rounds, tmp_path / how, out, errors),
            )
            for how in ("hook", "marked", "unmarked")
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(50)
    finally:
        cluster.stop()
    assert not errors, errors
    # the rows are the last round's, written inside its last `step`: the hook ran all 10
    # evaluations by then, the loops 9 (the last one follows that `step`)
    for how in ("hook", "marked"):
        row = out[how]
        assert row["caller_s"] >= (rounds - 1) * 0.1, row
        # without the rule the hook's second would be lost: goodput about 0.4 / 1.4
        assert row["goodput"] >= 0.8, row
        assert row["work_s"] < 2 * rounds * 0.02 + (rounds - 1) * 0.05, row  # no evaluation
    unmarked = out["unmarked"]
    assert unmarked["caller_s"] == 0.0
    assert unmarked["work_s"] >= (2 * rounds - 1) * 0.02 + (rounds - 1) * 0.1, unmarked
