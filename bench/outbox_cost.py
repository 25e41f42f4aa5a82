"""What persisting before sending costs an island: outbox writes per round against its exchange.

Since issue 23 an island writes every push batch to ``<data_dir>/outbox.bin``
(one fsync per batch) before the deltas leave (`worker.outbox`). For each
model (default: tiny and base) a `Session` with a data dir joins a fresh local
2-shard cluster (real daemons, 127.0.0.1, mode async: every delta is pushed,
none skipped while its predecessor waits for a merge), and every round moves every
parameter a little and ends with a push; per round it reads the session's
`exchange_s` (delta, quantize, encode, fold) and the outbox's `persist_s`
(write, fsync, compaction); the first two rounds (compilation) are left
out. Prints one JSON object: per model the medians in
milliseconds, `persist_over_exchange` (median over rounds of persist /
exchange, and the ratio of the sums), the bytes written per round and the
file's largest and final size over the run (bounded: `worker.outbox`
compacts it once resolved records dominate).

With `--params N` (issue 37) it measures one large delta instead, without a
cluster: N int8 codes (random bytes, block scales) framed by the codec's frame
writer as the island frames device codes (`codec.coded.frame_codes`, int8
without zstd), persisted through a real `worker.outbox.Outbox` in a fresh
data dir under `--out` (`Outbox.record`: the record built, written, fdatasynced,
as the push thread calls it), and pushed as one multipart message over
loopback ZeroMQ (DEALER -> ROUTER, measured until the last byte is received).
The persist's stages are timed by wrapping `worker.outbox.delta_record`
and `os.fdatasync` for the call (the rest is the write). Prints the medians
over `--repeats`, the push time at `--link-gbit` (computed: bytes * 8 / rate,
not measured), the persist / push ratios, and a 12B-parameter round computed
from the measured per-byte costs.

    diloco-bench outbox_cost [--rounds 30] [--models tiny,base] [--out DIR]
    diloco-bench outbox_cost --params 1e9 [--repeats 3] [--link-gbit 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bench import child, outdir
from bench.common import progress
from bench.launcher import LocalCluster

WARMUP_ROUNDS = 2  # rounds run first and left out of the figures (the exchange compiles)
SEED_SCALE_PARAMS = 12_000_000_000  # the seed's island (12B parameters), for the computed round


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the bench."""
    parser.add_argument("--rounds", type=int, default=30, help="rounds per model (default 30)")
    parser.add_argument("--inner-steps", type=int, default=2, help="steps per round (default 2)")
    parser.add_argument(
        "--models", default="tiny,base", help="comma-separated models (default tiny,base)"
    )
    parser.add_argument(
        "--params",
        type=float,
        default=0,
        help="measure one int8 delta of this many parameters (e.g. 1e9) instead of the models: "
        "frame, persist (write + fsync), loopback push; no cluster",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="with --params: how many times each stage is measured, medians reported (default 3)",
    )
    parser.add_argument(
        "--link-gbit",
        type=float,
        default=2.0,
        help="--params: the link rate of the computed push time, Gbit/s (default 2)",
    )
    parser.add_argument(
        "--out",
        default="runs/outbox-cost",
        help="output directory (default runs/outbox-cost): new, empty or a bench's",
    )


def filesystem(path: Path) -> str:
    """The type of the file system holding `path` (from /proc/mounts; "?" elsewhere)."""
    best, kind = "", "?"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    where = str(path.resolve())
    for line in mounts:
        fields = line.split()
        if len(fields) > 2 and where.startswith(fields[1]) and len(fields[1]) > len(best):
            best, kind = fields[1], fields[2]
    return kind


def _measure(connect: str, name: str, args: argparse.Namespace, data_dir: Path, tick) -> dict:
    import jax

    from worker import model
    from worker.session import Session
    from worker.session_config import session_config

    params = model.init_params(model.model_config(name), 0)

    @jax.jit
    def move(tree, key):  # noise: deltas that do not compress away, as trained ones
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        keys = jax.random.split(key, len(leaves))
        moved = [
            x + 1e-3 * jax.random.normal(k, x.shape, x.dtype)
            for x, k in zip(leaves, keys, strict=True)
        ]
        return jax.tree_util.tree_unflatten(treedef, moved)

    cfg = session_config(connect, f"outbox-{name}", args.inner_steps, str(data_dir), {})
    exchange, persist, sizes = [], [], []
    with Session(cfg, params) as s:
        assert s.outbox is not None
        p = s.params
        for _ in range(args.rounds + WARMUP_ROUNDS):
            ex0, pe0 = s.exchange_s, s.outbox.persist_s
            for _ in range(args.inner_steps):
                p = s.step(jax.block_until_ready(move(p, jax.random.key(s.steps))), tokens=1)
            exchange.append(s.exchange_s - ex0)
            persist.append(s.outbox.persist_s - pe0)
            sizes.append(s.outbox.size)
            tick()
        written, compactions = s.outbox.bytes_written, s.outbox.compactions
        n_params = sum(s.sizes)
    exchange, persist = exchange[WARMUP_ROUNDS:], persist[WARMUP_ROUNDS:]  # compile: left out
    ratio = np.asarray(persist) / np.maximum(np.asarray(exchange), 1e-9)
    return {
        "params": n_params,
        "rounds": args.rounds,
        "exchange_ms": round(float(np.median(exchange)) * 1e3, 3),
        "persist_ms": round(float(np.median(persist)) * 1e3, 3),
        "persist_ms_max": round(float(np.max(persist)) * 1e3, 3),
        "persist_over_exchange": round(float(np.median(ratio)), 4),
        "persist_over_exchange_sum": round(float(np.sum(persist) / np.sum(exchange)), 4),
        "bytes_written_per_round": int(written / (args.rounds + WARMUP_ROUNDS)),
        "outbox_max_bytes": int(max(sizes)),
        "outbox_bytes_after_round": sizes[-5:],
        "compactions": compactions,
    }


@contextlib.contextmanager
def _timing(module: Any, name: str, spent: list[float], cpu: list[float]) -> Iterator[None]:
    """Wrap `module.name` for the block: each call's seconds (wall, thread CPU) are appended."""
    original = getattr(module, name)

    def timed(*a: Any, **kw: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return original(*a, **kw)
        finally:
            spent.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)

    setattr(module, name, timed)
    try:
        yield
    finally:
        setattr(module, name, original)


def _persist(frames: list, data_dir: Path, round_id: int) -> dict[str, float]:
    """Persist one delta through a fresh outbox in `data_dir` as the push thread does; time it.

    Returns:
        Seconds: `persist_s` (the outbox's own clock: record, write, fdatasync), and its
        stages `record_s` (the record built: msgpack head, bin headers, crc32 over the
        frames), `fsync_s` and `write_s` (the rest: writev); `*_cpu_s`: this thread's CPU
        time of the same (load-independent).
    """
    from paramserver.client import PushRequest
    from worker import outbox as outbox_format
    from worker.outbox import OUTBOX_FILE, Outbox

    data_dir.mkdir(parents=True)
    box = Outbox.open(data_dir / OUTBOX_FILE, "outbox-bench", "bench-plan")
    request = PushRequest(0, round_id, 0, 1, 1, frames)
    record_s: list[float] = []
    fsync_s: list[float] = []
    record_cpu: list[float] = []
    fsync_cpu: list[float] = []
    try:
        c0 = time.thread_time()
        with (
            _timing(outbox_format, "delta_record", record_s, record_cpu),
            _timing(os, "fdatasync", fsync_s, fsync_cpu),
        ):
            box.record([], [request])
        persist_cpu = time.thread_time() - c0
        if box.bytes_written < len(frames[0]) + sum(len(f) for f in frames[1:]):
            raise OSError(f"the outbox in {data_dir} did not persist the delta (see the log)")
        persist = box.persist_s
    finally:
        box.keep([])  # removes the file this run created
        data_dir.rmdir()
    return {
        "persist_s": persist,
        "record_s": sum(record_s),
        "fsync_s": sum(fsync_s),
        "write_s": persist - sum(record_s) - sum(fsync_s),
        "persist_cpu_s": persist_cpu,
        "record_cpu_s": sum(record_cpu),
        "fsync_cpu_s": sum(fsync_cpu),
        "write_cpu_s": persist_cpu - sum(record_cpu) - sum(fsync_cpu),
    }


def _push_loopback(frames: list) -> tuple[float, float]:
    """Seconds to move `frames` as one multipart message over loopback ZeroMQ DEALER -> ROUTER.

    Timed from the send until the receiver holds the whole message (copy-free on both ends).

    Returns:
        (wall seconds, the process's CPU seconds meanwhile: sender, receiver, ZeroMQ threads).
    """
    import zmq

    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    received: dict[str, Any] = {}
    try:
        for s in (router, dealer):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")

        def receive() -> None:
            if router.poll(600_000):
                parts = router.recv_multipart(copy=False)
                received["at"] = time.perf_counter()
                received["bytes"] = sum(len(p.buffer) for p in parts[1:])  # after the identity

        thread = threading.Thread(target=receive, name="outbox-bench-router", daemon=True)
        thread.start()
        t0, c0 = time.perf_counter(), time.process_time()
        dealer.send_multipart(frames, copy=False)
        thread.join(660)
        cpu = time.process_time() - c0
    finally:
        dealer.close(0)
        router.close(0)
        ctx.term()
    sent = sum(len(memoryview(f).cast("B")) for f in frames)
    if received.get("bytes") != sent:
        raise RuntimeError(f"loopback push: {received.get('bytes')} of {sent} bytes received")
    return received["at"] - t0, cpu


def _rounded(seconds: float) -> float:
    return round(seconds, 4)


def measure_delta(params: int, repeats: int, link_gbit: float, where: Path) -> dict[str, Any]:
    """Frame, persist and push one int8 delta of `params` parameters `repeats` times.

    Args:
        params: parameters of the delta (one int8 code each, a float32 scale per block).
        repeats: measurements (the figures are medians).
        link_gbit: the link rate of the computed push time.
        where: the directory the outbox data dirs are made in (and removed from).

    Returns:
        The figures (seconds, ratios, per-byte costs, the 12B round computed from them).
    """
    import codec
    from codec.coded import frame_codes

    island_codec = codec.int8(zstd_level=None)  # the island's (worker.session_config)
    block = island_codec.block_size
    rng = np.random.default_rng(0)
    scales = rng.uniform(1e-4, 1e-2, -(-params // block)).astype(np.float32)
    rows = []
    for k in range(repeats):
        codes = np.frombuffer(rng.bytes(params), np.int8)  # random: no zstd on this path anyway
        t0, c0 = time.perf_counter(), time.thread_time()
        frames = frame_codes("int8", block, island_codec.zstd_level, codes, scales, params)
        frame_s, frame_cpu = time.perf_counter() - t0, time.thread_time() - c0
        del codes  # the payload behind the frames holds the codes now
        row = {"frame_s": frame_s, "frame_cpu_s": frame_cpu}
        row.update(_persist(frames, where / f"data-{k}", k))
        row["push_loopback_s"], row["push_loopback_cpu_s"] = _push_loopback(frames)
        wire, n_frames = sum(len(memoryview(f).cast("B")) for f in frames), len(frames)
        del frames
        rows.append(row)
    med = {key: float(np.median([r[key] for r in rows])) for key in rows[0]}
    link_s = wire * 8 / (link_gbit * 1e9)
    per_byte = {key: med[key] / wire for key in med}
    seed_bytes = wire * SEED_SCALE_PARAMS / params
    seed_link_s = seed_bytes * 8 / (link_gbit * 1e9)
    return {
        "params": params,
        "block": block,
        "frames": n_frames,
        "wire_bytes": wire,
        "repeats": repeats,
        "measured_s": {key: _rounded(v) for key, v in med.items()},
        "measured_s_each": [{key: _rounded(v) for key, v in r.items()} for r in rows],
        "ns_per_byte": {key: round(v * 1e9, 3) for key, v in per_byte.items()},
        "push_at_link_s_computed": _rounded(link_s),
        "link_gbit": link_gbit,
        "persist_over_push_at_link": round(med["persist_s"] / link_s, 4),
        "persist_over_push_loopback": round(med["persist_s"] / med["push_loopback_s"], 4),
        "frame_plus_persist_over_push_at_link": round(
            (med["frame_s"] + med["persist_s"]) / link_s, 4
        ),
        "round_12b_computed": {
            "note": "computed: the measured per-byte costs above times a 12B delta's bytes",
            "wire_bytes": int(seed_bytes),
            "frame_s": round(per_byte["frame_s"] * seed_bytes, 2),
            "persist_s": round(per_byte["persist_s"] * seed_bytes, 2),
            "persist_cpu_s": round(per_byte["persist_cpu_s"] * seed_bytes, 2),
            "fsync_s": round(per_byte["fsync_s"] * seed_bytes, 2),
            "push_at_link_s": round(seed_link_s, 2),
            "push_loopback_s": round(per_byte["push_loopback_s"] * seed_bytes, 2),
        },
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def run(args: argparse.Namespace) -> int:
    """Measure each model and print the JSON.

    Args:
        args: the parsed flags.

    Returns:
        0, or 2 for a bad flag (one line on stderr).
    """
    if args.params:
        return _run_delta(args)
    models = [m for m in args.models.split(",") if m]
    from worker.config import MODEL_NAMES

    bad = [m for m in models if m not in MODEL_NAMES]
    if bad or args.rounds < 1 or args.inner_steps < 1 or not models:
        print(
            f"outbox_cost: --models {args.models!r} must name models of {MODEL_NAMES}, and "
            f"--rounds {args.rounds} / --inner-steps {args.inner_steps} must be >= 1",
            file=sys.stderr,
        )
        return 2
    out = outdir.claim(Path(args.out), "outbox_cost")
    result: dict[str, Any] = {
        "inner_steps": args.inner_steps,
        "filesystem": filesystem(out),
        "cpus": os.cpu_count(),
        "load_1m": round(os.getloadavg()[0], 2),
    }
    with progress() as bar:
        for name in models:
            task = bar.add_task(f"{name}: rounds", total=args.rounds + WARMUP_ROUNDS)
            with LocalCluster(out / name, shards=2, server_args=("--mode", "async")) as cluster:
                cluster.start_server()
                result[name] = _measure(
                    cluster.connect,
                    name,
                    args,
                    out / name / "island",
                    lambda t=task: bar.advance(t),
                )
    (out / "outbox_cost.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, sort_keys=True))
    return 0


def _run_delta(args: argparse.Namespace) -> int:
    """`--params N`: one delta's frame, persist and push; print the JSON."""
    params = int(args.params)
    if params < 1 or args.params != params or args.repeats < 1 or args.link_gbit <= 0:
        print(
            f"outbox_cost: --params {args.params:g} must be a whole number >= 1, --repeats "
            f"{args.repeats} >= 1 and --link-gbit {args.link_gbit:g} > 0",
            file=sys.stderr,
        )
        return 2
    out = outdir.claim(Path(args.out), "outbox_cost")
    result: dict[str, Any] = {
        "filesystem": filesystem(out),
        "cpus": os.cpu_count(),
        "load_1m_before": round(os.getloadavg()[0], 2),
    }
    result["delta"] = measure_delta(params, args.repeats, args.link_gbit, out)
    result["load_1m_after"] = round(os.getloadavg()[0], 2)
    (out / "outbox_cost.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, sort_keys=True))
    return 0


def main() -> int:
    """`python -m bench.outbox_cost`."""
    parser = argparse.ArgumentParser(prog="python -m bench.outbox_cost", description=__doc__)
    add_arguments(parser)
    child.sigterm_unwinds()  # daemons stop as on Ctrl-C
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
