"""ShardConfig: the mode-dependent outer-optimizer defaults and validation messages."""

import pytest

from paramserver.server.config import (
    ASYNC_OUTER_LR,
    ASYNC_OUTER_MOMENTUM,
    SYNC_OUTER_LR,
    SYNC_OUTER_MOMENTUM,
    ConfigError,
    ShardConfig,
)


@pytest.mark.parametrize(
    ("mode", "quorum", "single"),
    [("sync", 2, False), ("quorum", 2, False), ("quorum", 1, True), ("async", 2, True)],
)
def test_single_delta_steps_take_the_async_outer_defaults(mode, quorum, single):
    cfg = ShardConfig(mode=mode, quorum=quorum)
    assert cfg.steps_on_single_deltas is single
    lr, momentum = (
        (ASYNC_OUTER_LR, ASYNC_OUTER_MOMENTUM) if single else (SYNC_OUTER_LR, SYNC_OUTER_MOMENTUM)
    )
    assert (cfg.effective_outer_lr, cfg.effective_outer_momentum) == (lr, momentum)


def test_explicit_outer_settings_win_over_the_mode_defaults():
    cfg = ShardConfig(mode="async", outer_lr=0.9, outer_momentum=0.5)
    assert (cfg.effective_outer_lr, cfg.effective_outer_momentum) == (0.9, 0.5)


def test_bad_value_names_the_field():
    with pytest.raises(ConfigError, match="quorum"):
        ShardConfig(quorum=0)
