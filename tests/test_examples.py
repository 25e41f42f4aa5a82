"""Every script of examples/ runs on a small setting against a live local server it starts."""

import contextlib
import ctypes
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import daemon_process
import pytest

from paramserver.plumbing import daemon

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RUN_TIMEOUT_S = 240  # a 2-shard server starts in seconds, far longer on a loaded 2-core box

pytestmark = [pytest.mark.slow, pytest.mark.timeout(RUN_TIMEOUT_S + 60)]


def _server_stopped(out: Path) -> bool:
    return daemon.running_pid(daemon.pid_path(out / "server")) is None


def run_example(name: str, out: Path, *flags: str) -> tuple[dict, str]:
    """Run examples/NAME with --json --out OUT; return its summary and its whole output."""
    try:
        proc = subprocess.run(
            [sys.executable, str(EXAMPLES / name), "--json", "--out", str(out), *flags],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
        server_stopped = _server_stopped(out)
    finally:  # whatever happened: nothing the example started outlives the test
        daemon_process.stop_daemons_under(out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert server_stopped, "the example left its server running"
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stdout


def test_own_mlp_two_islands_halve_the_global_loss(tmp_path):
    summary, output = run_example("own_mlp.py", tmp_path, "--steps", "60")
    assert "island a: 60 steps" in output and "island b: 60 steps" in output
    assert summary["global_loss"] < summary["initial_loss"] / 2, summary
    assert summary["global_version"] > 0
    assert (tmp_path / "a" / "metrics.jsonl").exists()  # the kept --out holds both islands' rows
    assert (tmp_path / "b" / "metrics.jsonl").exists()


def test_flax_nnx_model_trains_through_split_and_merge(tmp_path):
    if importlib.util.find_spec("flax") is None:
        if os.environ.get("CI") == "true":  # ./dev installs the examples extra: CI runs this
            pytest.fail("flax is missing in CI: ./dev installs '.[dev,metrics,examples]'")
        pytest.skip("flax is not installed (pip install 'decoupled-diloco[examples]')")
    summary, output = run_example("flax_nnx.py", tmp_path, "--steps", "60")
    assert "island nnx: 60 steps" in output
    assert summary["global_loss"] < summary["initial_loss"] / 2, summary
    assert summary["global_accuracy"] > 0.8, summary


def test_flax_nnx_without_flax_says_so_and_exits_cleanly(tmp_path):
    blocker = tmp_path / "no_flax"
    blocker.mkdir()
    (blocker / "flax.py").write_text("raise ImportError('flax hidden for this test')\n")
    env = {**os.environ, "PYTHONPATH": str(blocker)}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "flax_nnx.py"), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "skipped: flax is not installed" in proc.stdout
    assert "pip install 'decoupled-diloco[examples]'" in proc.stdout
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_token_file_trains_our_transformer_on_a_bin_it_wrote(tmp_path):
    summary, output = run_example("token_file.py", tmp_path, "--steps", "40", "--tokens", "50000")
    assert "tokens.bin (50000 uint16 ids, vocab 512)" in output
    assert (tmp_path / "tokens.bin").stat().st_size == 2 * 50_000
    assert abs(summary["initial_loss"] - summary["uniform_loss"]) < 0.3, summary
    assert summary["global_loss"] < summary["initial_loss"] - 1.0, summary


def test_from_checkpoint_starts_from_an_orbax_checkpoint_and_saves_the_global_model(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    summary, output = run_example("from_checkpoint.py", tmp_path, "--steps", "40")
    assert (tmp_path / "init-checkpoint").is_dir()  # made first: none was given
    assert summary["global_loss"] < summary["restored_loss"], summary
    with ocp.StandardCheckpointer() as checkpointer:  # plain Orbax, none of our code
        saved = checkpointer.restore(Path(summary["checkpoint"]))
    assert sorted(saved) == ["b1", "b2", "w1", "w2"] and saved["w1"].shape == (16, 64)


@pytest.fixture
def example_proc(tmp_path) -> Iterator[Callable[..., subprocess.Popen]]:
    """Start an example in its own session; at teardown kill it and every daemon under tmp_path."""
    with contextlib.ExitStack() as stack:

        def start(name: str, *flags: str) -> subprocess.Popen:
            argv = [sys.executable, "-X", "faulthandler", "-u", str(EXAMPLES / name),
                    "--out", str(tmp_path), *flags]  # fmt: skip
            return stack.enter_context(
                daemon_process.started(
                    argv, [tmp_path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
            )

        yield start


def _signal_another_thread(pid: int, sig: int) -> None:
    """Deliver `sig` to a thread of process `pid` other than its main one (one that takes it).

    The kernel may hand a process's Ctrl-C to any of its threads that does not block
    it (JAX's and the islands' threads do not; ZeroMQ's do). tests/test_ctrl_c.py sends
    it to the process; this sends it to one of those other threads, deterministically.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    for task in sorted(Path(f"/proc/{pid}/task").iterdir(), key=lambda t: int(t.name)):
        tid = int(task.name)
        try:
            status = (task / "status").read_text().splitlines()
        except OSError:  # the thread ended meanwhile
            continue
        blocked = int(next(line for line in status if line.startswith("SigBlk")).split()[1], 16)
        if tid != pid and not blocked & (1 << (sig - 1)) and libc.tgkill(pid, tid, sig) == 0:
            return  # (a thread that ended meanwhile fails with ESRCH: try the next)
    pytest.fail(f"process {pid} has no other thread that takes signal {sig}")


def test_ctrl_c_stops_the_islands_and_the_server_it_started(tmp_path, example_proc):
    proc = example_proc("own_mlp.py", "--steps", "100000")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (tmp_path / "a" / "metrics.jsonl").exists():  # the islands are training
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.2)
    assert not _server_stopped(tmp_path)
    _signal_another_thread(proc.pid, signal.SIGINT)  # the main thread blocks in a join
    try:
        out, _ = proc.communicate(timeout=120)  # seconds unloaded (tests/test_ctrl_c.py: 10 s)
    except subprocess.TimeoutExpired:  # -X faulthandler: SIGABRT prints every thread's stack
        proc.send_signal(signal.SIGABRT)
        pytest.fail(f"still running 120 s after the SIGINT:\n{proc.communicate(timeout=30)[0]}")
    assert proc.returncode != 0 and "KeyboardInterrupt" in out
    assert _server_stopped(tmp_path)
