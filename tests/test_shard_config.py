"""ShardConfig: the mode-dependent outer-optimizer defaults and validation messages."""

import os

import pytest

from paramserver.plumbing.settings import SettingsError, load_settings
from paramserver.server.config import ConfigError, ShardConfig


@pytest.mark.parametrize(
    ("mode", "quorum", "single"),
    [("sync", 2, False), ("quorum", 2, False), ("quorum", 1, False), ("async", 2, True)],
)
def test_async_steps_take_the_async_outer_defaults_and_any_quorum_the_sync_ones(
    mode, quorum, single
):
    cfg = ShardConfig(mode=mode, quorum=quorum)
    assert cfg.steps_on_single_deltas is single
    # the default of the islands' default H (50) at 2 islands, written out by hand from
    # config.OUTER_DEFAULTS_TABLE: async 1.0 without momentum, sync 0.7 / 0.8, quorum 1.0 / 0.6
    lr, momentum = {"sync": (0.7, 0.8), "quorum": (1.0, 0.6), "async": (1.0, 0.0)}[mode]
    assert (cfg.effective_outer_lr, cfg.effective_outer_momentum) == (lr, momentum)


def test_explicit_outer_settings_win_over_the_mode_defaults():
    cfg = ShardConfig(mode="async", outer_lr=0.9, outer_momentum=0.5)
    assert (cfg.effective_outer_lr, cfg.effective_outer_momentum) == (0.9, 0.5)


def test_bad_value_names_the_field():
    with pytest.raises(ConfigError, match="quorum"):
        ShardConfig(quorum=0)


def test_the_pending_budget_defaults_to_a_quarter_of_physical_memory(tmp_path):
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert ShardConfig().max_pending_bytes == ram // 4
    for bad in (0, -5, 1.5, "8G"):
        with pytest.raises(ConfigError, match="max_pending_bytes"):
            ShardConfig(max_pending_bytes=bad)
    toml = tmp_path / "server.toml"
    toml.write_text("max_pending_bytes = 1048576\n")
    assert load_settings(ShardConfig, file=toml).max_pending_bytes == 1 << 20
    toml.write_text("max_pending_bytes = 0\n")
    with pytest.raises(SettingsError, match=f"{toml}:max_pending_bytes.*int >= 1"):
        load_settings(ShardConfig, file=toml)


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("max_requests_per_s", -1.0),
        ("max_requests_per_s", float("nan")),
        ("request_burst", 0),
        ("request_burst", 2.5),
        ("max_refusals_per_s", -0.5),
        ("max_pending_bytes_per_island", -1),
        ("max_pending_bytes_per_island", True),
    ],
)
def test_the_request_limits_refuse_a_bad_value_naming_it(field, bad):
    with pytest.raises(ConfigError, match=field):
        ShardConfig(**{field: bad})


def test_the_request_limits_load_from_toml_and_the_environment(tmp_path, monkeypatch):
    cfg = ShardConfig()
    assert (cfg.max_requests_per_s, cfg.request_burst, cfg.max_refusals_per_s) == (20.0, 16, 20.0)
    toml = tmp_path / "server.toml"
    toml.write_text("max_requests_per_s = 0\nmax_pending_bytes_per_island = 4096\n")
    monkeypatch.setenv("DILOCO_SERVER_REQUEST_BURST", "7")
    cfg = load_settings(ShardConfig, file=toml, env_prefix="DILOCO_SERVER_")
    assert (cfg.max_requests_per_s, cfg.request_burst) == (0.0, 7)  # 0: no limit
    assert cfg.pending_bytes_per_island == 4096
