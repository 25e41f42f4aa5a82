"""A session's exchange on the device trains exactly as the host exchange (real shards).

One island in a sync cluster with the int8 downlink is deterministic: every
round pushes, waits for its merge and folds the published increments. Run
once with ``exchange="device"`` and once with ``exchange="host"`` on fresh
clusters, the pushed frames are byte for byte the same in every round and so
are the parameters; the device run moves a fraction of the host run's bytes
between host and device.
"""

from __future__ import annotations

import gc
import threading
import tracemalloc

import jax
import jax.numpy as jnp
import mlp_helpers as mlp
import numpy as np
import pytest
from client_helpers import RecordingClient
from conftest import Cluster

import codec
from paramserver.plumbing import probe
from worker.config import IslandConfigError
from worker.device_exchange import DeviceExchange
from worker.host_exchange import HostExchange
from worker.session import Session
from worker.session_config import session_config

pytestmark = pytest.mark.timeout(120)
FAST = {"heartbeat_interval_s": 0.2, "join_timeout_s": 20.0, "flush_timeout_s": 5.0}
ROUNDS, INNER = 4, 3


def _wide_mlp(hidden: int = 1024) -> dict:
    """The helpers' MLP, wider: fragments of thousands of elements (as real models have), so
    the per-fragment padding of the last block does not dominate the bytes per parameter."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {
        "layers": [
            mlp.Layer(jax.random.normal(k1, (mlp.IN, hidden)) / np.sqrt(mlp.IN), jnp.zeros(hidden)),
            mlp.Layer(
                jax.random.normal(k2, (hidden, mlp.OUT)) / np.sqrt(hidden), jnp.zeros(mlp.OUT)
            ),
        ]
    }


def _recording(kind: type[RecordingClient] = RecordingClient):
    """A client factory for `Session` and the list of the clients it made."""
    clients: list = []

    def factory(cfg):
        clients.append(kind(cfg))
        return clients[-1]

    return clients, factory


def _run(tmp_path, exchange: str, codec: str):
    cluster = Cluster(tmp_path / exchange, shards=2, mode="sync", downlink="int8")
    clients, factory = _recording()
    try:
        cfg = session_config(
            cluster.connect, "a", INNER, None, {"exchange": exchange, "codec": codec, **FAST}
        )
        session = Session(cfg, _wide_mlp(), client_factory=factory)
        with session:
            joined = session.stats["host_device_bytes"]
            params, opt_state = session.params, mlp.OPTIMIZER.init(session.params)
            rng = np.random.default_rng(5)
            for step in range(ROUNDS * INNER):
                if step == INNER:  # after the first round (compiled): what later rounds keep
                    tracemalloc.start(25)
                x, y = mlp.batch(rng)
                params, opt_state, _ = mlp.train_step(params, opt_state, x, y)
                params = session.step(params, tokens=mlp.BATCH)
            # what the client keeps, not what a fold still running holds: its inputs (the
            # client's codes, handed to the call as they are) until it ends
            session.exchange.wait()
            held = _client_held_bytes()
            tracemalloc.stop()
            moved = session.stats["host_device_bytes"] - joined
            kind, elements = type(session.exchange), sum(session.sizes)
            assert session.stats["exchange_s"] > 0
            assert session.version == ROUNDS * len(session.sizes)  # sync: the last round folded
            # the global values the session adopted are the shards' snapshot, bit for bit
            _, flat, versions = probe.global_params(cluster.connect)
            assert sum(versions.values()) == session.version
            mine = jax.tree_util.tree_leaves(session.global_params())
            theirs = jax.tree_util.tree_leaves(session.layout.build(flat, place=False))
            assert all(a.tobytes() == b.tobytes() for a, b in zip(mine, theirs, strict=True))
            # the device exchange's client keeps no float32 copy; the host's, a replica
            keep, model_bytes = clients[0].cfg.keep, 4 * elements
            assert keep == ("increments" if exchange == "device" else "values")
            assert held < model_bytes / 4 if exchange == "device" else held >= model_bytes, held
    finally:
        tracemalloc.stop()
        cluster.stop()
    leaves = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(params)]
    pushed = [
        (p.fragment, p.round - clients[0].pushes[0].round, p.frames) for p in clients[0].pushes
    ]
    return kind, pushed, leaves, moved / ROUNDS / elements


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_the_device_exchange_pushes_the_host_exchanges_frames_and_trains_the_same(tmp_path, codec):
    dev_kind, dev_pushed, dev_params, dev_bytes = _run(tmp_path, "device", codec)
    host_kind, host_pushed, host_params, host_bytes = _run(tmp_path, "host", codec)
    assert (dev_kind, host_kind) == (DeviceExchange, HostExchange)
    assert len(dev_pushed) == len(host_pushed) > ROUNDS
    assert dev_pushed == host_pushed  # every round's frames, byte for byte
    assert all(np.array_equal(a, b) for a, b in zip(dev_params, host_params, strict=True))
    # per round and parameter: codes down and up (about 2 B at int8) against a host copy,
    # a fold on it and the whole tree placed back (12 B)
    assert dev_bytes <= 2.5 and host_bytes >= 8, (dev_bytes, host_bytes)


def test_a_codec_the_device_does_not_quantize_falls_back_to_the_host(tmp_path):
    cluster = Cluster(tmp_path, shards=1, mode="async")
    try:
        cfg = session_config(cluster.connect, "a", 2, None, {"codec": "topk", **FAST})
        with Session(cfg, mlp.init_mlp(0)) as session:
            assert isinstance(session.exchange, HostExchange)
    finally:
        cluster.stop()


def test_an_unknown_exchange_is_refused_naming_the_choices():
    with pytest.raises(IslandConfigError, match="exchange.*'gpu'.*device.*host"):
        session_config("tcp://127.0.0.1:5555", "a", 2, None, {"exchange": "gpu"})


def _client_held_bytes() -> int:
    """Bytes allocated under `paramserver.client` (any frame of the traceback) and still held."""
    held = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, "*/paramserver/client/*", all_frames=True)]
    )
    return sum(trace.size for trace in held.traces)


class RefusingClient(RecordingClient):
    """A real client that also reports `refuse` (then empties it) as finally refused."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.refuse: list[tuple[int, int, list]] = []

    def take_refused(self):
        refused, self.refuse = super().take_refused() + self.refuse, []
        return refused


def _codec_bytes() -> int:
    """Bytes traced since `tracemalloc.start` still live, allocated in the codec's code."""
    gc.collect()
    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*/codec/*")])
    return sum(stat.size for stat in snap.statistics("filename"))


def test_after_warm_up_an_islands_first_refused_push_takes_no_memory_for_good(tmp_path):
    # issue 37: the codec's per-thread scratch was taken by the first refused push's
    # decode, mid-run, a step in the island's memory; `warm_up` takes it first
    cluster = Cluster(tmp_path, shards=2, mode="sync", downlink="int8")
    clients, factory = _recording(RefusingClient)
    try:
        cfg = session_config(
            cluster.connect, "a", INNER, None, {"exchange": "device", "codec": "int8", **FAST}
        )
        with Session(cfg, mlp.init_mlp(0), client_factory=factory) as session:
            session.mark_start()  # warms up, on the thread that steps (as the daemon does)
            params, opt_state = session.params, mlp.OPTIMIZER.init(session.params)
            rng = np.random.default_rng(5)

            def rounds(count: int) -> None:
                nonlocal params, opt_state
                for _ in range(count * INNER):
                    x, y = mlp.batch(rng)
                    params, opt_state, _ = mlp.train_step(params, opt_state, x, y)
                    params = session.step(params, tokens=mlp.BATCH)

            rounds(2)
            largest = max(range(len(session.sizes)), key=session.sizes.__getitem__)
            pushed = [p for p in clients[0].pushes if p.fragment == largest][-1]
            tracemalloc.start()
            clients[0].refuse = [(largest, pushed.round, pushed.frames)]
            rounds(1)
            assert clients[0].refuse == []  # the session took it: decoded and refunded
            session.exchange.wait()
            after_refusal = _codec_bytes()

            # the control, where the figure falls: the same decode on a thread that never
            # decoded keeps that thread's scratch
            def decode_once(out: list) -> None:
                codec.decode(pushed.frames)
                out.append(_codec_bytes())

            seen: list[int] = []
            thread = threading.Thread(target=decode_once, args=(seen,))
            thread.start()
            thread.join(timeout=60)
            assert seen, "the control thread did not finish"
            assert after_refusal < 64 << 10, after_refusal
            assert seen[0] - after_refusal >= 1 << 20, (seen[0], after_refusal)
    finally:
        tracemalloc.stop()
        cluster.stop()
