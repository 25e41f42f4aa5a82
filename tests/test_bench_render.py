"""The one report pipeline of `report` and `fidelity`: claims, tables (by hand) and the plots."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench import plots, render

pytestmark = pytest.mark.timeout(60)


def test_claim_rel_and_cells_by_hand():
    assert render.claim("c", "<= 1%", 0.5, None) == {
        "claim": "c", "target": "<= 1%", "measured": 0.5, "met": None, "note": "",
    }  # fmt: skip
    assert render.rel(2.02, 2.0) == pytest.approx(0.01)  # (2.02 - 2) / 2
    assert render.rel(None, 2.0) is None and render.rel(1.0, 0.0) is None
    assert render.num(None) == "-" and render.num(True) == "yes" and render.num(2.5) == "2.500"
    assert render.num(1234.4, "{:.0f}x") == "1234x"
    assert render.pct(0.1234) == "12.3%" and render.pct(None) == "-"
    assert render.measured_text({"a": 0.123456, "b": "x"}) == "a: 0.1235, b: x"


def test_tables_escape_cells_and_claims_say_met_missed_or_not_run():
    assert render.table(["a", "b"], [["1|2", "3"]]) == [
        "| a | b |",
        "|---|---|",
        "| 1\\|2 | 3 |",
        "",
    ]
    claims = [
        render.claim("fast", "> 2x", 3.0, True),
        render.claim("small", "< 1 MB", {"bytes": 2e6}, False, "measured at the socket"),
        render.claim("chaos", "> 90%", None, None, "not in --quick"),
    ]
    assert render.claims_table(claims)[2:5] == [
        "| fast | > 2x | 3 | yes |  |",
        "| small | < 1 MB | bytes: 2e+06 | **no** | measured at the socket |",
        "| chaos | > 90% | - | not run | not in --quick |",
    ]


def _png(path) -> bool:
    return path.read_bytes().startswith(b"\x89PNG") and path.stat().st_size > 5000


def test_the_report_plots_are_written(tmp_path):
    island = {"up_per_round": 1e4, "down_per_round": 2e4, "speed": 1.0, "steps": 20, "rounds": 2,
              "bytes_sent": 1e6, "bytes_received": 1e6}  # fmt: skip
    curve = [(0.0, 0, 5.5), (10.0, 1000, 4.0), (20.0, 2000, 3.5)]
    records = {
        "ddp": {"method": "ddp", "islands": {"a": island}, "eval_curve": curve},
        "quorum": {"method": "quorum", "islands": {"a": island}, "eval_curve": curve},
    }
    summary = {"target_loss": 3.6, "runs": {n: {"goodput": {"a": 0.9}} for n in records}}
    paths = plots.write_plots(records, summary, 50.0, tmp_path)
    assert [p.name for p in paths] == list(plots.PLOTS)
    assert all(_png(p) for p in paths)


def test_the_fidelity_and_demo_plots_are_written(tmp_path):
    entry = {
        "eval_curves": [[(0.0, 0, 5.0), (1.0, 100, 4.0)]],
        "goodput": 0.8,
        "final_eval_loss": 4.0,
    }
    entries = {
        "k1": entry,
        "kall": {**entry, "goodput": 0.6, "staleness_histogram": {"0": 3, "2": 1}},
    }
    groups = [SimpleNamespace(name="B", title="quorum", scenarios=[SimpleNamespace(name="k1"),
                                                                    SimpleNamespace(name="kall")])]  # fmt: skip
    paths = plots.write_fidelity_plots(groups, entries, tmp_path)
    assert [p.name for p in paths] == [
        "loss_vs_tokens_B.png",
        "staleness_B.png",
        "quorum_table_B.png",
    ]
    assert all(_png(p) for p in paths)
    rows = {
        "island-0": [{"wall": 100.0, "loss": 5.0}, {"wall": 110.0, "loss": 4.0, "eval_global": 4.2}]
    }
    plots.write_demo_plot(rows, 4.3, tmp_path / "demo.png")
    assert _png(tmp_path / "demo.png")
