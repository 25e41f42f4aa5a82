"""One shard's steady memory and outer-step time at one size, measured in this process.

`python -m bench.shard_memory --params N [--fragments F] [--islands K]
[--downlink int8|float32]` prints one JSON object: a ShardState (no sockets)
initialized with N float32 parameters in F fragments, then two rounds in
which K islands push an int8 delta to every fragment and every fragment steps
(merge of K pending deltas + outer step + publish). Figures:

- `bytes_per_param_init` / `bytes_per_param_steady`: RSS after init / after
  the two rounds (pending deltas merged, updates dropped), minus RSS before
  init (imports, the islands' prepared int8 frames), over N;
- `step_s`: seconds of one round's steps (all fragments; best and median of
  every round but the first, which compiles), next to `memcpy_s`: 5 copies of
  N float32 into a touched buffer, in the same process; `step_vs_memcpy`:
  their ratio, best over best and median over median.

Run in a fresh process per size (`bench.server` does), so that no other
measurement's freed memory is counted. Uses only ShardState's public API.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import replace

import numpy as np
import psutil

import codec
from paramserver.server.config import ShardConfig
from paramserver.server.state import ShardState
from paramserver.wire.plan import leaf_specs, make_plan

T0 = 1_000_000.0


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def _warm_up(cfg: ShardConfig) -> None:
    """Initialize and step a tiny shard of the same settings."""
    plan = make_plan(leaf_specs({"w": np.empty(4096, np.float32)}), cfg.shards, 1)
    state = ShardState(replace(cfg, fragments=1), 0)
    tree = {str(f.index): np.ones(f.size, np.float32) for f in plan.fragments_of(0)}
    assert state.initialize(plan.to_wire(), codec.raw("float32").encode(tree)[0]).status
    state.hello("w", T0)
    header = {
        "kind": "push", "island": "w", "round": 1, "fragment": 0, "base_version": 0,
        "tokens": 1, "steps": 1, "plan_hash": plan.hash,
    }  # fmt: skip
    payload = codec.int8().encode({"delta": np.ones(4096, np.float32)})[0]
    assert state.submit_delta(header, payload, T0).status == "accepted"
    state.step(0, T0)


def measure(
    params: int, fragments: int, islands: int, downlink: str, timing_rounds: int = 3
) -> dict:
    """Init a shard state, step it twice with `islands` int8 deltas per fragment, then time more.

    Args:
        params: float32 parameters of the shard.
        fragments: fragments they are cut into.
        islands: int8 deltas merged per fragment and step.
        downlink: "int8" or "float32".
        timing_rounds: rounds after the two of the memory figure, also timed.

    Returns:
        The figures of the module docstring.
    """
    cfg = ShardConfig(fragments=fragments, mode="sync", downlink=downlink, fsync=False)
    specs = leaf_specs({"w": np.empty(params, np.float32)})
    plan = make_plan(specs, cfg.shards, cfg.num_fragments)
    rng = np.random.default_rng(1)
    int8 = codec.int8()
    pushes = {}  # (island, fragment) -> frames, encoded before the baseline is read
    for f in plan.fragments_of(0):
        for i in range(islands):
            vec = rng.standard_normal(f.size, dtype=np.float32) * 0.01
            pushes[(f"i{i}", f.index)] = [bytes(x) for x in int8.encode({"delta": vec})[0]]
            del vec
    _warm_up(cfg)  # the XLA client and the code every step runs, before the baseline
    idle = _rss()
    state = ShardState(cfg, 0)
    flat = {"w": rng.standard_normal(params, dtype=np.float32) * 0.02}
    tree = {str(f.index): plan.gather(flat, f.index) for f in plan.fragments_of(0)}
    frames, _ = codec.raw("float32").encode(tree)
    del flat, tree
    assert state.initialize(plan.to_wire(), frames).status == "accepted"
    del frames
    after_init = _rss()
    for i in range(islands):
        state.hello(f"i{i}", T0)
    step_s, steady = [], 0
    for rnd in range(1, 3 + timing_rounds):
        for (island, fragment), payload in pushes.items():
            header = {
                "kind": "push", "island": island, "round": rnd, "fragment": fragment,
                "base_version": state.versions()[fragment], "tokens": 1000, "steps": 10,
                "plan_hash": plan.hash,
            }  # fmt: skip
            assert state.submit_delta(header, payload, T0).status == "accepted"
        started = time.perf_counter()
        for f in plan.fragments_of(0):
            state.step(f.index, T0)
        step_s.append(time.perf_counter() - started)
        if rnd == 2:
            steady = _rss()
    del state
    src = np.ones(params, np.float32)
    dst = np.ones(params, np.float32)
    copies = []
    for _ in range(5):
        started = time.perf_counter()
        np.copyto(dst, src)
        copies.append(time.perf_counter() - started)
    timed = step_s[1:]  # the first round compiles
    return {
        "params": params,
        "fragments": fragments,
        "deltas_per_step": islands,
        "downlink": downlink,
        "bytes_per_param_init": (after_init - idle) / params,
        "bytes_per_param_steady": (steady - idle) / params,
        "step_s": {"best": min(timed), "median": statistics.median(timed)},
        "memcpy_s": {"best": min(copies), "median": statistics.median(copies)},
        "step_vs_memcpy": {
            "best": min(timed) / min(copies),
            "median": statistics.median(timed) / statistics.median(copies),
        },
    }


def main(argv: list[str] | None = None) -> int:
    """Parse flags, measure, print JSON.

    Args:
        argv: command-line arguments (default sys.argv[1:]).

    Returns:
        exit status 0.
    """
    parser = argparse.ArgumentParser(prog="python -m bench.shard_memory", description=__doc__)
    parser.add_argument("--params", type=int, default=1 << 24, help="shard parameters (16M)")
    parser.add_argument("--fragments", type=int, default=2, help="fragments of the shard")
    parser.add_argument("--islands", type=int, default=2, help="deltas merged per step")
    parser.add_argument("--downlink", choices=("int8", "float32"), default="int8")
    parser.add_argument("--timing-rounds", type=int, default=3, help="more rounds timed")
    args = parser.parse_args(argv)
    figures = measure(args.params, args.fragments, args.islands, args.downlink, args.timing_rounds)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
