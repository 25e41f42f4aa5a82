"""Daemon plumbing with real subprocesses: pid files, detach + ready, SIGTERM drain, stop."""

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest

from paramserver.plumbing import daemon
from paramserver.plumbing.daemon import DaemonError

# A minimal daemon built from the library: claims the pid file, reports ready,
# waits for a signal, drains, releases the pid file and exits 0.
TOY = textwrap.dedent(
    """
    import logging, sys, threading
    from paramserver.plumbing import daemon
    data_dir = sys.argv[1]
    mode = sys.argv[2] if len(sys.argv) > 2 else "ok"
    daemon.setup_logging("INFO")
    log = logging.getLogger("toy")
    if mode == "fail":
        log.error("cannot bind port 1234: address in use")
        sys.exit(3)
    stop = threading.Event()
    daemon.install_signal_handlers(stop)
    path = daemon.pid_path(data_dir)
    daemon.acquire_pid_file(path)
    log.info("serving")
    if mode != "never-ready":
        daemon.notify_ready({"port": 1234})
    stop.wait()
    log.info("drained, exiting")
    daemon.release_pid_file(path)
    """
)
# claims a pid file, says so, and holds it until killed
HOLD = textwrap.dedent(
    """
    import sys, time
    from paramserver.plumbing import daemon
    daemon.acquire_pid_file(sys.argv[1])
    print("held", flush=True)
    time.sleep(600)
    """
)


def toy_argv(data_dir, mode="ok"):
    return [sys.executable, "-c", TOY, str(data_dir), mode]


def test_pid_file_claim_release_and_stale(tmp_path):
    path = tmp_path / "d" / "daemon.pid"
    daemon.acquire_pid_file(path)
    assert daemon.read_pid(path) == os.getpid()
    assert daemon.running_pid(path) == os.getpid()
    daemon.release_pid_file(path)
    assert not path.exists()

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path.write_text(f"{dead.pid} 0.0\n")
    assert daemon.running_pid(path) is None
    daemon.acquire_pid_file(path)  # stale: replaced
    assert daemon.read_pid(path) == os.getpid()


def test_a_file_system_without_locks_still_gets_a_pid_file_and_a_held_lock_is_refused(
    tmp_path, monkeypatch
):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "no locks here")  # what NFS without lockd answers

    path = tmp_path / "nolocks" / "daemon.pid"
    monkeypatch.setattr(daemon.fcntl, "flock", no_locks)
    daemon.acquire_pid_file(path)  # claimed: liveness falls back to the file's age
    assert daemon.read_pid(path) == os.getpid()
    daemon.release_pid_file(path)
    assert not path.exists()

    def held(fd, op):
        raise BlockingIOError(errno.EWOULDBLOCK, "held")

    monkeypatch.setattr(daemon.fcntl, "flock", held)
    with pytest.raises(BlockingIOError):  # not taken for a file system without locks
        daemon.acquire_pid_file(path)
    assert not path.exists()  # the failed claim leaves no file naming this process


def test_pid_reuse_counts_as_stale(tmp_path):
    path = tmp_path / "daemon.pid"
    path.write_text(f"{os.getpid()} 12345.0\n")  # an older version's file: our pid, another start
    assert daemon.running_pid(path) is None
    created = psutil.Process().create_time()
    path.write_text(f"{os.getpid()} {created:.3f}\n")  # an older version's file, ours
    assert daemon.running_pid(path) == os.getpid()


def test_the_pid_file_holds_the_pid_alone_and_its_age_tells_a_reused_pid(tmp_path):
    path = tmp_path / "daemon.pid"
    daemon.acquire_pid_file(path)
    assert path.read_text() == f"{os.getpid()}\n"  # `kill $(cat daemon.pid)` works
    assert daemon.running_pid(path) == os.getpid()
    daemon.release_pid_file(path)
    # nobody locks it and it was written an hour before this process started: another
    # process of the same pid wrote it (a reused pid)
    path.write_text(f"{os.getpid()}\n")
    before = psutil.Process().create_time() - 3600
    os.utime(path, (before, before))
    assert daemon.running_pid(path) is None
    daemon.acquire_pid_file(path)  # stale: replaced
    assert daemon.running_pid(path) == os.getpid()
    daemon.release_pid_file(path)


def test_a_wall_clock_step_after_the_start_leaves_a_live_daemon_running(tmp_path):
    """psutil's start times move with the wall clock (boot time + ticks): after a step
    forward the daemon seems to have started after its pid file was written. Its lock
    says it lives; on the mtime check alone, `stop` took it for stale, removed its pid
    file and left it running (a bench's server outlived the bench that way in CI)."""
    path = tmp_path / "d" / "daemon.pid"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert daemon.running_pid(path) == holder.pid
        # the clock stepped an hour forward since the file was written: the same as
        # the file having been written an hour before the holder started
        before = psutil.Process(holder.pid).create_time() - 3600
        os.utime(path, (before, before))
        assert daemon.running_pid(path) == holder.pid
        with pytest.raises(DaemonError, match="in use by a running daemon"):
            daemon.acquire_pid_file(path)
        holder.kill()  # -9: the kernel drops the lock, the file stays
        holder.wait(30)
        assert path.exists() and daemon.running_pid(path) is None
        daemon.acquire_pid_file(path)  # stale: replaced
        assert daemon.running_pid(path) == os.getpid()
        daemon.release_pid_file(path)
        assert not path.exists()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(30)


def test_kill_of_the_pid_file_stops_a_detached_daemon(tmp_path):
    pid, _ = daemon.detach(
        toy_argv(tmp_path), daemon.log_path(tmp_path), tmp_path / "ready", timeout_s=30
    )
    try:
        proc = subprocess.run(
            ["sh", "-c", f"kill $(cat {daemon.pid_path(tmp_path)})"],
            capture_output=True,
            timeout=30,
        )
        assert proc.returncode == 0, proc.stderr
        assert daemon.wait_exit(pid, 30)
    finally:
        if daemon.pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_garbage_pid_file(tmp_path):
    path = tmp_path / "daemon.pid"
    path.write_text("not a pid")
    assert daemon.read_pid(path) is None
    with pytest.raises(DaemonError, match="no pid file"):
        daemon.stop(tmp_path, timeout_s=1)


def test_detach_ready_stop_drains(tmp_path):
    pid, info = daemon.detach(
        toy_argv(tmp_path), daemon.log_path(tmp_path), tmp_path / "ready", timeout_s=30
    )
    assert info == {"port": 1234}
    assert daemon.running_pid(daemon.pid_path(tmp_path)) == pid
    assert os.getsid(pid) == pid  # its own session

    with pytest.raises(DaemonError, match="in use by a running daemon"):
        daemon.acquire_pid_file(daemon.pid_path(tmp_path))

    assert daemon.stop(tmp_path, timeout_s=30) == pid
    assert not daemon.pid_alive(pid)
    assert not daemon.pid_path(tmp_path).exists()
    assert "drained, exiting" in daemon.log_path(tmp_path).read_text()

    with pytest.raises(DaemonError, match="no daemon running"):
        daemon.stop(tmp_path, timeout_s=1)


def test_detach_reports_early_failure_with_log_line(tmp_path):
    with pytest.raises(DaemonError, match="exited with code 3.*address in use"):
        daemon.detach(
            toy_argv(tmp_path, "fail"), daemon.log_path(tmp_path), tmp_path / "ready", timeout_s=30
        )


def test_detach_timeout_stops_the_child(tmp_path):
    with pytest.raises(DaemonError, match="not ready within"):
        daemon.detach(
            toy_argv(tmp_path, "never-ready"),
            daemon.log_path(tmp_path),
            tmp_path / "ready",
            timeout_s=3,
        )
    pid = daemon.read_pid(daemon.pid_path(tmp_path))
    if pid is not None:
        assert daemon.wait_exit(pid, 30)


def test_stop_removes_stale_pid_file(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    daemon.pid_path(tmp_path).write_text(f"{dead.pid} 0.0\n")
    with pytest.raises(DaemonError, match="is gone; removed the stale file"):
        daemon.stop(tmp_path, timeout_s=1)
    assert not daemon.pid_path(tmp_path).exists()


def test_signal_handler_sets_event_then_second_signal_exits(tmp_path):
    code = textwrap.dedent(
        """
        import os, signal, sys, threading
        from paramserver.plumbing import daemon
        stop = threading.Event()
        daemon.install_signal_handlers(stop)
        print("up", flush=True)
        stop.wait()
        print("first", flush=True)
        sys.stdin.readline()
        print("unreachable", flush=True)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "up"
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().strip() == "first"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 128 + signal.SIGINT
    finally:
        proc.kill()
        proc.wait()


def test_restore_handlers():
    stop = threading.Event()
    before = signal.getsignal(signal.SIGTERM)
    restore = daemon.install_signal_handlers(stop, signals=(signal.SIGTERM,))
    assert signal.getsignal(signal.SIGTERM) is not before
    restore()
    assert signal.getsignal(signal.SIGTERM) is before


def test_setup_logging_to_file(tmp_path):
    import logging

    log_file = tmp_path / "x" / "daemon.log"
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        daemon.setup_logging("debug", log_file)
        logging.getLogger("t").debug("hello %d", 7)
        for h in root.handlers:
            h.flush()
        assert "DEBUG t: hello 7" in log_file.read_text()
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
            h.close()
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])


def test_failure_message_ignores_errors_of_earlier_runs(tmp_path):
    log = daemon.log_path(tmp_path)
    log.write_text("2026-01-01 00:00:00,000 ERROR old: stale failure from yesterday\n")
    with pytest.raises(DaemonError) as info:
        daemon.detach(toy_argv(tmp_path, "fail"), log, tmp_path / "ready", timeout_s=30)
    assert "address in use" in str(info.value) and "yesterday" not in str(info.value)


def test_the_reason_of_a_failed_start_is_the_last_line_of_its_exception(tmp_path):
    log = tmp_path / "daemon.log"
    log.write_text(
        "2026-01-01 00:00:00,000 INFO shard: recovering\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n'
        "    recover()\n"
        "    ^^^^^^^^^\n"
        "ValueError: inner cause\n"
        "\n"
        "The above exception was the direct cause of the following exception:\n"
        "\n"
        "Traceback (most recent call last):\n"
        '  File "y.py", line 2, in recover\n'
        "pkg.storage.recovery.DurabilityError: shard 0 cannot recover d: start with an empty one\n"
        "  and a second line of its message\n"
    )
    assert daemon.failure_reason(log) == (
        "DurabilityError: shard 0 cannot recover d: start with an empty one"
    )
    # no traceback: the first ERROR record, without the log prefix
    log.write_text(
        "2026-01-01 00:00:00,000 INFO toy: up\n"
        "2026-01-01 00:00:01,000 ERROR paramserver.ops.supervisor: shard 1 failed: why\n"
        "2026-01-01 00:00:02,000 ERROR paramserver.ops.supervisor: shard 1 exited\n"
    )
    assert daemon.failure_reason(log) == "shard 1 failed: why"
    assert daemon.failure_reason(tmp_path / "missing.log") == ""


def test_a_detached_start_that_fails_removes_what_it_created_and_nothing_else(tmp_path):
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "data").write_text("not ours")
    with pytest.raises(daemon.DaemonStartError) as info:
        daemon.detach(toy_argv(kept, "fail"), daemon.log_path(kept), kept / "ready", 30,
                      created=daemon.first_missing(kept))  # fmt: skip
    assert info.value.code == 3 and info.value.reason == "cannot bind port 1234: address in use"
    assert (kept / "data").read_text() == "not ours"  # an existing dir keeps all it held

    new = tmp_path / "a" / "b" / "island"
    created = daemon.first_missing(new)
    assert created == tmp_path / "a"  # the outermost directory the start creates
    with pytest.raises(daemon.DaemonStartError):
        daemon.detach(toy_argv(new, "fail"), daemon.log_path(new), new / "ready", 30,
                      created=created)  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]
