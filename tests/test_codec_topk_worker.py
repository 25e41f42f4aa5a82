"""Islands select the topk codec with --codec topk, --topk-density, --topk-bits and
--topk-ef-decay."""

import inspect

import pytest

import codec
from worker import cli
from worker.config import IslandConfig, IslandConfigError
from worker.session_config import make_codec


def load(argv):
    return cli._load_config(cli._parser().parse_args(["start", *argv]))


def test_flags_select_topk():
    cfg = load(["--codec", "topk", "--topk-density", "0.05", "--topk-bits", "4"])
    c = make_codec(cfg)
    assert isinstance(c, codec.Codec) and c.scheme == "topk"
    assert (c.density, c.bits, c.block_size) == (0.05, 4, 4096)
    assert make_codec(IslandConfig(codec="topk", block_size=1024)).block_size == 1024
    assert IslandConfig().topk_density == 0.05 and IslandConfig().topk_bits == 2


def test_a_topk_island_defaults_to_the_measured_density_and_decay():
    """Islands send 5% with EF decay 0.95 (within 3% of int8 on 2 seeds, docs/results.md);
    `codec.topk`'s own defaults stay 0.02 / 1.0, so its pinned bits do not move."""
    defaults = inspect.signature(codec.topk).parameters
    assert (defaults["density"].default, defaults["ef_decay"].default) == (0.02, 1.0)
    cfg = IslandConfig()
    assert (cfg.topk_density, cfg.topk_ef_decay) == (0.05, 0.95)
    assert cfg.topk_bits == defaults["bits"].default
    c = make_codec(IslandConfig(codec="topk"))
    assert (c.density, c.ef_decay, c.bits) == (0.05, 0.95, 2)


def test_ef_decay_flag_reaches_the_codec():
    c = make_codec(load(["--codec", "topk", "--topk-ef-decay", "0.9"]))
    assert c.ef_decay == 0.9 and "ef_decay=0.9" in repr(c)


@pytest.mark.parametrize(
    "argv, text",
    [
        (["--topk-density", "0"], "topk_density=0.0: must be a finite number > 0 and <= 1"),
        (["--topk-density", "1.5"], "topk_density.*1.5"),
        (["--topk-density", "nan"], "topk_density.*nan"),
        (["--topk-bits", "3"], "topk_bits=3: must be one of 2, 4"),
        (["--topk-ef-decay", "0"], "topk_ef_decay=0.0: must be a finite number > 0 and <= 1"),
        (["--topk-ef-decay", "1.2"], "topk_ef_decay.*1.2"),
    ],
)
def test_bad_topk_flags_name_the_value(argv, text):
    with pytest.raises(ValueError, match=text) as exc:
        load(["--codec", "topk", *argv])
    assert str(exc.value).startswith(argv[0] + ":")  # the message names the flag


def test_config_validation_names_the_field():
    with pytest.raises(IslandConfigError, match="topk_bits.*8"):
        IslandConfig(codec="topk", topk_bits=8)
