"""The one launcher of the bench's helper processes (`bench.child`), with real subprocesses."""

from __future__ import annotations

import signal
import sys

import pytest

from bench import child

pytestmark = pytest.mark.timeout(60)

# a helper as bench/children writes one: signals through plumbing.daemon, then "ready"
HELPER = (
    "from bench.child import say_ready, stop_on_signals\n"
    "stop = stop_on_signals()\n"
    "say_ready()\n"
    "stop.wait(50)\n"
    "raise SystemExit(0 if stop.is_set() else 3)\n"
)


def test_a_helper_says_ready_and_exits_cleanly_on_sigterm_through_its_stop_event():
    helper = child.start([sys.executable, "-c", HELPER], "helper")
    assert helper.proc.poll() is None
    assert helper.stop(20.0) == 0  # the event was set: its own clean exit, not -SIGTERM
    assert helper.stop(20.0) == 0  # already gone: its exit code again


def test_running_stops_the_helper_when_the_block_ends():
    with child.running([sys.executable, "-c", HELPER], "helper") as helper:
        pid_running = helper.proc.poll() is None
    assert pid_running and helper.proc.returncode == 0


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace():
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(50)"
    helper = child.start([sys.executable, "-c", code], "stubborn")
    assert helper.stop(0.5) == -signal.SIGKILL


def test_a_helper_that_fails_before_ready_raises_with_its_last_stderr_line():
    code = "import sys; print('first', file=sys.stderr); sys.exit('bad --pair x: expected LISTEN=TARGET')"
    with pytest.raises(child.LaunchError, match=r"^meter did not start: bad --pair x: expected"):
        child.start([sys.executable, "-c", code], "meter")


def test_a_helper_that_says_something_else_or_nothing_is_refused_and_stopped():
    with pytest.raises(child.LaunchError, match=r"said 'hello'"):
        child.start([sys.executable, "-c", "print('hello', flush=True)"], "relay")
    code = "import time; time.sleep(50)"
    with pytest.raises(child.LaunchError, match=r"no line in 0.5s"):
        child.start([sys.executable, "-c", code], "silent", ready_timeout_s=0.5)


def test_without_a_handshake_the_output_goes_to_the_log(tmp_path):
    log = tmp_path / "island.log"
    code = "import sys; print('to stdout'); print('to stderr', file=sys.stderr)"
    helper = child.start([sys.executable, "-c", code], "island", ready_timeout_s=None, log=log)
    assert helper.proc.wait(20) == 0
    assert helper.error_tail() in ("to stdout", "to stderr")
    assert set(log.read_text().split("\n")) >= {"to stdout", "to stderr"}


def test_sigterm_unwinds_the_harness_with_blocks():
    code = (
        "import time\n"
        "from bench import child\n"
        "child.sigterm_unwinds()\n"
        "try:\n"
        "    child.say_ready()\n"
        "    time.sleep(50)\n"
        "finally:\n"
        "    import sys; print('unwound', file=sys.stderr, flush=True)\n"
    )
    harness = child.start([sys.executable, "-c", code], "harness")
    assert harness.stop(20.0) == 128 + signal.SIGTERM
    assert harness.error_tail() == "unwound"
