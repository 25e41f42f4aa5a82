"""The default outer lr / momentum as a function of the islands' H, and refused bad values."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from shard_sim import Island, ShardSim

from paramserver.plumbing.settings import SettingsError, load_settings
from paramserver.server.config import ShardConfig, sync_outer_defaults

# the rule, written out by hand: (lr, momentum) SHORT for H <= 17, MIDDLE to 55, LONG above
SHORT, MIDDLE, LONG = (0.4, 0.8), (0.5, 0.8), (0.7, 0.8)


@pytest.mark.parametrize(
    ("h", "expected"),
    [(1, SHORT), (10, SHORT), (17, SHORT), (18, MIDDLE), (30, MIDDLE), (50, MIDDLE),
     (55, MIDDLE), (56, LONG), (100, LONG), (500, LONG)],
)  # fmt: skip
def test_default_outer_settings_by_h(h, expected):
    assert sync_outer_defaults(h) == expected
    for mode, quorum in (("sync", 2), ("quorum", 2), ("quorum", 3)):
        cfg = ShardConfig(mode=mode, quorum=quorum, inner_steps=h)
        assert (cfg.effective_outer_lr, cfg.effective_outer_momentum) == expected
        assert cfg.outer_report() == {"optimizer": "nesterov", "lr": expected[0],
                                      "momentum": expected[1], "inner_steps": h,
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
    # steps on single deltas keep their own defaults, whatever H
    single = ShardConfig(mode="async", inner_steps=10)
    assert (single.effective_outer_lr, single.effective_outer_momentum) == (0.7, 0.0)
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
    assert "island-3" in text and "--inner-steps 10" in text
    assert f"{LONG[0]}/{LONG[1]}" in text and f"{SHORT[0]}/{SHORT[1]}" in text
    assert cfg.inner_steps_mismatch("island-3", 120) is None  # same defaults: no warning


@pytest.mark.timeout(60)
def test_a_live_shard_reports_its_outer_settings_and_warns_once_per_island(tmp_path, caplog):
    sim = ShardSim(tmp_path, mode="sync", inner_steps=100)
    a, b = Island("a"), Island("b")
    sim.init(a)
    assert sim.one(b.hello())["kind"] == "welcome"
    with caplog.at_level(logging.WARNING, logger="paramserver.server.core"):
        sim.batch(sim.push(a, 1), sim.push(b, 1))  # push_header's H is 10
        sim.batch(sim.push(a, 2, base=1))
    warned = [r.getMessage() for r in caplog.records if "--inner-steps 10" in r.getMessage()]
    assert sorted(w.split()[1] for w in warned) == ["a", "b"]
    status = sim.one(a.request({"kind": "status"}))["status"]
    assert status["outer"] == {"optimizer": "nesterov", "lr": LONG[0], "momentum": LONG[1],
                               "inner_steps": 100, "from_inner_steps": True}  # fmt: skip
