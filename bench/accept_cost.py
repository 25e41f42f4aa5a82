"""What accepting one whole-model int8 delta costs a shard, against a memcpy of its parameters.

    python -m bench.accept_cost [--params N] [--repeats R] [--zstd both|on|off] [--out DIR]

In process, no sockets: a shard core over a real data directory (fsync on),
one fragment of N float32 parameters, and whole-model int8 pushes (block 256)
from R islands, each handed to the batch path of the shard's loop alone
(`paramserver.server.shard.run_batch`; no step is due: the island that
initialised the shard never pushes). `accept_s` is
the median time from the push's frames to its ack ready to send: the
header and payload checks, the norm, the log append and the fsync
(`accept_vs_memcpy`: over one memcpy of N float32 values, the median of 9
measured in the same run, at the same load). `loop_hold_s` is the longest
loop turn of a push (what a heartbeat arriving meanwhile waits at most):
all of it where the loop checks the payload itself; where the shard checks
a large push's payload off its loop (`paramserver.server.shard.PushChecker`),
the longest of the turn that hands it off, the one that admits it and, where
a log writer thread writes and fsyncs its record
(`paramserver.server.group_commit`), the one that acks it.

Stages, the same frames outside the shard: `read_s` (frames, checksums or
zstd, header; `outcomes.read_delta`), `norm_s` (`weighting.l2_norm` of the
coded delta) and `norm_pieces_s` (the norm as the shard computed it before:
decoded 64K elements at a time), `append_fsync_s` (one record and fsync;
with the checksums checked on receipt, and `append_fsync_crc_s` computing
them again). JSON on stdout, with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import codec
from bench.scale import parse_count
from paramserver.server.admission import outcomes
from paramserver.server.config import ShardConfig
from paramserver.server.core import Request, ShardCore
from paramserver.server.shard import run_batch
from paramserver.server.step.weighting import l2_norm
from paramserver.server.storage import wal
from paramserver.server.storage.shard_storage import ShardStorage
from paramserver.wire import protocol
from paramserver.wire.plan import leaf_specs, make_plan

T0 = 1_000_000.0
BLOCK = 256


class _Pieces:
    """A coded delta read only through decode_into: the norm's path before it read codes."""

    def __init__(self, coded: Any) -> None:
        self._coded = coded
        self.size = coded.size

    def decode_into(self, lo: int, hi: int, out: np.ndarray) -> None:
        self._coded.decode_into(lo, hi, out)


def _memcpy_s(params: int, repeats: int = 9) -> float:
    src = np.ones(params, np.float32)
    dst = np.ones(params, np.float32)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _stages(frames: list[Any], params: int, out: Path, repeats: int) -> dict[str, float]:
    coded = outcomes.read_delta(frames, params)
    assert not isinstance(coded, outcomes.Outcome), coded
    l2_norm(coded)  # compiles (cached on disk after the first run)
    log = wal.WriteAheadLog(out / "stages.wal")
    header = {"t": "accept", "codec": [memoryview(f).nbytes for f in frames]}
    checks = wal.frame_checks(frames)
    stages = {
        "read_s": _timed(lambda: outcomes.read_delta(frames, params), repeats),
        "norm_s": _timed(lambda: l2_norm(coded), repeats),
        "norm_pieces_s": _timed(lambda: l2_norm(_Pieces(coded)), max(1, repeats // 2)),
        "append_fsync_s": _timed(lambda: (log.append(header, frames, checks), log.sync()), repeats),
        "append_fsync_crc_s": _timed(lambda: (log.append(header, frames), log.sync()), repeats),
    }
    log.close()
    return stages


def measure(params: int, repeats: int, zstd: bool, out: Path) -> dict[str, Any]:
    """Accept `repeats` whole-model int8 pushes into a one-fragment shard; time each.

    Args:
        params: the model's (and fragment's) size.
        repeats: pushes (one island each).
        zstd: whether the pushes' frames are zstd-compressed (level 1).
        out: the shard's data directory goes below it.

    Returns:
        The figures of the module docstring.
    """
    rng = np.random.default_rng(0)
    vec = (rng.standard_normal(params) * 1e-3).astype(np.float32)
    int8 = codec.int8(block_size=BLOCK, zstd_level=1 if zstd else None)
    frames = [bytes(f) for f in int8.encode({"delta": vec})[0]]
    del vec
    data = out / ("zstd" if zstd else "plain")
    data.mkdir(parents=True, exist_ok=True)
    cfg = ShardConfig(
        data_dir=str(data / "shard"), fragments=1, mode="sync", fsync=True, downlink="float32",
        checkpoint_every_steps=0, checkpoint_every_s=0, max_message_bytes=4 * params + (64 << 20),
        max_pending_bytes=(repeats + 2) * 2 * params, max_requests_per_s=1e6, request_burst=1 << 20,
    )  # fmt: skip
    plan = make_plan(leaf_specs({"w": np.empty(params, np.float32)}), 1, 1)
    storage = ShardStorage(cfg, 0)
    core = ShardCore(cfg, 0, storage.recover(), [("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")], T0)
    checker = _checker(core, storage)
    ids = iter(range(1, 1 << 30))

    def turn(island: str, header: dict[str, Any], payload=()) -> tuple[dict[str, Any], float]:
        request = Request(island.encode(), protocol.pack({"id": next(ids), "island": island,
                                                         **header}, list(payload)))  # fmt: skip
        started = time.perf_counter()
        sent = run_batch(core, storage, [request], T0, True, **checker)
        hold = time.perf_counter() - started
        replies = [protocol.unpack(m, protocol.REPLY)[0] for c, m in sent if c is not None]
        while not replies and checker and _wait(checker):  # checked off the loop: book it
            started = time.perf_counter()
            sent = run_batch(core, storage, [], T0, True, **checker)
            hold = max(hold, time.perf_counter() - started)  # the turn that logs and acks it
            replies = [protocol.unpack(m, protocol.REPLY)[0] for c, m in sent if c is not None]
        return replies[-1], hold

    init = codec.raw("float32").encode({"0": np.zeros(params, np.float32)})[0]
    assert turn("init", {"kind": "hello"})[0]["kind"] == "welcome"
    assert turn("init", {"kind": "init", "plan": plan.to_wire()}, init)[0]["kind"] == "init_ok"
    del init
    accept, holds = [], []
    for r in range(repeats):
        island = f"i{r}"
        assert turn(island, {"kind": "hello"})[0]["kind"] == "welcome"
        push = {"kind": "push", "round": 1, "fragment": 0, "base_version": 0, "tokens": 1000,
                "steps": 10, "plan_hash": plan.hash}  # fmt: skip
        started = time.perf_counter()
        ack, hold = turn(island, push, frames)
        accept.append(time.perf_counter() - started)
        holds.append(hold)
        assert ack.get("outcome") == "accepted", ack
    _close(checker)
    storage.close()
    memcpy = _memcpy_s(params)
    stages = _stages(frames, params, data, repeats)
    return {
        "zstd": zstd,
        "push_bytes": sum(len(f) for f in frames),
        "accept_s": round(statistics.median(accept), 4),
        "accept_vs_memcpy": round(statistics.median(accept) / memcpy, 2),
        "loop_hold_s": round(statistics.median(holds), 4),
        "loop_hold_vs_memcpy": round(statistics.median(holds) / memcpy, 2),
        **{k: round(v, 4) for k, v in stages.items()},
        **{k.replace("_s", "_vs_memcpy"): round(v / memcpy, 2) for k, v in stages.items()},
        "memcpy_s": round(memcpy, 4),
    }


def _checker(core: ShardCore, storage: ShardStorage) -> dict[str, Any]:
    """run_batch's keywords for the checker and log writer threads, where the shard has them."""
    threads: dict[str, Any] = {}
    try:
        from paramserver.server.shard import CHECK_OFF_LOOP_BYTES, PushChecker
    except ImportError:  # a shard that checks every push on its loop
        return threads
    core.check_off_loop_bytes = CHECK_OFF_LOOP_BYTES
    threads["checker"] = PushChecker()
    try:
        from paramserver.server.group_commit import GroupCommit, LogWriter
    except ImportError:  # a shard that writes and fsyncs on its loop
        return threads
    threads["commit"] = GroupCommit(storage, LogWriter(storage))
    return threads


def _wait(threads: dict[str, Any]) -> bool:
    done = threads["checker"].wait(60.0)
    if "commit" in threads:
        done = threads["commit"].writer.wait(60.0) and done
    return done


def _close(threads: dict[str, Any]) -> None:
    if "checker" in threads:
        threads["checker"].close()
    if "commit" in threads:
        threads["commit"].writer.close()


def main(argv: list[str] | None = None) -> int:
    """Measure and print JSON.

    Args:
        argv: command line (None: sys.argv).

    Returns:
        0.
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=parse_count, default=64_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--zstd", choices=("both", "on", "off"), default="both")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.zstd]
    with tempfile.TemporaryDirectory(prefix="accept-cost-") as tmp:
        out = args.out or Path(tmp)
        runs = [measure(args.params, args.repeats, z, out) for z in modes]
    result = {"params": args.params, "runs": runs, "load_avg_1m": os.getloadavg()[0]}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
