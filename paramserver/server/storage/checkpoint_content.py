"""What a shard checkpoint holds: a shard state <-> (msgpack-ready meta, named arrays).

This module owns the content of a checkpoint (`export_state` / `restore_state`);
the file format is `paramserver.server.storage.checkpoint_file`. The island
registry is not included (islands say hello again after a restart). Pending
deltas are stored as they are kept, coded (`codec.coded.CodedTensor`: codes
and scales, topk entries or raw values, with their clip factor), not decoded.

`export_state` copies nothing big: its meta map is built fresh, but its
arrays are the live ones (numpy views of params, optimizer state and the
downlink residual, which a step may change in place; `live_fragment` names
the fragment whose step does) and the pending deltas as accepted (never
changed). Whoever keeps them past the next step copies them first
(`paramserver.server.storage.checkpoint_job`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from codec.coded import CodedTensor, from_array
from paramserver.server.admission.outcomes import ShardCounters
from paramserver.server.config import ShardConfig
from paramserver.server.events import Contribution, StateError
from paramserver.server.fragment import DedupEntry, FragmentState
from paramserver.server.state import ShardState
from paramserver.server.step.downlink import restore_residual
from paramserver.server.step.fragment_step import host_state, host_vector
from paramserver.server.step.policy import ArrivalStats
from paramserver.wire.plan import Plan


def export_state(state: ShardState) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Everything durable of a shard state, as a msgpack-ready map plus named arrays.

    Args:
        state: the shard's state.

    Returns:
        (meta, arrays) of a checkpoint; `restore_state` inverts it. The island registry
        is not included (islands say hello again after a restart). The arrays
        named by `live_fragment` are views of the live state: copy them before
        that fragment's next step if they must outlive it.
    """
    arrays: dict[str, np.ndarray] = {}
    frags = []
    for index, frag in sorted(state.fragments.items()):
        arrays[f"params/{index}"] = np.asarray(frag.params)
        if frag.residual is not None:  # bfloat16, stored as its bits
            arrays[f"residual/{index}"] = frag.residual.view(np.uint16)
        # the leaves in the order of FragmentOptimizer.state_to_arrays, without its copies
        opt = [np.asarray(leaf) for leaf in jax.tree.leaves(frag.opt_state)]
        for k, arr in enumerate(opt):
            arrays[f"opt/{index}/{k}"] = arr
        pending = []
        for j, c in enumerate(frag.pending):
            coding = _export_coded(c.delta, f"pending/{index}/{j}", arrays)
            pending.append(
                [c.island, c.round, c.base_version, c.tokens, c.steps, c.arrived, coding, c.clip]
            )
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


def checkpoint_summary(meta: Mapping[str, Any]) -> dict[str, Any]:
    """What status says of a checkpoint, from its meta map.

    Args:
        meta: `export_state`'s map (with "taken_at", wall-clock seconds, once
            the data dir added it; older checkpoints have none).

    Returns:
        {"step": outer steps of the shard, "versions": {fragment: version} (str
        keys), "time": when the state was captured or None}.
    """
    return {
        "step": meta["counters"]["steps"],
        "versions": {str(f["index"]): f["version"] for f in meta["fragments"]},
        "time": meta.get("taken_at"),
    }


def live_fragment(name: str) -> int | None:
    """The fragment whose outer step may change an exported array in place.

    Args:
        name: an array name of `export_state`.

    Returns:
        The fragment index for params, optimizer state and residual; None for
        the pending deltas (kept as accepted, never changed).
    """
    kind, _, rest = name.partition("/")
    if kind in ("params", "residual", "opt"):
        return int(rest.partition("/")[0])
    return None


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
            for j, (island, rnd, base, tokens, steps, arrived, *coding) in enumerate(f["pending"]):
                delta = _restore_coded(coding, f"pending/{i}/{j}", arrays)
                clip = float(coding[1]) if coding else 1.0
                frag.pending.append(
                    Contribution(island, rnd, i, base, tokens, steps, arrived, delta, clip)
                )
            state.fragments[i] = frag
        for island, fragment, newest, rounds in meta["dedup"]:
            state.dedup[(island, fragment)] = DedupEntry(newest, set(rounds))
        c = meta["counters"]
        state.counters = ShardCounters(
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


def _export_coded(delta: CodedTensor, name: str, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """Store a coded pending delta's arrays under `name`; its description for the meta."""
    arrays[f"{name}/codes"] = delta.codes
    arrays[f"{name}/scales"] = delta.scales
    return {"scheme": delta.scheme, "block": delta.block, "dtype": delta.dtype,
            "shape": list(delta.shape)}  # fmt: skip


def _restore_coded(coding: list, name: str, arrays: Mapping[str, np.ndarray]) -> CodedTensor:
    """The coded pending delta `_export_coded` stored (a float32 array in older checkpoints)."""
    # copies: the arrays read back are views of the whole checkpoint file's buffer
    if not coding:
        return from_array(np.array(arrays[name], dtype=np.float32))
    d = coding[0]
    codes, scales = np.array(arrays[f"{name}/codes"]), np.array(arrays[f"{name}/scales"])
    shape = tuple(int(n) for n in d["shape"])
    return CodedTensor(("delta",), shape, d["dtype"], d["scheme"], int(d["block"]), codes, scales)
