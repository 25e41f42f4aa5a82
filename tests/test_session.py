"""The public island API (`worker.join`, `Session`) with a model that is not ours: a plain-JAX MLP.

Real shards in threads (`client_helpers.Cluster`), real sockets on 127.0.0.1.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import mlp_helpers as mlp
import numpy as np
import pytest
from conftest import Cluster

import worker
from paramserver.client import ClientError
from paramserver.plumbing import probe
from worker import island_files, outbox
from worker.config import IslandConfigError

pytestmark = pytest.mark.timeout(60)
FAST = {"heartbeat_interval_s": 0.2, "join_timeout_s": 20.0, "flush_timeout_s": 5.0}


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path, shards=2, mode="async")
    yield c
    c.stop()


def train(session, params, steps: int, seed: int):
    """The user's loop: optax on the MLP, `session.step` after every step."""
    rng = np.random.default_rng(seed)
    opt_state = mlp.OPTIMIZER.init(params)
    for _ in range(steps):
        x, y = mlp.batch(rng)
        params, opt_state, _loss = mlp.train_step(params, opt_state, x, y)
        params = session.step(params, tokens=mlp.BATCH)
    return params


def cluster_params(connect: str) -> dict[str, np.ndarray]:
    _plan, flat, _versions = probe.global_params(connect)
    return flat


@pytest.mark.timeout(60)
def test_two_threaded_islands_train_an_mlp_and_a_later_session_starts_from_the_global_model(
    cluster, tmp_path
):
    init = mlp.init_mlp(0)
    initial = mlp.heldout_loss(init)
    errors: list[BaseException] = []

    def island(name: str, seed: int) -> None:
        try:
            with worker.join(
                cluster.connect,
                island=name,
                params=init,
                inner_steps=10,
                data_dir=tmp_path / name,
                **FAST,
            ) as session:
                train(session, session.params, 150, seed)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=island, args=(n, s)) for n, s in (("a", 1), ("b", 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(200)
    assert not errors, errors
    flat = cluster_params(cluster.connect)
    with worker.join(cluster.connect, island="late", params=init, inner_steps=10, **FAST) as late:
        start = late.params
        assert type(start) is dict and isinstance(start["layers"][0], mlp.Layer)
        assert isinstance(start["layers"][0].w, jax.Array)
        np.testing.assert_array_equal(np.asarray(start["layers"][1].w), flat["layers/1/w"])
        assert late.version > 0
    final = mlp.heldout_loss(start)
    assert final < initial / 2, (initial, final)
    rows = island_files.read_rows(tmp_path / "a")
    assert [r["round"] for r in rows if not r.get("final")] == list(range(1, 16))
    # the final row carries the client's counters (acks may all come after close when the
    # in-thread shards compile their first step: an island then pushes once and carries on)
    assert rows[-1]["final"] and rows[-1]["steps"] == 150 and rows[-1]["pushes"] > 0


def test_a_step_that_neither_pushes_nor_folds_touches_no_parameter(cluster):
    params = mlp.init_mlp(0)
    with worker.join(cluster.connect, island="a", params=params, inner_steps=3, **FAST) as s:
        live = s.params
        gone = jax.tree_util.tree_map(lambda x: x + 0, live)
        for leaf in jax.tree_util.tree_leaves(gone):
            leaf.delete()  # reading it now (a host copy) would raise
        assert s.step(gone, tokens=5) is gone
        assert s.step(gone, tokens=5) is gone
        with pytest.raises(RuntimeError, match="deleted"):
            s.step(gone, tokens=5)  # the round's end: its push reads the parameters
        out = s.step(live, tokens=5)
        assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(live)


def test_session_params_keep_the_layout_of_the_params_passed_in(cluster):
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.asarray(devices), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    params = {"w": jax.device_put(jnp.ones((4, 2), jnp.float32), sharding), "b": np.zeros(3)}
    with worker.join(cluster.connect, island="a", params=params, inner_steps=2, **FAST) as s:
        assert s.params["w"].sharding == sharding
        assert isinstance(s.params["b"], np.ndarray) and s.params["b"].dtype == np.float64


# -- bad input: one clear error each, the server unaffected ---------------------------


def test_bad_trees_are_refused_with_the_path(cluster):
    counter = {"w": np.ones(3, np.float32), "step": np.int32(0)}
    with pytest.raises(ValueError, match=r"'step' has dtype int32.*only floating"):
        worker.join(cluster.connect, island="a", params=counter, inner_steps=1)
    scalar = {"w": np.ones(3, np.float32), "lr": 0.1}
    with pytest.raises(ValueError, match=r"'lr' is a float, not an array"):
        worker.join(cluster.connect, island="a", params=scalar, inner_steps=1)
    with pytest.raises(ValueError, match="no array leaves"):
        worker.join(cluster.connect, island="a", params={}, inner_steps=1)


@pytest.mark.parametrize("inner_steps", [0, -3, 1.5, True])
def test_inner_steps_below_one_is_refused(cluster, inner_steps):
    with pytest.raises(ValueError, match="inner_steps must be an int >= 1"):
        worker.join(cluster.connect, island="a", params=mlp.init_mlp(), inner_steps=inner_steps)


def test_settings_go_through_island_config_and_daemon_options_are_refused(cluster):
    params = mlp.init_mlp()
    with pytest.raises(IslandConfigError, match="codec"):
        worker.join(cluster.connect, island="a", params=params, inner_steps=1, codec="zip")
    with pytest.raises(ValueError, match="'model' is the island daemon's"):
        worker.join(cluster.connect, island="a", params=params, inner_steps=1, model="tiny")
    with pytest.raises(ValueError, match="unknown setting 'codecs'"):
        worker.join(cluster.connect, island="a", params=params, inner_steps=1, codecs="int8")


def test_step_refuses_bad_tokens_another_tree_and_a_closed_session(cluster):
    params = mlp.init_mlp(0)
    s = worker.join(cluster.connect, island="a", params=params, inner_steps=5, **FAST)
    p = s.params
    for tokens in (-1, 0, 2.0, "8", True):
        with pytest.raises(ValueError, match="tokens must be an int >= 1"):
            s.step(p, tokens=tokens)
    wrong_shape = {"layers": [p["layers"][0], mlp.Layer(p["layers"][1].w[:, :2], p["layers"][1].b)]}
    with pytest.raises(ValueError, match=r"'layers/1/w' is float32\[32, 2\], the session's"):
        s.step(wrong_shape, tokens=1)
    with pytest.raises(ValueError, match="differs from the session's at 'layers/1/b'"):
        s.step({"layers": [p["layers"][0], {"w": p["layers"][1].w}]}, tokens=1)
    assert s.steps == 0  # refused calls count nothing
    s.close()
    with pytest.raises(RuntimeError, match="step\\(\\) after close"):
        s.step(p, tokens=1)


def test_a_model_that_differs_from_the_clusters_is_refused_naming_the_leaf(cluster):
    params = mlp.init_mlp(0)
    with worker.join(cluster.connect, island="a", params=params, inner_steps=2, **FAST) as s:
        train(s, s.params, 4, 0)
    other = {"layers": [params["layers"][0], mlp.Layer(jnp.zeros((32, 5)), jnp.zeros(5))]}
    with pytest.raises(ClientError, match=r"leaf 'layers/1/b' is float32\[5\] here, float32\[4\]"):
        worker.join(cluster.connect, island="b", params=other, inner_steps=2, **FAST)
    half = jax.tree_util.tree_map(lambda x: x.astype(jnp.float16), params)
    with pytest.raises(ClientError, match=r"float16\[32\] here, float32\[32\] in the cluster"):
        worker.join(cluster.connect, island="c", params=half, inner_steps=2, **FAST)
    before = cluster_params(cluster.connect)
    with worker.join(cluster.connect, island="d", params=params, inner_steps=2, **FAST) as s:
        train(s, s.params, 4, 1)  # the cluster still serves the right model
    row = s.last_row  # 2 rounds: a push a fragment each, unless round 2 rode on round 1's
    assert row["final"] and len(s.sizes) <= row["acked"] == row["pushes"] <= 2 * len(s.sizes)
    assert not np.array_equal(before["layers/0/w"], cluster_params(cluster.connect)["layers/0/w"])


def test_a_server_that_is_down_at_join_is_one_line_after_the_join_timeout():
    from conftest import free_port

    connect = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(ClientError) as err:
        worker.join(connect, island="a", params=mlp.init_mlp(), inner_steps=1, join_timeout_s=1.0)
    assert "\n" not in str(err.value) and connect in str(err.value)
    # the island id is free again
    with pytest.raises(ClientError):
        worker.join(connect, island="a", params=mlp.init_mlp(), inner_steps=1, join_timeout_s=0.5)


def test_two_sessions_with_one_island_id_in_one_process_are_refused(cluster):
    params = mlp.init_mlp()
    first = worker.join(cluster.connect, island="a", params=params, inner_steps=1, **FAST)
    with pytest.raises(RuntimeError, match="'a' already has an open session"):
        worker.join(cluster.connect, island="a", params=params, inner_steps=1, **FAST)
    first.close()
    with worker.join(cluster.connect, island="a", params=params, inner_steps=1, **FAST) as s:
        assert s.version == 0  # closed sessions free their id


def test_in_a_sync_cluster_the_rounds_last_step_returns_the_merged_round(tmp_path):
    sync = Cluster(tmp_path / "sync", shards=2, mode="sync")
    try:
        params = mlp.init_mlp(0)
        with worker.join(sync.connect, island="a", params=params, inner_steps=3, **FAST) as s:
            p = s.params
            fragments = len(s.sizes)
            assert s.step(p, tokens=1) is p and s.step(p, tokens=1) is p
            moved = jax.tree_util.tree_map(lambda x: x - 0.5, p)
            merged = s.step(moved, tokens=1)  # pushes, then waits for the merge
            assert s.version == fragments  # every fragment's round-1 version is in
            assert s.stats["pushes"] == fragments
            assert s.stats["bytes_sent"] >= 4 * sum(s.sizes)  # the float32 init it uploaded
            assert s.round == 1 and s.goodput is not None and s.goodput >= 0.0
            assert merged is not moved
            assert not np.array_equal(
                np.asarray(merged["layers"][0].w), np.asarray(p["layers"][0].w)
            )
    finally:
        sync.stop()


def test_unacked_deltas_are_kept_in_the_data_dir_and_sent_by_the_next_session(cluster, tmp_path):
    params = mlp.init_mlp(0)
    data_dir = tmp_path / "island"
    s = worker.join(cluster.connect, island="a", params=params, inner_steps=2, data_dir=data_dir,
                    **{**FAST, "flush_timeout_s": 0.5})  # fmt: skip
    p = s.params
    before = cluster_params(cluster.connect)
    cluster.stop()  # the server goes away before the round is pushed
    moved = jax.tree_util.tree_map(lambda x: x - 0.25, p)
    s.step(moved, tokens=1)
    s.step(moved, tokens=1)
    s.close()
    saved = outbox.load(data_dir / outbox.OUTBOX_FILE)
    assert saved is not None and saved.island == "a" and len(saved.deltas) == len(s.sizes)
    for i in range(len(cluster.servers)):
        cluster.start(i)  # same ports, same data dir
    with worker.join(cluster.connect, island="a", params=params, inner_steps=2, data_dir=data_dir,
                     **FAST) as again:  # fmt: skip
        assert again.resending == len(saved.deltas)
        q = again.params
        again.step(q, tokens=1)
        again.step(q, tokens=1)  # the first new push waits until the re-sent ones are resolved
        assert again.wait_pushed(30.0)  # (on the push thread: the step itself returned)
        kept = {(d.round, d.fragment) for d in saved.deltas}
        assert again.outbox is not None and not kept & set(again.outbox.live)  # resolved
    assert not (data_dir / outbox.OUTBOX_FILE).exists()  # nothing unacked at close
    after = cluster_params(cluster.connect)
    assert not np.array_equal(before["layers/0/w"], after["layers/0/w"])  # the kept round landed
