"""The regions comparison's arithmetic: the link scale and the claims table, with hand-computed inputs.

Each "met" flag is shown met on one input and made to fall by changing one
figure across its threshold.
"""

from __future__ import annotations

import argparse
import math

import pytest

from bench import regions, regions_claims, regions_compare


def _record(points: list[tuple[float, int, float]]) -> dict:
    return {"eval_curve": [list(p) for p in points], "duration_s": points[-1][0]}


# DDP: 1000 s to go from 3.0 to 2.0 over 4000 tokens (loss falls 0.25 per 1000 tokens, 250 s)
DDP = _record([(0.0, 0, 3.0), (500.0, 2000, 2.5), (1000.0, 4000, 2.0)])


def _diloco(seconds_per_1000_tokens: float, final_loss: float) -> dict:
    # a straight line from (0, 0, 3.0) to (4 s/1000 x 8000, 8000, 3.0 - 2 x (3.0 - final))
    end = 3.0 - 2 * (3.0 - final_loss)
    return _record(
        [
            (0.0, 0, 3.0),
            (4 * seconds_per_1000_tokens, 4000, final_loss),
            (8 * seconds_per_1000_tokens, 8000, end),
        ]
    )


def _rows(table: dict, method: str) -> tuple[dict, dict]:
    speed, loss = [r for r in table["rows"] if r["method"] == method]
    return speed, loss


@pytest.mark.timeout(10)
def test_link_scale_matches_the_formula_by_hand() -> None:
    # run: 8 B/param x 100 params / 0.5 s = 1600 B/s; big: 3 B/param (N=4 bf16 ring) x 1e6 / 2 s
    # = 1.5e6 B/s; scale = 1600 / 1.5e6
    assert regions_claims.ring_bytes_per_param(4) == pytest.approx(3.0)
    scale = regions_claims.link_scale(100, 0.5, 4, big_params=1e6, big_step_s=2.0)
    assert scale == pytest.approx(1600 / 1.5e6)
    # the ratio is then the same: big at 2000 Mbit/s, run at 2000 x scale Mbit/s
    big = regions_claims.comm_compute_ratio(3.0 * 1e6, 2000.0, 2.0)
    run = regions_claims.comm_compute_ratio(8.0 * 100, 2000.0 * scale, 0.5)
    assert big == pytest.approx(3e6 * 8 / 2e9 / 2.0)
    assert run == pytest.approx(big)


@pytest.mark.timeout(10)
def test_12b_at_2gbit_with_one_second_steps_is_a_ratio_of_144() -> None:
    # 3 B/param x 12e9 = 36 GB x 8 = 288 Gbit at 2 Gbit/s = 144 s per 1 s step
    ratio = regions_claims.comm_compute_ratio(3.0 * 12e9, 2000.0, 1.0)
    assert ratio == pytest.approx(144.0)


@pytest.mark.timeout(10)
def test_both_flags_met_and_each_falls() -> None:
    target = 2.5  # DDP reaches it at 500 s
    # 20 s per 1000 tokens: the method reaches loss 2.0 at 4000 tokens (80 s); its line passes
    # 2.5 at 2000 tokens = 40 s; speed-up 500 / 40 = 12.5 (not met); loss at 4000 = 2.0 (met)
    slow = regions_claims.claims({"ddp": DDP, "sync": _diloco(20.0, 2.0)}, target)
    speed, loss = _rows(slow, "sync")
    assert speed["measured"] == pytest.approx(12.5)
    assert not speed["met"]
    assert loss["measured"] == pytest.approx(0.0)
    assert loss["met"]
    # 5 s per 1000 tokens: 2.5 at 10 s -> 50x (met)
    fast = regions_claims.claims({"ddp": DDP, "quorum": _diloco(5.0, 2.0)}, target)
    speed, loss = _rows(fast, "quorum")
    assert speed["measured"] == pytest.approx(50.0)
    assert speed["met"] and loss["met"]
    assert fast["all_met"]
    # final loss 2.03 at DDP's 4000 tokens: 1.5% over 2.0 (falls); 2.018: 0.9% (met)
    worse = regions_claims.claims({"ddp": DDP, "quorum": _diloco(5.0, 2.03)}, target)
    _, loss = _rows(worse, "quorum")
    assert loss["measured"] == pytest.approx(0.015)
    assert not loss["met"]
    assert not worse["all_met"]
    close = regions_claims.claims({"ddp": DDP, "quorum": _diloco(5.0, 2.018)}, target)
    assert _rows(close, "quorum")[1]["met"]


@pytest.mark.timeout(10)
def test_flags_fall_without_the_figures() -> None:
    # the method never reaches the target: no speed-up
    flat = _record([(0.0, 0, 3.0), (10.0, 8000, 2.9)])
    speed, loss = _rows(regions_claims.claims({"ddp": DDP, "sync": flat}, 2.5), "sync")
    assert speed["measured"] is None and not speed["met"]
    assert speed["why"] == "sync did not reach the target"
    assert loss["measured"] == pytest.approx(2.95 / 2.0 - 1.0) and not loss["met"]  # 2.95 at 4000
    # the method stopped short of DDP's tokens: no equal-token loss
    short = _record([(0.0, 0, 3.0), (10.0, 3000, 1.0)])
    speed, loss = _rows(regions_claims.claims({"ddp": DDP, "sync": short}, 2.5), "sync")
    assert speed["met"]  # 2.5 at 1000 tokens, 10/3 s: 150x
    assert loss["measured"] is None and not loss["met"]
    # DDP never reached the target
    speed, _ = _rows(regions_claims.claims({"ddp": DDP, "sync": short}, 1.5), "sync")
    assert not speed["met"] and speed["why"] == "DDP did not reach the target"
    # no DDP run at all
    speed, loss = _rows(regions_claims.claims({"sync": short}, 2.5), "sync")
    assert not speed["met"] and not loss["met"]
    # no rows: nothing is "all met"
    assert not regions_claims.claims({"ddp": DDP}, 2.5)["all_met"]


@pytest.mark.timeout(10)
def test_target_from_ddp_and_method_summary() -> None:
    assert regions_claims.target_from_ddp(2.0) == pytest.approx(2.02)
    summary = regions_claims.method_summary(DDP, 2.25)  # crossed at 750 s, 3000 tokens
    assert summary["time_to_target_s"] == pytest.approx(750.0)
    assert summary["tokens_to_target"] == 3000
    assert summary["final_loss"] == 2.0 and summary["final_tokens"] == 4000
    assert regions_claims.method_summary({"eval_curve": []}, 2.0)["final_loss"] is None
    assert regions_claims.loss_at_tokens(DDP["eval_curve"], 4001) is None
    assert math.isclose(regions_claims.loss_at_tokens(DDP["eval_curve"], 1000), 2.75)


@pytest.mark.timeout(10)
def test_markdown_lists_each_claim_with_its_flag() -> None:
    table = regions_claims.claims({"ddp": DDP, "quorum": _diloco(20.0, 2.03)}, 2.5)
    compare = {
        "claims": table,
        "target_loss": 2.5,
        "target_rule": "stated",
        "scaling": {
            "scale_after_probe": 1e-4,
            "slowest_ddp_link_mbit": 0.2,
            "target_ratio_at_2gbit": 144.0,
        },  # fmt: skip
        "ddp_measured": {"comm_over_compute": 100.0},
    }
    text = regions_claims.render_markdown(compare)
    assert text.count("| not met |") == 2  # 12.5x < 20x, and 1.5% > 1%
    assert "| quorum | 41.24 | 2062 |" in text  # 0.5 / (0.97 / 4000) = 2062 tokens at 20 s/1000


@pytest.mark.timeout(10)
def test_the_run_plan_uses_the_documented_scale_and_methods() -> None:
    parser = argparse.ArgumentParser()
    regions.add_arguments(parser)
    full = regions.compare_plan(parser.parse_args(["--methods", "all"]))
    # (8 x 131,712 / 0.06) / (3 x 12e9 / 1) = 4.878e-4 (docs/results.md, "Regions")
    assert full["scale"] == pytest.approx(8 * 131_712 / 0.06 / (3 * 12e9))
    assert full["inputs"]["target_ratio_at_2gbit"] == pytest.approx(144.0)
    assert full["budget"].steps_per_island == 30 and full["token_factor"] == 2.0
    quick = regions.compare_plan(parser.parse_args(["--methods", "all", "--quick"]))
    assert quick["scale"] == pytest.approx(10 * full["scale"])  # a 10 s big-model step
    assert regions_compare.parse_methods("quorum,ddp") == ["ddp", "quorum"]
    assert regions_compare.parse_methods("all") == ["ddp", "sync", "quorum"]
    assert regions_compare.parse_methods("") == []
    with pytest.raises(ValueError):
        regions_compare.parse_methods("ddp,allreduce")
