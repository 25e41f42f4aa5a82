"""The default outer lr / momentum by mode, the islands' H and the islands that push; bad values."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from shard_helpers import delta_frames, push_header
from shard_sim import Island, ShardSim

from paramserver.plumbing.settings import SettingsError, load_settings
from paramserver.server.config import ShardConfig, outer_defaults, sync_outer_defaults

# the table at 2 pushing islands, written out by hand (bench.outer_sweep, 2026-12-03):
# (lr, momentum) SHORT for H <= 17, MIDDLE to 55, LONG above; sync and quorum apart
SHORT, MIDDLE, LONG = (0.7, 0.6), (0.7, 0.8), (0.7, 0.8)
QUORUM = {"SHORT": (0.7, 0.6), "MIDDLE": (1.0, 0.6), "LONG": (1.0, 0.6)}
ASYNC_K4, ASYNC_K8 = 1.4, 1.4  # async's lr from 3 pushing islands on (1.0 below)
BY_H = [(1, "SHORT"), (10, "SHORT"), (17, "SHORT"), (18, "MIDDLE"), (30, "MIDDLE"),
        (50, "MIDDLE"), (55, "MIDDLE"), (56, "LONG"), (100, "LONG"), (500, "LONG")]  # fmt: skip


@pytest.mark.parametrize(("h", "row"), BY_H)
def test_default_outer_settings_by_h(h, row):
    expected = {"SHORT": SHORT, "MIDDLE": MIDDLE, "LONG": LONG}[row]
    assert sync_outer_defaults(h) == expected
    for mode, quorum, want in (("sync", 2, expected), ("quorum", 2, QUORUM[row]),
                               ("quorum", 3, QUORUM[row])):  # fmt: skip
        cfg = ShardConfig(mode=mode, quorum=quorum, inner_steps=h)
        assert (cfg.effective_outer_lr, cfg.effective_outer_momentum) == want
        report = cfg.outer_report()
        assert report.pop("why").startswith(f"{mode}: the default of H={h} at 2 pushing")
        assert report == {"optimizer": "nesterov", "lr": want[0], "momentum": want[1],
                          "momentum_dtype": "float32",
                          "inner_steps": h, "islands": None,
                          "from_inner_steps": True}  # fmt: skip


def test_the_shard_defaults_to_the_islands_default_h():
    assert ShardConfig().inner_steps == 50  # worker.config.IslandConfig.inner_steps
    assert ShardConfig(mode="sync").effective_outer_lr == MIDDLE[0]


def test_explicit_settings_override_the_default_of_h():
    cfg = ShardConfig(mode="sync", inner_steps=10, outer_lr=0.9)
    assert (cfg.effective_outer_lr, cfg.effective_outer_momentum) == (0.9, SHORT[1])
    cfg = ShardConfig(mode="sync", inner_steps=10, outer_lr=0.9, outer_momentum=0.5)
    assert (cfg.effective_outer_lr, cfg.effective_outer_momentum) == (0.9, 0.5)
    assert not cfg.outer_from_inner_steps
    assert cfg.inner_steps_mismatch("a", 100) is None  # nothing defaulted: nothing to warn
    # async steps (one delta each) keep their own defaults, whatever H
    single = ShardConfig(mode="async", inner_steps=10)
    assert (single.effective_outer_lr, single.effective_outer_momentum) == (1.0, 0.0)
    assert single.inner_steps_mismatch("a", 100) is None


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        ({"outer_lr": "0"}, ["--outer-lr", "> 0"]),
        ({"outer_lr": "-0.5"}, ["--outer-lr", "-0.5"]),
        ({"outer_lr": "fast"}, ["--outer-lr", "'fast'"]),
        ({"outer_momentum": "1.0"}, ["--outer-momentum", "< 1"]),
        ({"inner_steps": "0"}, ["--inner-steps", "int >= 1"]),
    ],
)
def test_bad_explicit_values_are_refused(flags, needles):
    with pytest.raises(SettingsError) as err:
        load_settings(ShardConfig, flags=flags)
    message = str(err.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message


def test_bad_outer_lr_flag_exits_2_with_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "paramserver.ops.cli", "start", "--outer-lr", "-1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--outer-lr" in lines[0] and "Traceback" not in proc.stderr


def test_mismatch_names_the_island_and_the_fix():
    cfg = ShardConfig(mode="sync", inner_steps=100)
    text = cfg.inner_steps_mismatch("island-3", 10)
    assert "island-3" in text and "--inner-steps 10" in text  # 0.7/0.8 against H=10's 0.7/0.6
    assert f"{LONG[0]}/{LONG[1]}" in text and f"{SHORT[0]}/{SHORT[1]}" in text
    assert cfg.inner_steps_mismatch("island-3", 120) is None  # same defaults: no warning


@pytest.mark.timeout(60)
def test_a_live_shard_reports_its_outer_settings_and_warns_once_per_island(tmp_path, caplog):
    sim = ShardSim(tmp_path, mode="sync", inner_steps=100)
    a, b = Island("a"), Island("b")
    sim.init(a)
    assert sim.one(b.hello())["kind"] == "welcome"

    def push(island, rnd, base=0, **fields):
        header = {**push_header(sim.plan, island.name, rnd, 0, base), **fields}
        return island.request(header, delta_frames(sim.delta(island.name, rnd)))

    with caplog.at_level(logging.WARNING, logger="paramserver.server.core"):
        # pushes of 10 inner steps without the island's own H: nothing inferred
        sim.batch(sim.push(a, 1), sim.push(b, 1))
        assert not [r for r in caplog.records if "--inner-steps" in r.getMessage()]
        # islands that say they run H = 10: one warning each
        sim.batch(push(a, 2, base=1, inner_steps=10), push(b, 2, base=1, inner_steps=10))
        sim.batch(push(a, 3, base=2, inner_steps=10))
    warned = [r.getMessage() for r in caplog.records if "--inner-steps 10" in r.getMessage()]
    assert sorted(w.split()[1] for w in warned) == ["a", "b"]
    status = sim.one(a.request({"kind": "status"}))["status"]
    why = status["outer"].pop("why")
    assert why.startswith("sync: the default of H=100 at 2 pushing islands")
    assert status["outer"] == {"optimizer": "nesterov", "lr": LONG[0], "momentum": LONG[1],
                               "momentum_dtype": "float32",
                               "inner_steps": 100, "islands": 2,
                               "from_inner_steps": True}  # fmt: skip


def test_a_push_of_merged_rounds_does_not_warn_about_h():
    # the case: H = 20, pushes merged after skipped pushes carry 120/200/280 steps
    cfg = ShardConfig(mode="quorum", inner_steps=20)
    assert cfg.inner_steps_mismatch("a", None) is None  # no own H said: no warning
    assert cfg.inner_steps_mismatch("a", 20) is None
    assert "--inner-steps 10" in cfg.inner_steps_mismatch("a", 10)  # only if it says so
    assert cfg.inner_steps_mismatch("a", 120) is None  # quorum: 1.0/0.6 at 2 islands both


# ----- the outer settings by mode, H and the islands that push (issue 32) -----------------


@pytest.mark.parametrize(
    ("mode", "h", "islands", "expected"),
    [
        ("sync", 10, 2, (0.7, 0.6)),  # H <= 17: 0.7 / 0.6 at 2, 4 and 8 islands
        ("sync", 17, 8, (0.7, 0.6)),
        ("sync", 30, 8, (0.7, 0.8)),  # H 18-55: 0.7 / 0.8
        ("sync", 100, 8, (0.7, 0.8)),  # H > 55: only 2 islands measured, the one column
        ("quorum", 10, 2, (0.7, 0.6)),  # quorum: the momentum falls as the islands grow
        ("quorum", 10, 4, (1.0, 0.3)),
        ("quorum", 17, 5, (1.0, 0.3)),
        ("quorum", 10, 6, (1.4, 0.0)),
        ("quorum", 10, 8, (1.4, 0.0)),
        ("quorum", 18, 2, (1.0, 0.6)),  # quorum 1 + grace wants a larger lr at H=30
        ("quorum", 30, 3, (1.4, 0.0)),
        ("quorum", 55, 8, (1.4, 0.0)),
        ("quorum", 56, 2, (1.0, 0.6)),
        ("quorum", 100, 8, (1.0, 0.6)),  # H > 55: only 2 islands measured, the one column
        ("async", 10, 2, (1.0, 0.0)),  # async: no momentum, the lr grows with the islands
        ("async", 100, 1, (1.0, 0.0)),
        ("async", 30, 3, (ASYNC_K4, 0.0)),
        ("async", 10, 8, (ASYNC_K8, 0.0)),
    ],
)
def test_outer_defaults_are_a_function_of_mode_h_and_islands(mode, h, islands, expected):
    lr, momentum, why = outer_defaults(mode, h, islands)
    assert (lr, momentum) == expected
    assert why.startswith(f"{mode}:")


def test_a_quorum_of_one_takes_the_settings_of_its_mode_not_async():
    for quorum in (1, 2, 4):
        cfg = ShardConfig(mode="quorum", quorum=quorum, inner_steps=15)
        assert (cfg.effective_outer_lr, cfg.effective_outer_momentum) == SHORT
        assert cfg.outer_settings(8)[:2] == (1.4, 0.0)  # quorum's column, not async's row
    assert ShardConfig(mode="async", inner_steps=15).outer_settings(4)[:2] == (ASYNC_K4, 0.0)


def test_lr_and_momentum_follow_the_pushing_islands_and_given_values_win():
    cfg = ShardConfig(mode="quorum", inner_steps=10)  # starts at 0.7 / 0.6 (2 islands)
    assert cfg.outer_settings(None)[:2] == (0.7, 0.6) == cfg.outer_settings(2)[:2]
    assert cfg.outer_settings(4)[:2] == (1.0, 0.3)
    lr, momentum, why = cfg.outer_settings(8)
    assert (lr, momentum) == (1.4, 0.0)
    assert why == (
        "quorum: the default of H=10 at 8 pushing islands (row H 1-17, column 6+ islands "
        "of OUTER_DEFAULTS_TABLE; bench.outer_sweep 2026-12-04)"
    )
    # a value the user set wins at every island count; the other one still follows the table
    lr_given = ShardConfig(mode="quorum", inner_steps=10, outer_lr=0.5)
    assert [lr_given.outer_settings(k)[:2] for k in (2, 4, 8)] == [
        (0.5, 0.6),
        (0.5, 0.3),
        (0.5, 0.0),
    ]
    momentum_given = ShardConfig(mode="quorum", inner_steps=10, outer_momentum=0.9)
    assert [momentum_given.outer_settings(k)[:2] for k in (2, 4, 8)] == [
        (0.7, 0.9), (1.0, 0.9), (1.4, 0.9)
    ]  # fmt: skip
    assert momentum_given.outer_settings(8)[2].startswith("outer_momentum given; otherwise quorum:")
    both = ShardConfig(mode="quorum", inner_steps=10, outer_lr=0.3, outer_momentum=0.2)
    assert both.outer_settings(8)[:2] == (0.3, 0.2)
    assert ShardConfig(mode="sync", inner_steps=10).outer_settings(8)[:2] == (0.7, 0.6)
    _, _, why = ShardConfig(mode="sync", outer_lr=0.3).outer_settings(4)
    assert why.startswith("outer_lr given; otherwise sync:")


def _joined_state(cfg: ShardConfig, islands: int):
    """A one-fragment shard state of small_flat with `islands` islands said hello.

    Returns:
        (state, plan, island names, a delta of 0.01 everywhere).
    """
    import numpy as np
    from shard_helpers import init_payload, plan_for, small_flat

    from paramserver.server.state import ShardState

    flat = small_flat()
    plan = plan_for(flat, 1, 1)
    state = ShardState(cfg, 0)
    assert state.initialize(plan.to_wire(), init_payload(plan, flat)).status == "accepted"
    names = [f"i{k}" for k in range(islands)]
    for name in names:
        state.hello(name, 1000.0)
    return state, plan, names, np.full(plan.fragments[0].size, 0.01, np.float32)


@pytest.mark.parametrize(("islands", "lr"), [(2, 0.7), (6, 0.7)])
def test_a_sync_step_moves_by_the_lr_of_its_island_count(islands, lr):
    import numpy as np

    cfg = ShardConfig(mode="sync", inner_steps=10, fsync=False, downlink="float32", fragments=1)
    state, plan, names, d = _joined_state(cfg, islands)
    before = state.snapshot(0)[1].astype(np.float64)
    for name in names:  # the same d from each: the mean is d
        header = push_header(plan, name, 1, 0, 0, 1000, 10)
        assert state.submit_delta(header, delta_frames(d), 1000.0).status == "accepted"
    state.step(0, 1000.0)
    # first Nesterov step (momentum 0.6 at H=10): m = d, update = lr * (d + 0.6 m) = 1.6 lr d
    moved = before - state.snapshot(0)[1]
    np.testing.assert_allclose(moved, 1.6 * lr * 0.01, rtol=1e-5)
    assert state.islands_pushing == islands


@pytest.mark.parametrize(
    ("islands", "lr", "momentum"), [(2, 0.7, 0.6), (4, 1.0, 0.3), (8, 1.4, 0.0)]
)
def test_a_quorum_step_takes_the_lr_and_momentum_of_its_island_count(islands, lr, momentum):
    import numpy as np

    # float32 momentum: the expected move is computed by hand in exact arithmetic, to rtol 1e-5
    # (explicit: a bfloat16 momentum keeps 8 bits; tests/test_bf16_momentum.py checks it)
    cfg = ShardConfig(mode="quorum", quorum=islands, inner_steps=10, fsync=False,
                      downlink="float32", fragments=1, momentum_dtype="float32")  # fmt: skip
    state, plan, names, d = _joined_state(cfg, islands)
    start = state.snapshot(0)[1].astype(np.float64)
    for rnd in (1, 2):
        for name in names:  # every island pushes the same d against the latest version
            header = push_header(plan, name, rnd, 0, rnd - 1, 1000, 10)
            assert state.submit_delta(header, delta_frames(d), 1000.0).status == "accepted"
        state.step(0, 1000.0)
    # by hand: round 1 m = d, moves lr (d + beta d); round 2 m = beta d + d, moves
    # lr (d + beta (1 + beta) d); in all lr (2 + 2 beta + beta^2) d
    moved = start - state.snapshot(0)[1]
    np.testing.assert_allclose(moved, lr * (2 + 2 * momentum + momentum**2) * 0.01, rtol=1e-5)
    assert state.islands_pushing == islands
    report = cfg.outer_report(state.islands_pushing)
    assert (report["lr"], report["momentum"], report["islands"]) == (lr, momentum, islands)
