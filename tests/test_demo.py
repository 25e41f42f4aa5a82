"""`diloco-bench demo` as a newcomer meets it: progress lines when stdout is a pipe, one line on
Ctrl-C and no daemon left running. Real demo processes with the smallest cluster it allows."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import wait_for

from bench import demo
from paramserver.plumbing import daemon

ROOT = Path(__file__).resolve().parent.parent
SMALL = ("--islands", "1", "--shards", "1", "--inner-steps", "5")


class DemoRun:
    """A demo subprocess with piped output; collects its stdout lines (its progress, with
    arrival times), its stderr lines (errors) and every daemon pid that appears in a pid
    file under its output directory."""

    def __init__(self, out: Path, duration: float) -> None:
        argv = [sys.executable, "-m", "bench.cli", "demo", "--out", str(out),
                "--duration", str(duration), *SMALL]  # fmt: skip
        self.out = out
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[tuple[float, str]] = []  # stdout
        self.errors: list[str] = []  # stderr
        self.pids: dict[str, int] = {}  # daemon data dir (relative to out) -> its pid
        self._threads = [
            threading.Thread(target=self._read_stderr, daemon=True),
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._watch_pids, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.errors.append(line.rstrip("\n"))

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def _watch_pids(self) -> None:
        while self.proc.poll() is None:
            for path in self.out.rglob(daemon.PID_FILE):
                if (pid := daemon.read_pid(path)) is not None:
                    self.pids[path.parent.relative_to(self.out).as_posix()] = pid
            time.sleep(0.1)

    def wait_line(self, predicate, timeout_s: float) -> int:
        """Index of the first stdout line matching `predicate`; fails the test if the demo
        exits first or after `timeout_s`."""

        def first() -> tuple[int] | None:
            for i, (_t, line) in enumerate(list(self.lines)):
                if predicate(line):
                    return (i,)
            assert self.proc.poll() is None, "the demo exited first"
            return None

        try:
            (index,) = wait_for(first, "a matching stdout line", timeout_s=timeout_s, poll_s=0.1)
        except AssertionError as e:
            pytest.fail(f"{e}; output so far:\n{self.text()}")
        return index

    def finish(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout=timeout_s)
        for thread in self._threads:
            thread.join(10)
        return code

    def text(self) -> str:
        return "\n".join([line for _t, line in self.lines] + ["-- stderr:", *self.errors])

    def kill_leftovers(self) -> None:
        """Teardown: never leave a daemon of this run behind, whatever the test saw."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.pids.values():
            if daemon.pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)


def is_progress(line: str) -> bool:
    return line.startswith("[") and "tokens" in line and "loss" in line


def test_a_progress_line_fits_80_columns_and_names_what_an_island_is_doing():
    statuses = {
        "island-0": {"tokens": 1_500_000, "loss": 2.41234, "eval_global": 2.5, "wall": 2.0},
        "island-1": {"tokens": 900_000, "loss": 2.455, "eval_global": 2.6, "wall": 1.0},
        "island-2": {"state": "compiling"},
    }
    line = demo.progress_line(statuses, 15.2, 150)
    assert line == "[  15s/150s] tokens 2.40M  loss 2.412 2.455 compiling  eval 2.500"
    assert len(line) <= 80


def test_the_demo_plot_ends_with_the_final_eval(tmp_path):
    from bench import plots

    rows = {"island-0": [{"wall": 100.0, "loss": 3.0}, {"wall": 110.0, "loss": 2.5,
                                                       "eval_global": 2.6}]}  # fmt: skip
    plots.write_demo_plot(rows, 2.0, tmp_path / "loss.png", final=(130.0, 2.4))
    assert (tmp_path / "loss.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_with_stdout_piped_the_demo_prints_progress_lines_while_it_trains(tmp_path):
    run = DemoRun(tmp_path / "demo", duration=11)
    try:
        assert run.finish(timeout_s=360) == 0, run.text()
    finally:
        run.kill_leftovers()
    texts = [line for _t, line in run.lines]
    progress = [i for i, line in enumerate(texts) if is_progress(line)]
    stopping = texts.index("stopping islands ...")
    assert len(progress) >= 2 and progress[-1] < stopping, run.text()
    assert all(texts[i].startswith("[") and "s/11s]" in texts[i] for i in progress), run.text()
    assert not run.errors, run.text()  # a run without errors writes nothing on stderr
    first_at, end_at = run.lines[progress[0]][0], run.lines[-1][0]
    assert end_at - first_at > 5.0  # streamed while it ran, not dumped at the end
    assert all(len(texts[i]) <= 80 for i in progress)
    page = [i for i, line in enumerate(texts) if line.startswith("cluster page: http://127.0.0.1:")]
    assert len(page) == 1 and page[0] < progress[0], run.text()  # said as the server started
    assert not [line for line in texts if line.startswith("{")]  # JSON only with --json
    assert "eval_loss_after" in json.loads((run.out / "summary.json").read_text())
    assert not [pid for pid in run.pids.values() if daemon.pid_alive(pid)]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("phase", "signum"),
    [
        ("starting islands", signal.SIGINT),
        ("training", signal.SIGINT),
        ("starting islands", signal.SIGTERM),  # `timeout`, a scheduler: the same path
    ],
    ids=["starting islands", "training", "starting islands, sigterm"],
)
def test_ctrl_c_is_one_line_and_stops_every_daemon(tmp_path, phase, signum):
    run = DemoRun(tmp_path / "demo", duration=300)
    try:
        if phase == "training":
            run.wait_line(is_progress, timeout_s=300)
        else:
            run.wait_line(lambda line: line.startswith("starting 1 islands"), timeout_s=120)
        signalled, said = len(run.lines), len(run.errors)
        run.proc.send_signal(signum)
        code = run.finish(timeout_s=300)
    finally:
        run.kill_leftovers()
    after = [line for _t, line in run.lines[signalled:] if not is_progress(line)]
    assert code != 0
    assert after == [], after
    assert run.errors[said:] == ["diloco-bench demo: interrupted; stopping the daemons it started"]
    assert "Traceback" not in run.text()
    # the shard and the island (even one interrupted while it started) ran, and were stopped
    assert {"server/shard-0", "islands/island-0"} <= set(run.pids), run.pids
    left = {name: pid for name, pid in run.pids.items() if daemon.pid_alive(pid)}
    assert not left, f"left running: {left}"
    assert not [p for p in run.out.rglob(daemon.PID_FILE) if daemon.running_pid(p)]
