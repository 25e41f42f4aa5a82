"""What a shard checkpoint holds: a shard state <-> (msgpack-ready meta, named arrays).

This module owns the content of a checkpoint (`export_state` / `restore_state`);
the file format is `paramserver.server.storage.checkpoint_file`. The island
registry is not included (islands say hello again after a restart).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from paramserver.server.chunked_step import host_state, host_vector
from paramserver.server.config import ShardConfig
from paramserver.server.counters import Counters
from paramserver.server.downlink import restore_residual
from paramserver.server.events import Contribution, StateError
from paramserver.server.fragment import DedupEntry, FragmentState
from paramserver.server.policy import ArrivalStats
from paramserver.server.state import ShardState
from paramserver.wire.plan import Plan


def export_state(state: ShardState) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Everything durable of a shard state, as a msgpack-ready map plus named arrays.

    Args:
        state: the shard's state.

    Returns:
        (meta, arrays) of a checkpoint; `restore_state` inverts it. The island registry
        is not included (islands say hello again after a restart).
    """
    arrays: dict[str, np.ndarray] = {}
    frags = []
    for index, frag in sorted(state.fragments.items()):
        arrays[f"params/{index}"] = np.asarray(frag.params)
        if frag.residual is not None:  # bfloat16, stored as its bits
            arrays[f"residual/{index}"] = frag.residual.view(np.uint16)
        opt = state.optimizer.state_to_arrays(frag.opt_state)
        for k, arr in enumerate(opt):
            arrays[f"opt/{index}/{k}"] = arr
        pending = []
        for j, c in enumerate(frag.pending):
            arrays[f"pending/{index}/{j}"] = c.delta
            pending.append([c.island, c.round, c.base_version, c.tokens, c.steps, c.arrived])
        st = frag.stats
        frags.append(
            {
                "index": index,
                "version": frag.version,
                "opt_arrays": len(opt),
                "stats": [st.ema_interarrival_s, st.last_arrival, st.count],
                "pending": pending,
                "norms": list(frag.norms),
            }
        )
    c = state.counters
    meta = {
        "shard": state.index,
        "shards": state.cfg.shards,
        "num_fragments": state.cfg.num_fragments,
        "outer_optimizer": state.cfg.outer_optimizer,
        "plan": state.plan.to_wire() if state.plan else None,
        "fragments": frags,
        "dedup": [
            [island, fragment, e.newest, sorted(e.rounds)]
            for (island, fragment), e in sorted(state.dedup.items())
        ],
        "counters": {
            "accepted": c.accepted,
            "duplicates": c.duplicates,
            "rejected": dict(c.rejected),
            "hello_requests": c.hello_requests,
            "bytes_in": c.bytes_in,
            "bytes_out": c.bytes_out,
            "staleness": [[k, v] for k, v in sorted(c.staleness.items())],
            "steps": c.steps,
            "clipped": c.clipped,
            "credited": dict(c.credited),
        },
    }
    return meta, arrays


def restore_state(
    cfg: ShardConfig,
    index: int,
    meta: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
    timer: Callable[[], float] | None = None,
) -> ShardState:
    """Rebuild a shard state from `export_state` output.

    Args:
        cfg: the settings to run with (must match the checkpoint's cluster shape).
        index: this shard's index.
        meta: the exported map.
        arrays: the exported arrays.
        timer: the restored state's step timer (see ShardState).

    Returns:
        The restored state.

    Raises:
        StateError: the checkpoint belongs to another shard or cluster shape,
            or is inconsistent.
    """
    state = ShardState(cfg, index, timer)
    got = (meta.get("shard"), meta.get("shards"), meta.get("num_fragments"))
    want = (index, cfg.shards, cfg.num_fragments)
    if got != want:
        raise StateError(
            f"checkpoint is for shard/shards/fragments {got}, this process runs {want}: "
            "point data_dir at this cluster's directory or start with an empty one"
        )
    try:
        if meta["plan"] is not None:
            state.plan = Plan.from_wire(meta["plan"])
        for f in meta["fragments"]:
            i = f["index"]
            params = np.asarray(arrays[f"params/{i}"], dtype=np.float32)
            opt_arrays = [arrays[f"opt/{i}/{k}"] for k in range(f["opt_arrays"])]
            opt_state = host_state(state.optimizer.state_from_arrays(opt_arrays, params))
            frag = FragmentState(host_vector(params), opt_state)
            if f"residual/{i}" in arrays:
                frag.residual = restore_residual(arrays[f"residual/{i}"])
            frag.version = int(f["version"])
            frag.norms = [float(n) for n in f.get("norms", [])]
            ema, last, count = f["stats"]
            frag.stats = ArrivalStats(ema, last, int(count))
            for j, (island, rnd, base, tokens, steps, arrived) in enumerate(f["pending"]):
                frag.pending.append(
                    Contribution(
                        island, rnd, i, base, tokens, steps, arrived, arrays[f"pending/{i}/{j}"]
                    )
                )
            state.fragments[i] = frag
        for island, fragment, newest, rounds in meta["dedup"]:
            state.dedup[(island, fragment)] = DedupEntry(newest, set(rounds))
        c = meta["counters"]
        state.counters = Counters(
            accepted=c["accepted"],
            duplicates=c["duplicates"],
            rejected=dict(c["rejected"]),
            hello_requests=c.get("hello_requests", 0),
            bytes_in=c["bytes_in"],
            bytes_out=c["bytes_out"],
            staleness={int(k): v for k, v in c["staleness"]},
            steps=c["steps"],
            clipped=c.get("clipped", 0),
            credited={str(k): float(v) for k, v in c.get("credited", {}).items()},
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise StateError(f"inconsistent checkpoint: {exc!r}") from exc
    return state
