"""An island's progress files (`worker.progress`): names, the row format, atomic status."""

from __future__ import annotations

import json

import pytest

from worker import progress

pytestmark = pytest.mark.timeout(10)


def test_the_files_have_their_pinned_names(tmp_path):
    assert progress.metrics_path(str(tmp_path)) == tmp_path / "metrics.jsonl"
    assert progress.status_path(tmp_path) == tmp_path / "status.json"


def test_rows_are_one_json_line_each_and_read_back_in_order(tmp_path):
    assert progress.read_rows(tmp_path) == []
    progress.append_row(tmp_path, {"round": 1, "loss": 5.5})
    progress.append_row(tmp_path, {"round": 2, "loss": 4.25})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"round": 1, "loss": 5.5},
        {"round": 2, "loss": 4.25},
    ]
    assert progress.read_rows(tmp_path) == [{"round": 1, "loss": 5.5}, {"round": 2, "loss": 4.25}]


def test_a_torn_last_line_is_skipped_and_the_complete_rows_kept(tmp_path):
    progress.append_row(tmp_path, {"round": 1})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"round": 2, "lo')  # a writer killed mid-line
    assert progress.read_rows(tmp_path) == [{"round": 1}]


def test_status_is_replaced_whole_and_absent_reads_none(tmp_path):
    assert progress.read_status(tmp_path) is None
    progress.write_status(tmp_path, {"state": "training", "round": 3})
    progress.write_status(tmp_path, {"state": "stopped"})
    assert progress.read_status(tmp_path) == {"state": "stopped"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]  # no tmp file left
