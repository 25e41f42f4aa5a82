"""Shard throughput: merge + outer step vs decode, push->ack round trips, checkpoint and restart.

JSON on stdout, progress on stderr. Four measurements, all in one run:

- `merge_step`: one shard's ShardState (no sockets) merging `--islands`
  decoded int8 deltas per fragment and stepping the outer optimizer over a
  `--params` parameter fragment set; throughput in GB/s of float32 delta
  consumed, next to `codec.decode` throughput of the same deltas (GB/s of
  float32 produced). Target: merge_step / decode >= 0.5.
- `round_trip`: a live ShardServer on loopback (thread, real sockets, fsync
  on), one DEALER pushing `--rt-params`-element int8 deltas one at a time;
  push -> ack round trips per second (mode async, so every push also steps),
  with fsync on (the durable default) and off (what the network and the
  rest of the loop cost).
  `merge_step.int8_downlink` repeats it with the int8 downlink (each update
  quantized, decoded and applied) and reports the published bytes per step.
- `checkpoint`: write time and size of the merge_step shard's checkpoint.
- `restart`: seconds from starting a ShardServer on that data dir (load the
  checkpoint, replay the log) until it serves.
- `pending_memory`: a fresh `--params` shard accepting `--pending` int8
  deltas per fragment (pushes through `submit_delta`, nothing stepped): the
  process's RSS growth per pending delta, over the parameters (target <= 1.1
  B/param: deltas stay coded), next to what the state counts
  (`pending_bytes`) and what the zstd frames on the wire weigh (what keeping
  them compressed would cost). `--pending-only` runs just this one.
- `checkpoint_acks`: a live shard of `--ckpt-params` parameters (default 64M)
  in `--ckpt-fragments` fragments, checkpointing every `--ckpt-every-s`
  seconds (fsync on), while one DEALER pushes int8 deltas to its fragments in
  turn for `--ckpt-seconds` (async: every push also steps its fragment);
  push -> ack latency (p50 / p99 / max) of the pushes whose round trip
  overlapped a checkpoint write against the others (quiet), their ratio, and
  each checkpoint's seconds and bytes. The writes are found from the shard's
  own log lines ("checkpoint N: B bytes in S s"), so the same script measures
  a build whose checkpoints are written inside the serving loop.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np
import zmq

import codec
from bench import cli
from bench.common import emit_json, gbps, progress, timed
from codec.coded import read_coded
from paramserver.server.config import ShardConfig
from paramserver.server.fragment import AcceptEvent, Contribution
from paramserver.server.shard import ShardServer
from paramserver.server.state import ShardState
from paramserver.server.storage.shard_storage import ShardStorage
from paramserver.wire import protocol
from paramserver.wire.plan import leaf_specs, make_plan

T0 = 1_000_000.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `diloco-bench server`.

    Args:
        parser: the subcommand's parser.
    """
    parser.add_argument("--params", type=int, default=1 << 24, help="shard parameters (16M)")
    parser.add_argument("--fragments", type=int, default=2, help="fragments of the shard")
    parser.add_argument("--islands", type=int, default=2, help="deltas merged per step")
    parser.add_argument("--rt-params", type=int, default=1 << 20, help="round-trip delta size")
    parser.add_argument("--pushes", type=int, default=100, help="round trips measured")
    parser.add_argument("--repeats", type=int, default=5, help="repeats per timing")
    parser.add_argument(
        "--ckpt-params", type=int, default=1 << 26, help="checkpoint_acks shard size (64M)"
    )
    parser.add_argument(
        "--ckpt-fragments",
        type=int,
        default=256,
        help="checkpoint_acks: fragments of that shard (default 256)",
    )
    parser.add_argument(
        "--ckpt-every-s",
        type=float,
        default=4.0,
        help="checkpoint_acks: seconds between its checkpoints (default 4)",
    )
    parser.add_argument(
        "--ckpt-seconds",
        type=float,
        default=20.0,
        help="checkpoint_acks: seconds of pushes measured (default 20)",
    )
    parser.add_argument(
        "--ckpt-fsync",
        choices=("true", "false"),
        default="true",
        help="checkpoint_acks: fsync the log before each ack, true or false",
    )
    parser.add_argument(
        "--only-checkpoint-acks", action="store_true", help="run checkpoint_acks alone"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--pending", type=int, default=8, help="pending deltas per fragment")
    parser.add_argument(
        "--pending-only", action="store_true", help="only the pending_memory measurement"
    )


def _flat(elements: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal(elements, dtype=np.float32) * 0.02}


def _initialized_state(cfg: ShardConfig, flat: dict[str, np.ndarray]):
    plan = make_plan(leaf_specs(flat), cfg.shards, cfg.num_fragments)
    state = ShardState(cfg, 0)
    tree = {str(f.index): plan.gather(flat, f.index) for f in plan.fragments_of(0)}
    frames, _ = codec.raw("float32").encode(tree)
    out = state.initialize(plan.to_wire(), frames)
    assert out.status == "accepted", out
    return state, plan, out.event


def measure_merge_step(args, data_dir: str, p) -> tuple[dict, ShardState, ShardStorage]:
    """Decode vs merge+step throughput on a --params shard; returns the state for later steps."""
    cfg = ShardConfig(
        fragments=args.fragments, mode="async", data_dir=data_dir, checkpoint_every_steps=0
    )
    task = p.add_task("merge + outer step", total=2 * args.repeats + 3)
    state, plan, init_event = _initialized_state(cfg, _flat(args.params, 0))
    durable = ShardStorage(cfg, 0)
    durable.recover()
    durable.append([init_event])
    rng = np.random.default_rng(1)
    int8 = codec.int8()
    deltas = {}  # fragment -> list of (frames, decoded)
    for f in plan.fragments_of(0):
        deltas[f.index] = []
        for _ in range(args.islands):
            vec = rng.standard_normal(f.size, dtype=np.float32) * 0.01
            frames, _ = int8.encode({"delta": vec})
            frames = [bytes(fr) for fr in frames]
            deltas[f.index].append((frames, read_coded(frames)[0]))  # kept as pending keeps it
    p.advance(task)
    all_frames = [fr for lst in deltas.values() for fr, _ in lst]
    consumed = sum(4 * d.size for lst in deltas.values() for _, d in lst)  # float32 bytes
    decode_s = timed(lambda: [codec.decode(fr) for fr in all_frames], args.repeats)
    p.advance(task)
    step_s = timed(_merge_and_step(state, deltas), args.repeats)
    p.advance(task, args.repeats)
    dec, step = gbps(consumed, decode_s), gbps(consumed, step_s)
    # the same with the int8 downlink: quantize each update, apply the decoded one
    int8_state, _, _ = _initialized_state(replace(cfg, downlink="int8"), _flat(args.params, 0))
    published: list[int] = []
    int8_s = timed(_merge_and_step(int8_state, deltas, published), args.repeats)
    p.advance(task, args.repeats)
    del int8_state
    result = {
        "params": args.params,
        "fragments": args.fragments,
        "deltas_per_step": args.islands,
        "decode_gbps": dec,
        "merge_step_gbps": step,
        "ratio_median": step["median"] / dec["median"],
        "target_ratio": 0.5,
        "meets_target": step["median"] / dec["median"] >= 0.5,
        "step_seconds_median": statistics.median(step_s),
        "int8_downlink": {
            "merge_step_gbps": gbps(consumed, int8_s),
            "published_bytes_per_step": published[-1],
            "float32_bytes_per_step": args.params * 4,
        },
    }
    return result, state, durable


def _merge_and_step(state: ShardState, deltas: dict, published: list[int] | None = None):
    """A callable that accepts every delta (already read, kept coded) and steps every fragment."""
    rounds = iter(range(1, 1 << 30))

    def merge_and_step() -> None:
        rnd = next(rounds)
        sent = 0
        for fragment, lst in deltas.items():
            for k, (_, delta) in enumerate(lst):
                c = Contribution(f"i{k}", rnd, fragment, 0, 4096, 16, T0, delta)
                state.apply(AcceptEvent(c))
            _, update = state.step(fragment, T0)
            if update.frames is not None:
                sent += protocol.message_bytes(update.frames)
        if published is not None:
            published.append(sent)

    return merge_and_step


@contextlib.contextmanager
def _live_shard(cfg: ShardConfig) -> Iterator[Callable[..., dict]]:
    """A ShardServer serving in a thread and one DEALER: yields request(header, payload)."""
    server = ShardServer(cfg, 0, router_bind="tcp://127.0.0.1:*", pub_bind="tcp://127.0.0.1:*")
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    if not server.ready.wait(60):
        raise RuntimeError("shard did not start")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.bound_endpoints[0])

    def request(header, payload=()):
        sock.send_multipart(protocol.pack(header, list(payload)), copy=False)
        if not sock.poll(120_000):
            raise RuntimeError(f"no reply to {header['kind']}")
        reply, _ = protocol.unpack(sock.recv_multipart(), role=protocol.REPLY)
        return reply

    try:
        yield request
    finally:
        sock.close(0)
        ctx.term()
        stop.set()
        thread.join(300)


def _init(request, plan, flat) -> None:
    request({"kind": "hello", "island": "bench"})
    tree = {str(f.index): plan.gather(flat, f.index) for f in plan.fragments_of(0)}
    init_frames, _ = codec.raw("float32").encode(tree)
    reply = request({"kind": "init", "island": "bench", "plan": plan.to_wire()}, init_frames)
    assert reply["kind"] == "init_ok", reply


def _push_header(plan) -> dict:
    return {
        "kind": "push",
        "island": "bench",
        "fragment": 0,
        "base_version": 0,
        "tokens": 4096,
        "steps": 16,
        "plan_hash": plan.hash,
    }


def measure_round_trip(args, data_dir: str, p, fsync: bool = True) -> dict:
    """Sequential push -> ack round trips against a live shard on loopback."""
    cfg = ShardConfig(
        fsync=fsync,
        fragments=2,
        mode="async",
        data_dir=data_dir,
        heartbeat_interval_s=5.0,
        liveness=100,
        dedup_window=1 << 20,
    )
    flat = _flat(2 * args.rt_params, 2)
    plan = make_plan(leaf_specs(flat), 1, 2)
    task = p.add_task(f"push -> ack round trips (fsync {fsync})", total=args.pushes + 10)
    with _live_shard(cfg) as request:
        _init(request, plan, flat)
        vec = np.random.default_rng(3).standard_normal(plan.fragments[0].size, dtype=np.float32)
        frames, _ = codec.int8().encode({"delta": vec * 0.01})
        wire_bytes = protocol.message_bytes(frames)
        header = _push_header(plan)
        times = []
        for rnd in range(1, args.pushes + 11):
            t = time.perf_counter()
            ack = request({**header, "round": rnd}, frames)
            if rnd > 10:  # the first ten warm up (jit of the outer step)
                times.append(time.perf_counter() - t)
            assert ack["outcome"] == "accepted", ack
            p.advance(task)
    return {
        "delta_params": plan.fragments[0].size,
        "delta_wire_bytes": wire_bytes,
        "pushes": len(times),
        "fsync": cfg.fsync,
        "mode": cfg.mode,
        "round_trips_per_s_median": 1.0 / statistics.median(times),
        "round_trip_ms": {
            "median": 1e3 * statistics.median(times),
            "p90": 1e3 * float(np.percentile(times, 90)),
        },
    }


class _CheckpointLog(logging.Handler):
    """Collects the shard's "checkpoint N: B bytes in S s" lines as (start, end, bytes)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.writes: list[tuple[float, float, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "checkpoint %d: %d bytes in %.3f s" in str(record.msg):
            _, _, size, seconds = record.args
            self.writes.append((record.created - seconds, record.created, size))


def _latency_ms(times: list[float]) -> dict:
    if not times:
        return {"count": 0}
    ms = np.asarray(times) * 1e3
    return {
        "count": len(times),
        "p50": float(np.percentile(ms, 50)),
        "p99": float(np.percentile(ms, 99)),
        "max": float(ms.max()),
    }


def measure_checkpoint_acks(args, data_dir: str, p) -> dict:
    """Push -> ack latency while checkpoints are written against quiet, on a large shard."""
    cfg = ShardConfig(
        fragments=args.ckpt_fragments,
        mode="async",
        data_dir=data_dir,
        heartbeat_interval_s=5.0,
        liveness=100,
        dedup_window=1 << 20,
        checkpoint_every_steps=0,
        checkpoint_every_s=args.ckpt_every_s,
        max_message_bytes=1 << 30,  # the init of the whole shard is one message
        fsync=args.ckpt_fsync == "true",
    )
    flat = _flat(args.ckpt_params, 4)
    plan = make_plan(leaf_specs(flat), 1, args.ckpt_fragments)
    task = p.add_task("acks during checkpoints", total=None)
    handler = _CheckpointLog()
    logger = logging.getLogger("paramserver.server.storage")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    spans: list[tuple[float, float]] = []
    try:
        with _live_shard(cfg) as request:
            _init(request, plan, flat)
            del flat
            size = min(f.size for f in plan.fragments)
            vec = np.random.default_rng(5).standard_normal(size, dtype=np.float32) * 0.01
            frames, _ = codec.int8().encode({"delta": vec})
            header = _push_header(plan)
            fragments = [f.index for f in plan.fragments if f.size == size]
            start = time.time()
            rnd = 0
            while time.time() - start < args.ckpt_seconds or not handler.writes:
                rnd += 1
                fragment = fragments[rnd % len(fragments)]
                sent = time.time()
                ack = request({**header, "round": rnd, "fragment": fragment}, frames)
                assert ack["outcome"] == "accepted", ack
                if rnd > 20:  # after warm-up (jit of the outer step)
                    spans.append((sent, time.time()))
                p.advance(task)
                if time.time() - start > 10 * args.ckpt_seconds + 600:
                    raise RuntimeError("no checkpoint was written")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    writes = handler.writes
    during, quiet = [], []
    for sent, got in spans:
        overlaps = any(sent < end and got > begin for begin, end, _ in writes)
        (during if overlaps else quiet).append(got - sent)
    q, d = _latency_ms(quiet), _latency_ms(during)
    return {
        "params": args.ckpt_params,
        "fragments": args.ckpt_fragments,
        "push_params": size,
        "fsync": cfg.fsync,
        "pushes": len(spans),
        "ack_ms_quiet": q,
        "ack_ms_during_checkpoint": d,
        "ack_p99_during_vs_quiet": d["p99"] / q["p99"] if d["count"] and q["count"] else None,
        "target_ratio": 3.0,
        "checkpoints": len(writes),
        "checkpoint_s": [round(end - begin, 3) for begin, end, _ in writes],
        "checkpoint_bytes": writes[-1][2] if writes else None,
    }


def measure_checkpoint_and_restart(args, state, durable, data_dir, p) -> dict:
    """Checkpoint write of the merge_step shard, then restart-to-serving on its data dir."""
    task = p.add_task("checkpoint + restart", total=args.repeats + 1)
    write_s, size = [], 0
    for _ in range(args.repeats):
        durable.checkpoint(state, time.time())
        write_s.append(durable.last_checkpoint_s)
        size = durable.last_checkpoint_bytes
        p.advance(task)
    durable.close()
    cfg = replace(state.cfg, data_dir=data_dir)
    server = ShardServer(cfg, 0, router_bind="tcp://127.0.0.1:*", pub_bind="tcp://127.0.0.1:*")
    stop = threading.Event()
    start = time.perf_counter()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    if not server.ready.wait(120):
        raise RuntimeError("restarted shard did not start")
    restart_s = time.perf_counter() - start
    stop.set()
    thread.join(120)
    p.advance(task)
    return {
        "checkpoint_bytes": size,
        "checkpoint_write_s": {"median": statistics.median(write_s), "best": min(write_s)},
        "checkpoint_write_gbps_median": size / statistics.median(write_s) / 1e9,
        "fsync": cfg.fsync,
        "restart_to_serving_s": restart_s,
    }


def _rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_pending_memory(args, p) -> dict:
    """RSS growth per pending int8 delta (one per fragment, over all --params) on a fresh shard."""
    cfg = ShardConfig(fragments=args.fragments, mode="sync", fsync=False, checkpoint_every_steps=0,
                      max_islands=args.pending + 2, max_pending_per_island=1)  # fmt: skip
    task = p.add_task("pending deltas' memory", total=args.pending + 1)
    state, plan, _ = _initialized_state(cfg, _flat(args.params, 0))
    state.hello("silent", T0)  # a live island that never pushes: sync mode never steps
    rng = np.random.default_rng(2)
    frames = {}  # one delta per fragment, pushed by every island (each keeps its own copy)
    for f in plan.fragments_of(0):
        vec = rng.standard_normal(f.size, dtype=np.float32) * 0.01
        frames[f.index] = [bytes(fr) for fr in codec.int8().encode({"delta": vec})[0]]
    wire = sum(len(fr) for lst in frames.values() for fr in lst[1:])

    def push(island: str) -> None:
        state.hello(island, T0)
        for fragment, payload in frames.items():
            header = {"island": island, "round": 1, "fragment": fragment, "base_version": 0,
                      "plan_hash": plan.hash, "tokens": 4096, "steps": 16}  # fmt: skip
            assert state.submit_delta(header, payload, T0).status == "accepted"

    push("warm-up")  # the first push's one-off allocations (codec scratch) are not counted
    p.advance(task)
    gc.collect()
    before = _rss_bytes()
    for k in range(args.pending):
        push(f"i{k}")
        p.advance(task)
    gc.collect()
    grown = _rss_bytes() - before
    per = args.pending * args.params
    return {
        "params": args.params,
        "pending_deltas_per_fragment": args.pending,
        "rss_bytes_per_param_per_pending": grown / per,
        "pending_bytes_per_param": state.pending_bytes() / (per + args.params),
        "zstd_wire_bytes_per_param": wire / args.params,
        "decoded_float32_bytes_per_param": 4.0,
        "target_bytes_per_param": 1.1,
        "meets_target": grown / per <= 1.1,
    }


def run(args: argparse.Namespace) -> int:
    """Run the measurements and print JSON.

    Args:
        args: parsed flags.

    Returns:
        exit status 0.
    """
    if args.quick:
        args.params, args.rt_params, args.pushes, args.repeats = 1 << 20, 1 << 16, 20, 3
        args.ckpt_params, args.ckpt_fragments, args.ckpt_seconds = 1 << 20, 16, 3.0
        args.ckpt_every_s = 1.0
    result: dict = {"command": " ".join(sys.argv)}
    if args.pending_only:
        with progress() as p:
            result["pending_memory"] = measure_pending_memory(args, p)
        emit_json(result)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp, progress() as p:
        if args.only_checkpoint_acks:
            result["checkpoint_acks"] = measure_checkpoint_acks(args, f"{tmp}/d", p)
            emit_json(result)
            return 0
        merge, state, durable = measure_merge_step(args, f"{tmp}/a", p)
        result["merge_step"] = merge
        result["checkpoint"] = measure_checkpoint_and_restart(args, state, durable, f"{tmp}/a", p)
        del state
        result["round_trip"] = measure_round_trip(args, f"{tmp}/b", p)
        result["round_trip_no_fsync"] = measure_round_trip(args, f"{tmp}/c", p, fsync=False)
        result["pending_memory"] = measure_pending_memory(args, p)
        result["checkpoint_acks"] = measure_checkpoint_acks(args, f"{tmp}/d", p)
    emit_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(cli.main(["server", *sys.argv[1:]]))
