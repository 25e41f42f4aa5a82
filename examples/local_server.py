"""A local parameter server for the examples, started and stopped as a user would by hand.

    diloco-server start --shards 2 --port PORT --data-dir DIR/server --detach
    ...                                  # the example's islands train against it
    diloco-server stop --data-dir DIR/server

`cluster(args)` does that around an example (or uses the server of
`--connect`, starting nothing), and stops what it started also on an error,
Ctrl-C or SIGTERM; it stops it as the stop command does (SIGTERM to the
server's pid, then a wait), from its own process, seconds sooner than a new
interpreter would, and runs the command only if that fails. `global_model` reads the cluster's model at the end
(`worker.global_model`: from the shards, without joining as an island).
Without `--out` every file goes to a temporary directory that the example
creates and removes; a given `--out` is never deleted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import worker

SERVER_CLI = [sys.executable, "-m", "paramserver.server.cli"]  # = diloco-server
PORT_TAKEN_EXIT = 3  # diloco-server start: a port to bind is taken; nothing was started
DIRECT_STOP_S = 60.0  # how long a SIGTERMed server may drain before the stop command is run


def example_parser(doc: str, steps: int) -> argparse.ArgumentParser:
    """The flags every example takes: its size (--steps, --inner-steps), --json, its cluster.

    Args:
        doc: the example's docstring (its first paragraph is the description).
        steps: the default number of inner steps.

    Returns:
        The parser (an example may add flags of its own).
    """
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=steps, help="inner steps per island")
    parser.add_argument("--inner-steps", type=int, default=10, help="steps per round (H)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_cluster_flags(parser)
    return parser


def print_summary(summary: dict[str, Any], as_json: bool, text: str) -> None:
    """The example's last line: `summary` as JSON (--json, what the tests read), else `text`."""
    print(json.dumps(summary) if as_json else text, flush=True)


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    """The flags every example takes for its cluster: --connect, --shards, --port, --out."""
    parser.add_argument(
        "--connect", default="", help="a running server's endpoint; default: start a local one"
    )
    parser.add_argument("--shards", type=int, default=2, help="shards of the local server")
    parser.add_argument("--port", type=int, default=0, help="its base port (0: a free one)")
    parser.add_argument("--mode", default="async", help="its merge mode: sync | quorum | async")
    parser.add_argument(
        "--out", default="", help="directory for the server's and islands' files (kept); "
        "default: a temporary one, removed at the end",
    )  # fmt: skip


STOP = threading.Event()
"""Set by Ctrl-C (and SIGTERM) once `interrupts()` is called, before the exception is raised.

A KeyboardInterrupt that lands in a callback Python ignores (a garbage collector hook,
a `__del__`) is lost; this event is not: the islands' waits observe it (`worker.join(...,
stop=STOP)`) and `raise_if_interrupted` turns it back into the KeyboardInterrupt."""


def interrupts() -> threading.Event:
    """From now on Ctrl-C sets `STOP` and raises KeyboardInterrupt, SIGTERM sets it and exits 143.

    Returns:
        `STOP`, to pass as the islands' `stop`.
    """

    def unwind(signum: int, frame: Any) -> None:
        STOP.set()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, unwind)
        signal.signal(signal.SIGTERM, unwind)
    return STOP


def raise_if_interrupted() -> None:
    """Raise the KeyboardInterrupt of a Ctrl-C that Python swallowed (`STOP` set)."""
    if STOP.is_set():
        raise KeyboardInterrupt


def join(threads: list[threading.Thread], poll_s: float = 0.2) -> None:
    """Wait for `threads` to end, waking every `poll_s` so that a Ctrl-C is handled at once.

    Python runs signal handlers in the main thread only, between bytecodes. The kernel
    may deliver a SIGINT to any thread that does not block it (JAX's and the islands'
    threads do not; ZeroMQ's do); a main thread then blocked in a plain `Thread.join()`
    never wakes to run the handler, and the run goes on as if no Ctrl-C came (seen:
    1 run in 9 on a loaded 2-core machine). A join with a timeout wakes, runs the
    handler and raises the KeyboardInterrupt.

    Args:
        threads: started threads.
        poll_s: the longest a pending Ctrl-C waits to be handled.
    """
    for thread in threads:
        while thread.is_alive():
            thread.join(poll_s)


def _free_base_port(count: int) -> int:
    """A port P such that P .. P+count-1 on 127.0.0.1 were all free a moment ago."""
    for _ in range(100):
        with socket.socket() as probe_socket:
            probe_socket.bind(("127.0.0.1", 0))
            base = probe_socket.getsockname()[1]
        if base + count > 65536:
            continue
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
            return base
    raise SystemExit(f"no {count} consecutive free ports on 127.0.0.1")


def _run(argv: list[str], what: str, port_taken_ok: bool = False) -> int:
    """Run a command to its end; exit with its last line if it failed.

    Args:
        argv: the command.
        what: its name, for the error.
        port_taken_ok: return `PORT_TAKEN_EXIT` (the server refused a taken port and
            started nothing) instead of exiting on it.

    Returns:
        0, or `PORT_TAKEN_EXIT` where allowed.
    """
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if proc.returncode == PORT_TAKEN_EXIT and port_taken_ok:
        return proc.returncode
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        raise SystemExit(f"{what} failed: {tail[-1] if tail else proc.returncode}")
    return 0


def _pid_exits(pid: int, timeout_s: float) -> bool:
    """Whether process `pid` is gone within `timeout_s` (polled)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as stat:  # a zombie has exited (Linux)
                if stat.read().rsplit(")", 1)[-1].split()[0] == "Z":
                    return True
        except ProcessLookupError:
            return True
        except OSError:
            pass
        time.sleep(0.05)
    return False


def _stop(server_dir: Path) -> None:
    """Stop the server: SIGTERM its supervisor, as `diloco-server stop` does, and wait.

    Signalled from here, it stops seconds sooner than through a new interpreter
    running the stop command (which a Ctrl-C user waits for); the command is the
    fallback, e.g. when the pid file is unreadable or the server outlives the wait.
    """
    try:  # daemon.pid holds the pid (its first word)
        pid = int((server_dir / "daemon.pid").read_text().split()[0])
        os.kill(pid, signal.SIGTERM)
        if _pid_exits(pid, DIRECT_STOP_S):
            return
    except (OSError, ValueError, IndexError):
        pass
    proc = subprocess.run(
        [*SERVER_CLI, "stop", "--data-dir", str(server_dir)], capture_output=True, timeout=300
    )
    if proc.returncode != 0:
        print(f"diloco-server stop --data-dir {server_dir} failed", file=sys.stderr)


@contextlib.contextmanager
def cluster(args: argparse.Namespace) -> Iterator[tuple[str, Path]]:
    """A server to train against and a directory for the islands' files.

    Args:
        args: parsed `add_cluster_flags` flags.

    Yields:
        (connect endpoint, work directory).
    """
    interrupts()  # SIGTERM unwinds like Ctrl-C, so the server is stopped
    with contextlib.ExitStack() as stack:
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
        else:
            out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="diloco-example-")))
        if args.connect:
            yield args.connect, out
            return
        raise_if_interrupted()
        server_dir = out / "server"
        for attempt in range(3):  # a port we picked and another process took meanwhile: again
            port = args.port or _free_base_port(2 * args.shards)
            argv = [
                *SERVER_CLI, "start", "--shards", str(args.shards), "--port", str(port),
                "--mode", args.mode, "--data-dir", str(server_dir),
            ]  # fmt: skip
            if getattr(args, "inner_steps", None):  # the islands' H: picks the default outer lr
                argv += ["--inner-steps", str(args.inner_steps)]
            may_retry = not args.port and attempt < 2
            try:  # a failed start leaves nothing
                code = _run([*argv, "--detach"], "diloco-server start", may_retry)
            except KeyboardInterrupt:  # Ctrl-C while it starts: it may be up already
                _stop(server_dir)
                raise
            if code == 0:
                break
        stack.callback(_stop, server_dir)  # only what this example started
        raise_if_interrupted()
        print(f"server: {args.shards} shards at tcp://127.0.0.1:{port} ({args.mode})", flush=True)
        yield f"tcp://127.0.0.1:{port}", out


def global_model(connect: str, like: Any, wait_s: float = 60.0) -> tuple[Any, int]:
    """The cluster's global model once every acked delta is merged (after the islands closed).

    Args:
        connect: the server's endpoint.
        like: a params tree of the cluster's model (its values are not used).
        wait_s: how long to wait for the shards to merge what they acked.

    Returns:
        (the global params as `like`'s tree type and placement, the sum of the
        fragments' versions).
    """
    return worker.global_model(connect, like=like, wait_s=wait_s)
