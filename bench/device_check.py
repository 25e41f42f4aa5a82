"""The accelerator check: installs CUDA JAX where a GPU lacks it; island, quantize and join figures against baselines, one JSON.

`diloco-bench device` (or `bench/device_check.sh`).

On a machine with an NVIDIA GPU (`nvidia-smi -L` lists one) whose JAX has no
GPU backend, it first installs the CUDA build of the installed JAX version into
this interpreter's environment (`pip install "jax[cuda12]==<version>"`; never on
a CPU-only machine, never with `--no-install`). Then, in one process, each
figure against its baseline measured in the same run:

- `island`: a model preset (`--model`, default `base`) trains on the embedded
  corpus as an island against a fresh local one-shard cluster (real daemons,
  sync mode, int8 downlink; one cluster per path), once with
  `exchange="device"` and once with `"host"`, for `--rounds` rounds of
  `--inner-steps` AdamW steps (`worker.train.InnerTrainer` driving a
  `worker.session.Session`, as the daemon's loop does). Per round
  after the first: the inner step time, `Session.stats` `exchange_s` and
  `host_device_bytes`. Baselines: the inner step, the other exchange path, a
  jitted device copy of the parameters (`bench.island_exchange`'s memcpy).
- `quantize`: the in-jit int8 quantize with error feedback (`codec.quant.jax_rule`,
  the codec's default block) of a float32 vector against a jitted copy of the
  same vector on the same device.
- `join`: `worker.join`'s per-call overhead against a user's MLP step
  (`bench.session_overhead`'s MLP loop, on its own one-shard cluster).

The three clusters start at once (their daemons' start-up overlaps) and stop at
the end; `seconds` has each part's wall time.

It records the devices (`jax.devices()`), the JAX version and, under
`ratios`, every figure over its baseline (all finite and positive). Without a
GPU seen by JAX (or with `--dry-run`) it is a dry run: tiny sizes, two
rounds, the same keys and `"dry_run": true`, for CI. The JSON goes to stdout
and, with `--out FILE`, to FILE. The clusters' data dirs live in a temporary
directory this command creates and removes.

Exit status 0; 1 when a GPU was seen but JAX still has none (the install
failed): the JSON is still written, as a dry run, with the install's error.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from bench.launcher import LocalCluster

EXCHANGES = ("device", "host")
# one fresh one-shard cluster per island (name -> diloco-server flags): each exchange path
# (sync, int8 downlink, as bench.island_exchange) and the MLP of worker.join (a model of its own)
CLUSTERS: dict[str, tuple[str, ...]] = {
    "device": ("--mode", "sync", "--downlink", "int8"),
    "host": ("--mode", "sync", "--downlink", "int8"),
    "join": (),
}
# jax's extras that pull a CUDA plugin and its libraries from pip; cuda12 runs on any
# driver of CUDA 12 or newer
PIP_EXTRAS = ("cuda12", "cuda13")
INSTALL_TIMEOUT_S = 420.0
PROBE_TIMEOUT_S = 180.0

# the sizes of a real run and of a dry run (CPU, CI: under a minute)
FULL = {
    "model": "base",
    "rounds": 4,
    "inner_steps": 10,
    "batch": 16,
    "seq_len": 128,
    "quant_elements": 1 << 26,
    "mlp_hidden": 1024,
    "mlp_batch": 256,
    "join_inner_steps": 50,
    "join_rounds": 4,
}
DRY = {
    "model": "tiny",
    "rounds": 2,
    "inner_steps": 2,
    "batch": 4,
    "seq_len": 32,
    "quant_elements": 1 << 16,
    "mlp_hidden": 64,
    "mlp_batch": 16,
    "join_inner_steps": 5,
    "join_rounds": 2,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `diloco-bench device`."""
    parser.add_argument("--out", default=None, help="also write the JSON to this file")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny sizes, 2 rounds, same keys (automatic when JAX sees no GPU)",
    )
    parser.add_argument(
        "--no-install",
        action="store_true",
        help="never pip install the CUDA build of JAX, even when a GPU is seen",
    )
    parser.add_argument(
        "--cuda-extra",
        choices=PIP_EXTRAS,
        default="cuda12",
        help="jax's pip extra the install step uses (default cuda12: any CUDA 12+ driver)",
    )
    parser.add_argument("--model", default=None, help="island model preset (default base)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds each island trains, the first untimed (default 4)",
    )
    parser.add_argument(
        "--inner-steps", type=int, default=None, help="island steps per round (default 10)"
    )
    parser.add_argument(
        "--quant-elements",
        type=int,
        default=None,
        help="float32 elements the quantize is timed on (default 2**26)",
    )


# ---- the CUDA build of JAX ------------------------------------------------------------------


def gpus_seen() -> list[str]:
    """The GPUs `nvidia-smi -L` lists ([] without the tool, or when it fails)."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return []
    try:
        proc = subprocess.run([tool, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if proc.returncode != 0:
        return []
    return [line.strip() for line in proc.stdout.splitlines() if line.strip().startswith("GPU")]


def jax_backend(python: str = sys.executable) -> str | None:
    """The default JAX backend of `python` ("gpu", "cpu", ...), probed in a fresh process.

    A fresh process, so that this one has not imported JAX before an install.

    Returns:
        The backend's name, or None when the probe failed.
    """
    probe = "import jax; print(jax.default_backend())"
    try:
        proc = subprocess.run(
            [python, "-c", probe], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = proc.stdout.split()
    return lines[-1] if proc.returncode == 0 and lines else None


def install_command(extra: str = "cuda12", python: str = sys.executable) -> list[str]:
    """pip's command line for the CUDA build of the JAX version installed now.

    Args:
        extra: one of `PIP_EXTRAS`.
        python: the interpreter whose environment gets it.
    """
    if extra not in PIP_EXTRAS:
        raise ValueError(f"extra must be one of {PIP_EXTRAS}, got {extra!r}")
    return [python, "-m", "pip", "install", f"jax[{extra}]=={metadata.version('jax')}"]


def ensure_cuda_jax(allow_install: bool, log, extra: str = "cuda12") -> dict[str, Any]:
    """Install the CUDA build of JAX when a GPU is seen and JAX has no GPU backend.

    Must run before this process imports JAX.

    Args:
        allow_install: False: never install, only report.
        log: where progress lines go.
        extra: jax's pip extra to install (`PIP_EXTRAS`).

    Returns:
        {"gpus_seen", "backend_before", "command" (None: no install), "ok", "seconds",
        "error", "backend"}: `backend` is JAX's default backend at the end.
    """
    seen = gpus_seen()
    report: dict[str, Any] = {"gpus_seen": seen, "command": None, "ok": None, "seconds": 0.0}
    report["error"] = None
    before = jax_backend() if seen else None
    report["backend_before"] = before
    if seen and before != "gpu" and allow_install:
        command = install_command(extra)
        report["command"] = command
        print(f"device: GPU seen, JAX backend {before}: {' '.join(command)}", file=log, flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S
            )
            report["ok"] = proc.returncode == 0
            if proc.returncode != 0:
                report["error"] = proc.stderr.strip()[-2000:]
        except subprocess.TimeoutExpired:
            report["ok"], report["error"] = False, f"pip ran past {INSTALL_TIMEOUT_S:g} s"
        report["seconds"] = round(time.perf_counter() - t0, 1)
        report["backend"] = jax_backend()
    else:
        report["backend"] = before
    return report


# ---- the measurements -----------------------------------------------------------------------


def _median_ms(samples: list[float]) -> float:
    return float(np.median(samples)) * 1e3


def _island(
    connect: str, exchange: str, sizes: dict[str, Any], trainer: Any, init: Any, sampler: Any
) -> dict[str, Any]:
    """One island training for the rounds with one exchange path (the trainer is compiled)."""
    from worker.session import Session
    from worker.session_config import session_config

    batch, seq_len, inner_steps = sizes["batch"], sizes["seq_len"], sizes["inner_steps"]
    cfg = session_config(connect, f"device-{exchange}", inner_steps, None, {"exchange": exchange})
    step_s, exchange_s, moved = [], [], []
    # as the daemon's loop (worker.island): the device path joins with the placed parameters
    with Session(cfg, trainer.params if exchange == "device" else init) as session:
        trainer.set_params(session.params)
        for _ in range(sizes["rounds"]):
            before = session.stats
            for _ in range(inner_steps):
                t0 = time.perf_counter()
                trainer.step(sampler.next())  # returns the loss as a float: synchronised
                step_s.append(time.perf_counter() - t0)
                params = trainer.params
                new = session.step(params, tokens=batch * seq_len)
                if new is not params:
                    trainer.set_params(new)
            after = session.stats
            exchange_s.append(after["exchange_s"] - before["exchange_s"])
            moved.append(after["host_device_bytes"] - before["host_device_bytes"])
        elements = sum(session.sizes)
        kind = type(session.exchange).__name__
    return {
        "exchange": kind,
        "params": elements,
        "step_ms": _median_ms(step_s[inner_steps:] or step_s),
        "exchange_ms": _median_ms(exchange_s[1:] or exchange_s),
        "host_device_bytes_per_param": float(np.median(moved[1:] or moved)) / elements,
        "rounds_timed": len(exchange_s[1:] or exchange_s),
        "steps_timed": len(step_s[inner_steps:] or step_s),
    }


def _device_memcpy_ms(tree: Any, repeats: int = 9) -> tuple[float, float]:
    """Median ms of a jitted device copy of `tree`, and of a host copy of its float32 bytes."""
    from bench.island_exchange import _memcpy_ms  # the same baseline that bench reports

    return _memcpy_ms(tree, repeats)


def measure_island(connects: dict[str, str], sizes: dict[str, Any], log) -> dict[str, Any]:
    """Both exchange paths of one preset, each on its own fresh one-shard cluster, and the memcpy.

    Args:
        connects: exchange path -> endpoint of its cluster (`CLUSTERS`).
        sizes: FULL or DRY (model, rounds, inner_steps, batch, seq_len).
        log: progress lines.

    Returns:
        {"model", "rounds", "inner_steps", "device": {...}, "host": {...}, "memcpy_ms",
        "host_memcpy_ms"}; each path: step_ms, exchange_ms, host_device_bytes_per_param.
    """
    import jax

    from worker import data, model
    from worker.train import InnerConfig, InnerTrainer

    result: dict[str, Any] = {
        "model": sizes["model"],
        "rounds": sizes["rounds"],
        "inner_steps": sizes["inner_steps"],
    }
    model_cfg = model.model_config(sizes["model"])
    batch, seq_len = sizes["batch"], sizes["seq_len"]
    init = jax.device_get(model.init_params(model_cfg, 0))
    # one trainer for both paths: its train step compiles once (each session starts it
    # from that cluster's parameters)
    trainer = InnerTrainer(model_cfg, InnerConfig(batch_size=batch, seq_len=seq_len), init)
    trainer.warmup()
    sampler = data.BatchSampler(data.default_corpus(), batch, seq_len, seed=0)
    for exchange in EXCHANGES:
        print(f"device: island {sizes['model']}, {exchange} exchange", file=log, flush=True)
        result[exchange] = _island(connects[exchange], exchange, sizes, trainer, init, sampler)
    result["memcpy_ms"], result["host_memcpy_ms"] = _device_memcpy_ms(trainer.params)
    return result


def measure_quantize(elements: int, repeats: int = 9) -> dict[str, Any]:
    """The in-jit int8 quantize with error feedback against a jitted copy of the same vector.

    Args:
        elements: float32 elements of the vector.
        repeats: timed calls of each (after one that compiles).

    Returns:
        {"elements", "block", "quantize_ms", "memcpy_ms", "quantize_gbps", "memcpy_gbps"}:
        GB/s of the vector's float32 bytes.
    """
    import jax
    import jax.numpy as jnp

    import codec
    from codec.quant import jax_rule as jax_quant

    block = codec.int8().block_size
    key_x, key_r = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(key_x, (elements,), jnp.float32)
    residual = 1e-3 * jax.random.normal(key_r, (elements,), jnp.float32)
    quantize = jax.jit(lambda v, r: jax_quant.quantize(v + r, 127, block))
    copy = jax.jit(jnp.copy)

    def timed(fn, *args) -> float:
        jax.block_until_ready(fn(*args))
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            samples.append(time.perf_counter() - t0)
        return float(np.median(samples))

    quantize_s, copy_s = timed(quantize, x, residual), timed(copy, x)
    nbytes = 4 * elements
    return {
        "elements": elements,
        "block": block,
        "quantize_ms": quantize_s * 1e3,
        "memcpy_ms": copy_s * 1e3,
        "quantize_gbps": nbytes / quantize_s / 1e9,
        "memcpy_gbps": nbytes / copy_s / 1e9,
    }


def measure_join(connect: str, sizes: dict[str, Any], log) -> dict[str, Any]:
    """`worker.join`'s per-call overhead against an MLP step (`bench.session_overhead`'s loop).

    Args:
        connect: endpoint of a fresh cluster (`CLUSTERS["join"]`).
        sizes: FULL or DRY (mlp_hidden, mlp_batch, join_inner_steps, join_rounds).
        log: progress lines.

    Returns:
        `bench.session_overhead`'s summary of the MLP loop (step_us, call_us,
        call_over_step, call_alone_us, call_alone_over_step, round_call_us, ...).
    """
    from bench.session_overhead import _measure_mlp

    args = argparse.Namespace(
        hidden=sizes["mlp_hidden"],
        batch=sizes["mlp_batch"],
        inner_steps=sizes["join_inner_steps"],
        rounds=sizes["join_rounds"],
        overlap_rounds=1,  # the session's default: the exchange beside training
        stages=False,  # no per-piece stamps on the round-end call
    )
    print("device: worker.join against an MLP step", file=log, flush=True)
    return _measure_mlp(connect, args)


@contextlib.contextmanager
def clusters(work: Path) -> Iterator[dict[str, str]]:
    """Every cluster of `CLUSTERS`, started at once (their starts overlap), stopped at exit.

    Args:
        work: their data dirs go below it.

    Yields:
        name -> endpoint of shard 0.
    """
    with contextlib.ExitStack() as stack:
        started = {
            name: stack.enter_context(LocalCluster(work / name, shards=1, server_args=server))
            for name, server in CLUSTERS.items()
        }
        with concurrent.futures.ThreadPoolExecutor(len(started)) as pool:
            for future in [pool.submit(c.start_server) for c in started.values()]:
                future.result()
        yield {name: c.connect for name, c in started.items()}


def ratios(island: dict[str, Any], quantize: dict[str, Any], join: dict[str, Any]) -> dict:
    """Every figure over its baseline from the same run.

    Returns:
        name -> ratio: the exchange of each path over its inner step and over the
        device memcpy, device exchange (and its step, and its host<->device bytes)
        over the host path's, quantize over memcpy, and
        `worker.join`'s call (after a step, and back to back) and round-end call over
        the MLP step.
    """
    device, host = island["device"], island["host"]
    return {
        "island_device_exchange_over_step": device["exchange_ms"] / device["step_ms"],
        "island_host_exchange_over_step": host["exchange_ms"] / host["step_ms"],
        "island_device_vs_host_exchange": device["exchange_ms"] / host["exchange_ms"],
        "island_device_step_vs_host_step": device["step_ms"] / host["step_ms"],
        "island_device_vs_host_bytes": (
            device["host_device_bytes_per_param"] / host["host_device_bytes_per_param"]
        ),
        "island_device_exchange_vs_memcpy": device["exchange_ms"] / island["memcpy_ms"],
        "island_host_exchange_vs_memcpy": host["exchange_ms"] / island["memcpy_ms"],
        "quantize_vs_memcpy": quantize["quantize_ms"] / quantize["memcpy_ms"],
        "join_call_over_step": join["call_us"] / join["step_us"],
        "join_call_alone_over_step": join["call_alone_us"] / join["step_us"],
        "join_round_call_over_step": join["round_call_us"] / join["step_us"],
    }


def _rounded(value: Any) -> Any:
    """Floats to 4 significant digits, recursively (the JSON is read by people)."""
    if isinstance(value, float):
        return float(f"{value:.4g}") if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def _sizes(args: argparse.Namespace, dry_run: bool) -> dict[str, Any]:
    sizes = dict(DRY if dry_run else FULL)
    for flag in ("model", "rounds", "inner_steps", "quant_elements"):
        if getattr(args, flag) is not None:
            sizes[flag] = getattr(args, flag)
    return sizes


def run(args: argparse.Namespace) -> int:
    """Install the CUDA build of JAX where it is missing, measure, print and write the JSON.

    Args:
        args: the parsed flags.

    Returns:
        0; 1 when a GPU was seen but JAX has no GPU backend after the install step.
    """
    t_start = time.perf_counter()
    log = sys.stderr
    install = ensure_cuda_jax(not args.no_install, log, args.cuda_extra)
    # two processes share the GPU (the island, the shard's outer step): no preallocation
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    devices = jax.devices()
    has_gpu = jax.default_backend() == "gpu"
    dry_run = bool(args.dry_run) or not has_gpu
    sizes = _sizes(args, dry_run)
    result: dict[str, Any] = {
        "dry_run": dry_run,
        "device": {
            "platform": devices[0].platform,
            "kind": devices[0].device_kind,
            "count": len(devices),
            "devices": [str(d) for d in devices],
        },
        "jax_version": jax.__version__,
        "jaxlib_version": metadata.version("jaxlib"),
        "install": install,
        "sizes": sizes,
    }
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="diloco-device-") as tmp:
        t0 = time.perf_counter()
        with clusters(Path(tmp)) as connects:
            t1 = time.perf_counter()
            island = measure_island(connects, sizes, log)
            t2 = time.perf_counter()
            print("device: in-jit int8 quantize against a device copy", file=log, flush=True)
            quantize = measure_quantize(sizes["quant_elements"])
            t3 = time.perf_counter()
            join = measure_join(connects["join"], sizes, log)
            t4 = time.perf_counter()
        seconds.update(clusters_start=t1 - t0, island=t2 - t1, quantize=t3 - t2, join=t4 - t3)
        seconds["clusters_stop"] = time.perf_counter() - t4
    result.update(island=island, quantize=quantize, join=join)
    result["ratios"] = ratios(island, quantize, join)
    result["seconds"] = {**seconds, "install": install["seconds"]}
    result["seconds"]["total"] = time.perf_counter() - t_start
    text = json.dumps(_rounded(result), sort_keys=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    if install["gpus_seen"] and not has_gpu:
        print("device: a GPU is seen but JAX has no GPU backend: ran as a dry run", file=log)
        return 1
    return 0
