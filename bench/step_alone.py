"""The outer step alone, in process: the fused (numba) step and the jitted one, against memcpy.

    python -m bench.step_alone [--params N ...] [--deltas D] [--repeats R]
        [--momentum-dtype float32|bfloat16]

Per size: fragments of at most 2**23 parameters (as `diloco-bench scale`
cuts them), each with its params, round-Nesterov momentum (in the dtype
given: `ShardConfig.momentum_dtype`) and bfloat16 downlink residual as a
shard keeps them, and D int8 pending deltas kept
coded (`codec.coded.read_coded`, as a shard keeps an accepted push). A step of
the model is, per fragment, the mean merge of its D deltas, the outer step
and the int8 downlink's frames (`merge._MeanMerge`, `fragment_step.FusedNesterov`
or `fragment_step.ChunkedStep` with `downlink.Int8Publication`): what
`FragmentStepper.step` does less the weighting's few scalars. The median of
R steps (after one warm-up) over the median of 9 memcpys of N float32
values measured just before them, as wall time and as the process's CPU
time (on a loaded machine the CPU time is what the step costs; wall time
also counts the waits for a core), the load average alongside. JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

import codec
from bench.scale import parse_count
from codec.coded import read_coded as read
from paramserver.server.step.downlink import Downlink, new_residual
from paramserver.server.step.fragment_step import ChunkedStep, FusedNesterov, host_vector
from paramserver.server.step.merge import _MeanMerge
from paramserver.server.step.outer import round_nesterov

FRAGMENT = 1 << 23
LR, BETA = 0.7, 0.8


def _fragments(params: int, deltas: int) -> list[dict]:
    out, rng = [], np.random.default_rng(0)
    for lo in range(0, params, FRAGMENT):
        n = min(FRAGMENT, params - lo)
        p = host_vector(rng.standard_normal(n, np.float32))
        coded = []
        for _ in range(deltas):
            g = rng.standard_normal(n, np.float32) * np.float32(0.01)
            frames, _ = codec.int8(zstd_level=None).encode({"values": g})
            coded.append(read(frames)[0])
        out.append({"params": p, "residual": new_residual(n), "deltas": coded})
    return out


def measure(params: int, deltas: int, repeats: int, kept: str = "float32") -> dict:
    """Time both steps over one model of `params` parameters.

    Args:
        params: the model's parameter count.
        deltas: int8 pending deltas per fragment.
        repeats: timed steps per path.
        kept: the momentum's dtype, "float32" or "bfloat16".

    Returns:
        The figures of this size.
    """
    frags = _fragments(params, deltas)
    link = Downlink("int8")
    jitted = ChunkedStep(round_nesterov(LR, BETA, kept), finish=link.finish)
    fused = FusedNesterov.for_config("nesterov", LR, BETA, 1)
    for f in frags:
        f["state"] = jitted.init(f["params"])
    weights = [1.0 / deltas] * deltas

    def one_step(kind: str) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        for f in frags:
            fill = _MeanMerge(f["deltas"], weights).fill
            pub = link.begin(f["params"], f["residual"])
            if kind == "fused":
                fused.step(f["params"], f["state"], fill, pub)
            else:
                jitted.step(f["params"], f["state"], fill, pub.apply, f["residual"])
            pub.frames()
        return time.perf_counter() - t0, time.process_time() - c0

    result: dict = {
        "params": params,
        "fragments": len(frags),
        "deltas": deltas,
        "momentum_dtype": kept,
    }
    for kind in ("fused", "jitted"):
        if kind == "fused" and fused is None:
            continue
        one_step(kind)  # compiles
        copy_wall, copy_cpu = _memcpy(params)  # the baseline next to each path, same load
        times = [one_step(kind) for _ in range(repeats)]
        wall = statistics.median(t for t, _ in times)
        cpu = statistics.median(c for _, c in times)
        result[kind] = {
            "step_s": round(wall, 4),
            "memcpy_s": round(copy_wall, 4),
            "vs_memcpy": round(wall / copy_wall, 2),
            "cpu_s": round(cpu, 4),
            "memcpy_cpu_s": round(copy_cpu, 4),
            "cpu_vs_memcpy_cpu": round(cpu / copy_cpu, 2),
        }
    result["load_avg_1m"] = os.getloadavg()[0]
    return result


def _memcpy(params: int, repeats: int = 9) -> tuple[float, float]:
    """Median wall and CPU seconds of copying `params` float32 values (at most 256 MiB copied,
    scaled up by size, as `diloco-bench scale` does)."""
    n = min(params, 64 << 20)
    src, dst = np.ones(n, np.float32), np.empty(n, np.float32)
    np.copyto(dst, src)
    walls, cpus = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        np.copyto(dst, src)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    scale = params / n
    return statistics.median(walls) * scale, statistics.median(cpus) * scale


def main(argv: list[str] | None = None) -> int:
    """Run the sizes and print JSON.

    Args:
        argv: command line (None: sys.argv).

    Returns:
        0.
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", nargs="+", type=parse_count, default=[64_000_000, 256_000_000])
    ap.add_argument("--deltas", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--momentum-dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args(argv)
    results = []
    for n in args.params:
        results.append(measure(n, args.deltas, args.repeats, args.momentum_dtype))
        print(json.dumps(results[-1]), file=sys.stderr)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
