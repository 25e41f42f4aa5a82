"""Which project files one push runs through, measured on the default settings.

One process runs a shard (`ShardServer` serving in a thread on 127.0.0.1, its
defaults: quorum mode, fsync, a temporary data dir) and an island (`worker.join`
with its defaults: the device exchange, int8, a data dir) on a tiny model. The
island joins and trains one warm-up round, whose update it adopts; then a
profiler hook on every thread (`sys.setprofile` and `threading.setprofile`)
records each project file whose Python code runs from the round-ending
`Session.step` call until every fragment's version on the island has passed
the one it pushed from (the update that merged that delta is folded in).
Project files are those under the repository except `tests/` and `bench/`;
imports happen before the recording, so import-time code does not count.

Each thread belongs to a side: the island's (the main thread and every thread
it starts) or the shard's (its serving thread and every thread that starts).
A file run by both sides is listed under both and counted once.

    python -m bench.push_path [--inner-steps 500] [--timeout-s 120] [--functions]

Prints one JSON object: `files` (sorted, relative to the repository), `count`,
`island` and `shard` (the files each side ran), `island_count`, `shard_count`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
NOT_PROJECT = ("tests", "bench", ".venv", "venv", "build")
SIDE_ATTR = "_push_path_side"


class FileRecorder:
    """A profile hook that notes the project files whose code runs while recording.

    Installed on every thread before anything starts (`install`), it does nothing
    until `recording` is set, so the join and warm-up run at nearly full speed.
    """

    def __init__(self) -> None:
        self.recording = False
        self.files: dict[str, set[str]] = {"island": set(), "shard": set()}
        self.functions: dict[str, set[str]] = {}  # file -> qualified names of what ran
        self._project: dict[str, str | None] = {}  # co_filename -> relative path or None
        self._lock = threading.Lock()

    def _relative(self, filename: str) -> str | None:
        rel = self._project.get(filename, "")
        if rel != "":
            return rel
        rel = None
        try:
            path = Path(filename).resolve().relative_to(REPO)
        except (ValueError, OSError):
            path = None
        if (
            path is not None
            and path.suffix == ".py"
            and path.parts[0] not in NOT_PROJECT
            and "site-packages" not in path.parts
        ):
            rel = path.as_posix()
        self._project[filename] = rel
        return rel

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        """The profile function: on each Python call, note its file under the thread's side."""
        if not self.recording or event != "call":
            return
        rel = self._relative(frame.f_code.co_filename)
        if rel is None:
            return
        side = getattr(threading.current_thread(), SIDE_ATTR, "island")
        with self._lock:
            self.files[side].add(rel)
            self.functions.setdefault(rel, set()).add(frame.f_code.co_qualname)

    def install(self) -> None:
        """Hook this thread and every thread started from now on; threads inherit their side."""
        original_init = threading.Thread.__init__

        def init(thread: threading.Thread, *args: Any, **kwargs: Any) -> None:
            original_init(thread, *args, **kwargs)
            setattr(thread, SIDE_ATTR, getattr(threading.current_thread(), SIDE_ATTR, "island"))

        threading.Thread.__init__ = init  # type: ignore[method-assign]
        setattr(threading.current_thread(), SIDE_ATTR, "island")
        threading.setprofile(self.hook)
        sys.setprofile(self.hook)

    def uninstall(self) -> None:
        self.recording = False
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def _tiny_params():
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (32, 64)) / 8.0,
        "b1": jnp.zeros(64),
        "w2": jax.random.normal(k2, (64, 8)) / 8.0,
    }


def _serve_shard(data_dir: Path, inner_steps: int):
    """Start the shard's serving thread (on the shard's side); returns (server, stop, thread)."""
    from paramserver.plumbing import ports
    from paramserver.server.config import ShardConfig
    from paramserver.server.shard import ShardServer

    # the defaults (quorum, fsync), told the islands' H as a cluster is (`--inner-steps`)
    cfg = ShardConfig(data_dir=str(data_dir), inner_steps=inner_steps)
    # the endpoints the welcome advertises are the ones bound (the island's SUB must reach
    # the PUB, or every update comes by snapshot)
    base = ports.free_base_port(2)
    router, pub = f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"
    server = ShardServer(cfg, 0, [(router, pub)], router_bind=router, pub_bind=pub)
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        setattr(threading.current_thread(), SIDE_ATTR, "shard")
        try:
            server.serve(stop)
        except BaseException as exc:  # reported by `measure`
            errors.append(exc)
            server.ready.set()

    thread = threading.Thread(target=run, name="push-path-shard", daemon=True)
    setattr(thread, SIDE_ATTR, "shard")
    thread.start()
    if not server.ready.wait(60) or errors or server.bound_endpoints is None:
        stop.set()
        raise RuntimeError(f"the shard did not start: {errors[0] if errors else 'timeout'}")
    return server, stop, thread


def _wait_adopted(session, step, params, before: dict[int, int], deadline: float):
    """Call `step` until every fragment's version passed `before`; returns the params."""
    while any(session.exchange.versions[f] <= v for f, v in before.items()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no update adopted: versions {session.exchange.versions}")
        time.sleep(0.02)
        params = step(params)
    return params


def measure(
    inner_steps: int = 500, timeout_s: float = 120.0, functions: bool = False
) -> dict[str, Any]:
    """Run the shard and the island in this process and record one push's files.

    Args:
        inner_steps: step calls per round.
        timeout_s: limit of the warm-up round and of the measured push, each.
        functions: also return "functions": per file, the functions of it that ran.

    Returns:
        {"files", "count", "island", "island_count", "shard", "shard_count"}.
    """
    import jax

    import worker

    recorder = FileRecorder()
    recorder.install()
    try:
        with tempfile.TemporaryDirectory(prefix="push-path-") as tmp:
            server, stop, thread = _serve_shard(Path(tmp) / "server", inner_steps)
            try:
                params = _tiny_params()
                nudge = jax.jit(lambda p: jax.tree.map(lambda x: x * 0.999 + 0.001, p))
                connect = server.bound_endpoints[0]
                # many steps per round: the next round does not end while the update comes
                # (the wait below calls `step` every 20 ms)
                with worker.join(
                    connect,
                    island="push-path",
                    params=params,
                    inner_steps=inner_steps,
                    data_dir=Path(tmp) / "island",
                ) as session:

                    def step(p):
                        return session.step(nudge(p), tokens=64)

                    for _ in range(inner_steps):  # the warm-up round
                        params = step(params)
                    before = dict(session.exchange.versions)
                    deadline = time.monotonic() + timeout_s
                    params = _wait_adopted(session, step, params, before, deadline)
                    while session.in_round != inner_steps - 1:  # up to the round's last call
                        params = step(params)
                    before = dict(session.exchange.versions)
                    p = nudge(params)
                    jax.block_until_ready(p)
                    recorder.recording = True
                    params = session.step(p, tokens=64)  # the round-ending call
                    deadline = time.monotonic() + timeout_s
                    rounds = session.round
                    params = _wait_adopted(session, step, params, before, deadline)
                    recorder.recording = False
                    if session.round != rounds:
                        raise RuntimeError(
                            "a second round ended before the update came: raise --inner-steps"
                        )
            finally:
                stop.set()
                thread.join(60)
    finally:
        recorder.uninstall()
    island, shard = sorted(recorder.files["island"]), sorted(recorder.files["shard"])
    files = sorted(set(island) | set(shard))
    out: dict[str, Any] = {
        "files": files,
        "count": len(files),
        "island": island,
        "island_count": len(island),
        "shard": shard,
        "shard_count": len(shard),
    }
    if functions:
        out["functions"] = {f: sorted(recorder.functions[f]) for f in files}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inner-steps", type=int, default=500, help="step calls per round (500)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="limit per wait (120)")
    parser.add_argument(
        "--functions", action="store_true", help="also list, per file, the functions that ran"
    )
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.inner_steps, args.timeout_s, args.functions), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
