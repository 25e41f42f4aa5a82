"""The island side of `diloco-bench scale`: one round's exchange of a model preset, against memcpy.

One `worker.join` session per exchange path, each against a fresh one-shard
server in async mode, with `inner_steps=2`: a round's first `Session.step`
call folds the update that merged the previous round (waited for, untimed,
between rounds, as it arrives mid-round in training), its second pushes
every fragment (delta, error-feedback int8 encode). A jitted nudge of every
parameter stands in for the inner step. Per round it reads:

- `exchange_s`: `Session.stats["exchange_s"]` where the session has it (the
  device exchange, issue 21); otherwise this module's timer: the round's two
  step calls' wall time minus the session's sync wait (`Session.goodput_clock.wait_s`);
- `host_device_bytes`: `Session.stats["host_device_bytes"]` where it exists;
  otherwise counted here around the host path's two transfers
  (`TreeLayout.to_host`: the device-to-host copy of every leaf, and
  `TreeLayout.build` placing the folded values back).

The paths are `exchange="device"` and `"host"` when the session has that
setting (`worker.session_config.SESSION_SETTINGS`); before that, today's
exchange, which is the host path.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any, TextIO

from bench.common import memcpy_gbps
from bench.launcher import LocalCluster

SETTING = "exchange"  # the island setting choosing the path (SEAMS S3)
INNER_STEPS = 2  # calls per round: one folds the last update, one pushes


def exchange_paths() -> list[str]:
    """The exchange paths this build of the island has: ["device", "host"], or ["host"] (today's)."""
    from worker.session_config import SESSION_SETTINGS

    return ["device", "host"] if SETTING in SESSION_SETTINGS else ["host"]


def _counting_layout(layout: Any) -> Any:
    """`layout` as a TreeLayout that adds the bytes of its host<->device copies to `.moved[0]`."""
    from worker.param_tree import TreeLayout

    @dataclasses.dataclass(frozen=True)
    class CountingLayout(TreeLayout):
        moved: list = dataclasses.field(default_factory=lambda: [0])

        def to_host(self, leaves):
            out = super().to_host(leaves)
            self.moved[0] += sum(a.nbytes for a in out.values())
            return out

        def build(self, flat, place=True):
            if place:
                self.moved[0] += sum(
                    flat[name].size * dtype.itemsize
                    for name, dtype, where in zip(
                        self.names, self.dtypes, self.shardings, strict=True
                    )
                    if where is not None
                )
            return super().build(flat, place)

    fields = {f.name: getattr(layout, f.name) for f in dataclasses.fields(TreeLayout)}
    return CountingLayout(**fields)


def _wait_merged(session: Any, timeout_s: float = 120.0) -> None:
    """Until the update that merged the session's last round is in its client (not timed)."""
    last = session.round_base + session.round - 1
    deadline = time.monotonic() + timeout_s
    while not session.client.round_merged(last):
        if time.monotonic() > deadline:
            raise TimeoutError(f"round {last} not merged within {timeout_s:g}s")
        time.sleep(0.005)


def _rounds(session: Any, params: Any, rounds: int) -> tuple[list[float], list[int], str]:
    """Run `rounds` two-step rounds; per round the exchange seconds and host-device bytes.

    A round's first call folds the previous round's update (it arrived meanwhile, as
    it does mid-round in training), its second pushes: what one round moves.
    """
    import jax

    nudge = jax.jit(lambda tree: jax.tree.map(lambda x: x * 0.9999 + 1e-5, tree))
    own = not {"exchange_s", "host_device_bytes"} <= set(session.stats)
    if own:
        session.layout = _counting_layout(session.layout)
    seconds, moved = [], []
    for _ in range(rounds):
        before, wait0 = session.stats, session.goodput_clock.wait_s
        bytes0 = session.layout.moved[0] if own else before["host_device_bytes"]
        wall = 0.0
        for _ in range(INNER_STEPS):
            params = jax.block_until_ready(nudge(params))
            t0 = time.perf_counter()
            params = jax.block_until_ready(session.step(params, tokens=4096))
            wall += time.perf_counter() - t0
        after = session.stats
        if own:
            seconds.append(wall - (session.goodput_clock.wait_s - wait0))
            moved.append(session.layout.moved[0] - bytes0)
        else:
            seconds.append(after["exchange_s"] - before["exchange_s"])
            moved.append(after["host_device_bytes"] - bytes0)
        _wait_merged(session)
    how = (
        "bench timer (step calls minus sync wait); bytes of TreeLayout.to_host/build counted here"
        if own
        else "Session.stats exchange_s / host_device_bytes"
    )
    return seconds, moved, how


def measure_island(out: Path, preset: str, rounds: int, log: TextIO) -> dict[str, Any]:
    """The exchange of one model preset per path, as ratios to a memcpy of its float32 bytes.

    Args:
        out: the servers' data dirs go below it.
        preset: a `worker.model` preset ("small", "base").
        rounds: rounds per path (the first, which compiles, is not counted).
        log: progress lines.

    Returns:
        {"params", "memcpy_ms", "<path>": {"exchange_ms", "exchange_vs_memcpy",
        "host_device_bytes_per_param", "measured_by"}, ...}.
    """
    import jax
    import numpy as np

    import worker
    from worker import model

    params = model.init_params(model.model_config(preset), 0)
    count = sum(int(np.size(leaf)) for leaf in jax.tree.leaves(params))
    memcpy_s = 4 * count / (memcpy_gbps(4 * count)["median"] * 1e9)
    result: dict[str, Any] = {"params": count, "memcpy_ms": round(memcpy_s * 1e3, 3)}
    paths = exchange_paths()
    for path in paths:
        setting = {SETTING: path} if len(paths) > 1 else {}
        with LocalCluster(out / f"{preset}-{path}", shards=1, server_args=("--mode", "async")) as c:
            print(f"scale: island {preset}, {path} exchange", file=log, flush=True)
            c.start_server()
            with worker.join(
                c.connect,
                island=f"scale-{preset}",
                params=params,
                inner_steps=INNER_STEPS,
                **setting,
            ) as session:
                seconds, moved, how = _rounds(session, params, rounds + 1)
        exchange_s = statistics.median(seconds[1:])
        result[path] = {
            "exchange_ms": round(exchange_s * 1e3, 3),
            "exchange_vs_memcpy": round(exchange_s / memcpy_s, 2),
            "host_device_bytes_per_param": round(statistics.median(moved[1:]) / count, 3),
            "rounds": rounds,
            "measured_by": how,
        }
    return result
