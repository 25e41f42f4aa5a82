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


def _run(mean: float, by_round: dict[str, list[float]]) -> dict:
    cells = {r: {"heldout_loss_per_seed": v, "heldout_loss_mean": sum(v) / len(v)}
             for r, v in by_round.items()}  # fmt: skip
    return {"heldout_loss_mean": mean, "by_round": cells}


def test_the_ratio_to_int8_falls_when_top_k_catches_up_and_rises_when_it_falls_behind():
    int8 = _run(2.0, {"10": [4.0, 2.0], "30": [2.0, 2.0]})
    behind_then_caught_up = _run(2.2, {"10": [5.0, 4.0], "30": [2.0, 2.2]})
    ahead = _run(1.8, {"10": [3.0, 2.0], "30": [1.8, 1.8]})
    runs = [int8, behind_then_caught_up, ahead]
    topk_outer.add_ratios_to_int8(runs)
    assert int8["loss_over_int8"] == 1.0
    assert behind_then_caught_up["loss_over_int8"] == pytest.approx(1.1)  # 2.2 / 2.0
    assert ahead["loss_over_int8"] == pytest.approx(0.9)  # 1.8 / 2.0
    early, late = behind_then_caught_up["by_round"]["10"], behind_then_caught_up["by_round"]["30"]
    assert early["loss_over_int8"] == pytest.approx(1.5)  # (5 + 4) / 2 over (4 + 2) / 2
    assert early["loss_over_int8_per_seed"] == pytest.approx([1.25, 2.0])  # 5 / 4, 4 / 2
    assert late["loss_over_int8"] == pytest.approx(1.05)  # 2.1 / 2.0: fell from 1.5
    assert late["loss_over_int8_per_seed"] == pytest.approx([1.0, 1.1])
    assert ahead["by_round"]["10"]["loss_over_int8"] == pytest.approx(2.5 / 3.0)
