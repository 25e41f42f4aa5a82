"""`bench.outdir.claim`: a bench command deletes only what a bench run created."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import cli, outdir
from bench.outdir import MARKER, OutDirError, claim
from worker import island_files

ROOT = Path(__file__).resolve().parents[1]


def _marker(path: Path) -> dict:
    return json.loads((path / MARKER).read_text())


@pytest.mark.timeout(10)
def test_missing_dir_is_created_with_parents_and_marked(tmp_path):
    out = tmp_path / "a" / "b"
    assert claim(out, "demo") == out
    assert sorted(p.name for p in out.iterdir()) == [MARKER]
    assert _marker(out)["command"] == "demo"
    assert _marker(out)["created"]


@pytest.mark.timeout(10)
def test_empty_dir_is_marked_and_used(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    claim(out, "report")
    assert sorted(p.name for p in out.iterdir()) == [MARKER]
    assert _marker(out)["command"] == "report"


@pytest.mark.timeout(10)
def test_marked_dir_is_cleared_of_an_earlier_runs_output_and_kept(tmp_path):
    out = claim(tmp_path / "out", "demo")
    (out / "summary.json").write_text("{}")
    (out / "runs" / "quorum" / "islands").mkdir(parents=True)
    island_files.metrics_path(out / "runs" / "quorum" / "islands").write_text("x\n")
    inode = out.stat().st_ino
    assert claim(out, "chaos") == out
    assert out.stat().st_ino == inode
    assert sorted(p.name for p in out.iterdir()) == [MARKER]
    assert _marker(out)["command"] == "chaos"


@pytest.mark.timeout(10)
def test_foreign_non_empty_dir_is_refused_and_left_untouched(tmp_path):
    out = tmp_path / "checkout"
    (out / "src").mkdir(parents=True)
    (out / "foo.txt").write_text("keep me")
    (out / "src" / "main.py").write_text("print()")
    with pytest.raises(OutDirError) as err:
        claim(out, "demo")
    message = str(err.value)
    assert str(out) in message and "new or empty directory" in message
    assert "\n" not in message
    assert (out / "foo.txt").read_text() == "keep me"
    assert (out / "src" / "main.py").read_text() == "print()"
    assert not (out / MARKER).exists()


@pytest.mark.timeout(10)
def test_a_file_is_refused_and_left_untouched(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("keep me")
    with pytest.raises(OutDirError, match="not a directory"):
        claim(path, "report")
    assert path.read_text() == "keep me"


@pytest.mark.timeout(10)
def test_a_symlinked_marker_does_not_make_a_dir_ours(tmp_path):
    fake = tmp_path / "fake-marker"
    fake.write_text("{}")
    out = tmp_path / "out"
    out.mkdir()
    (out / "data.bin").write_text("keep me")
    (out / MARKER).symlink_to(fake)
    with pytest.raises(OutDirError):
        claim(out, "demo")
    assert (out / "data.bin").read_text() == "keep me"


@pytest.mark.timeout(10)
def test_symlinks_inside_a_marked_dir_are_unlinked_never_followed(tmp_path):
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "precious.txt").write_text("keep me")
    (outside / "sub" / "deep.txt").write_text("keep me too")
    out = claim(tmp_path / "out", "demo")
    (out / "link-dir").symlink_to(outside, target_is_directory=True)
    (out / "link-file").symlink_to(outside / "precious.txt")
    (out / "nested").mkdir()
    (out / "nested" / "link-dir").symlink_to(outside / "sub", target_is_directory=True)
    claim(out, "demo")
    assert sorted(p.name for p in out.iterdir()) == [MARKER]
    assert (outside / "precious.txt").read_text() == "keep me"
    assert (outside / "sub" / "deep.txt").read_text() == "keep me too"


@pytest.mark.timeout(10)
def test_cli_turns_a_refused_dir_into_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    out = tmp_path / "foreign"
    out.mkdir()
    (out / "foo.txt").write_text("keep me")

    def run(args):
        outdir.claim(Path(args.out), "fake")
        raise AssertionError("claim should have refused")

    args = argparse.Namespace(command="fake", out=str(out), _module=SimpleNamespace(run=run))
    parser = SimpleNamespace(parse_args=lambda argv: args)
    monkeypatch.setattr(cli, "build_parser", lambda argv: parser)
    assert cli.main(["fake"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("diloco-bench fake: ") and err.count("\n") == 1
    assert (out / "foo.txt").read_text() == "keep me"


@pytest.mark.timeout(90)
def test_demo_refuses_a_foreign_out_dir_fast_and_deletes_nothing(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "foo.txt").write_text("keep me")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.cli", "demo", "--out", str(out), "--no-live"],
        capture_output=True,
        text=True,
        timeout=80,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("diloco-bench demo: ") and str(out) in lines[0]
    assert "Traceback" not in proc.stderr
    assert (out / "foo.txt").read_text() == "keep me"
    assert sorted(p.name for p in out.iterdir()) == ["foo.txt"]


@pytest.mark.timeout(10)
def test_keep_resumes_our_directory_and_still_refuses_a_foreign_one(tmp_path):
    out = outdir.claim(tmp_path / "run", "fidelity")
    (out / "runs").mkdir()
    (out / "runs" / "a.json").write_text("{}")
    again = outdir.claim(out, "fidelity", keep=True)
    assert (again / "runs" / "a.json").read_text() == "{}"  # an earlier run's records kept
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x").write_text("mine")
    with pytest.raises(outdir.OutDirError):
        outdir.claim(foreign, "fidelity", keep=True)
    assert (foreign / "x").read_text() == "mine"
