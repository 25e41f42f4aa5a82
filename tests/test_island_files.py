"""worker.island_files: the metrics and status files of a data dir (no JAX, real files)."""

from __future__ import annotations

import json

import pytest

from worker import island_files

pytestmark = pytest.mark.timeout(30)


def test_the_files_have_their_pinned_names(tmp_path):
    assert island_files.metrics_path(str(tmp_path)) == tmp_path / "metrics.jsonl"
    assert island_files.status_path(tmp_path) == tmp_path / "status.json"


def test_rows_append_as_json_lines_and_a_torn_last_line_is_left_out(tmp_path):
    assert island_files.read_rows(tmp_path) == []
    island_files.append_row(tmp_path, {"round": 1, "loss": 2.5})
    island_files.append_row(tmp_path, {"round": 2, "loss": 2.25})
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text == '{"round": 1, "loss": 2.5}\n{"round": 2, "loss": 2.25}\n'
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"round": 3, "lo')  # a writer in the middle of its line
    assert island_files.read_rows(tmp_path) == [
        {"round": 1, "loss": 2.5},
        {"round": 2, "loss": 2.25},
    ]


def test_a_bad_line_before_the_last_is_an_error_naming_the_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"round": 1}\nnot json\n{"round": 2}\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        island_files.read_rows(tmp_path)


def test_status_is_replaced_whole_and_absent_is_none(tmp_path):
    assert island_files.read_status(tmp_path) is None
    island_files.write_status(tmp_path, {"state": "training", "round": 3})
    island_files.write_status(tmp_path, {"state": "stopped"})
    assert json.loads((tmp_path / "status.json").read_text()) == {"state": "stopped"}
    assert island_files.read_status(tmp_path) == {"state": "stopped"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]  # no temporary left
    assert island_files.metrics_path(str(tmp_path)) == tmp_path / island_files.METRICS_FILE
    assert island_files.status_path(tmp_path).name == island_files.STATUS_FILE == "status.json"
