"""diloco-bench topk_outer: the variants a sweep runs and the rounds it evaluates."""

from __future__ import annotations

import argparse

import pytest

from bench import topk_outer

pytestmark = pytest.mark.timeout(60)


def flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    topk_outer.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_plain_command_runs_the_variants_it_always_ran():
    names = [v.name for v in topk_outer._variants(flags("--lrs", "0.7,1.0"))]
    assert names == ["int8", "topk-mean-nesterov", "topk-sgd-0.7", "topk-sgd-1"]


def test_a_sweep_runs_every_density_and_decay_with_int8_first():
    args = flags("--densities", "0.02,0.1", "--ef-decays", "1,0.95", "--lrs", "1.0",
                 "--no-mean-nesterov")  # fmt: skip
    got = [(v.name, v.density, v.ef_decay) for v in topk_outer._variants(args)]
    assert got == [
        ("int8", None, None),
        ("topk-sgd-1-d0.02-ef1", 0.02, 1.0),
        ("topk-sgd-1-d0.02-ef0.95", 0.02, 0.95),
        ("topk-sgd-1-d0.1-ef1", 0.1, 1.0),
        ("topk-sgd-1-d0.1-ef0.95", 0.1, 0.95),
    ]


def test_a_bad_decay_fails_before_anything_runs():
    with pytest.raises(ValueError, match="ef_decay"):
        topk_outer._variants(flags("--ef-decays", "1.5"))


def test_the_last_round_is_always_evaluated_and_out_of_range_rounds_are_dropped():
    assert topk_outer._eval_rounds(flags("--rounds", "30", "--eval-rounds", "10,20,0,45")) == [
        10,
        20,
        30,
    ]
    assert topk_outer._eval_rounds(flags("--rounds", "5")) == [5]
