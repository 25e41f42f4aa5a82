"""`worker.global_model` and `diloco-worker export`: the final global model, out of the shards.

Real shards in threads of this process on 127.0.0.1 (`conftest.Cluster`), a real
island (`worker.join`) training a plain-JAX MLP held as a dict of NamedTuples,
the export command as a real subprocess, and the checkpoint read back with the
`orbax.checkpoint` API alone.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import mlp_helpers as mlp
import numpy as np
import pytest
from conftest import Cluster, free_port

import worker
from paramserver.plumbing import probe
from worker import cli
from worker.global_read import GlobalModelError
from worker.param_tree import TreeError, leaf_name

pytestmark = pytest.mark.timeout(120)
FAST = {"heartbeat_interval_s": 0.2, "join_timeout_s": 20.0, "flush_timeout_s": 5.0}
CLI = [sys.executable, "-m", "worker.cli"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-shard cluster after one island trained a few rounds and closed (flushed).

    The tests only read it, so one cluster serves the module; it stops at the end.
    """
    cluster = Cluster(tmp_path_factory.mktemp("cluster"), shards=2, mode="async")
    try:
        init = mlp.init_mlp(0)
        with worker.join(cluster.connect, island="a", params=init, inner_steps=5, **FAST) as s:
            params, opt_state = s.params, mlp.OPTIMIZER.init(init)
            rng = np.random.default_rng(1)
            for _ in range(25):
                x, y = mlp.batch(rng)
                params, opt_state, _loss = mlp.train_step(params, opt_state, x, y)
                params = s.step(params, tokens=mlp.BATCH)
        yield cluster, init
    finally:
        cluster.stop()


def _leaves_by_name(tree) -> dict[str, np.ndarray]:
    pairs, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {leaf_name(path): np.asarray(leaf) for path, leaf in pairs}


def _bitwise_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> bool:
    return sorted(got) == sorted(want) and all(
        got[k].dtype == want[k].dtype
        and got[k].shape == want[k].shape
        and got[k].tobytes() == want[k].tobytes()
        for k in want
    )


def test_global_model_returns_the_users_tree_equal_to_the_shards_bit_for_bit(trained):
    cluster, init = trained
    params, version = worker.global_model(cluster.connect, like=init)
    _plan, snapshot, versions = probe.global_params(cluster.connect)
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(init)
    assert isinstance(params["layers"][0], mlp.Layer)  # the user's NamedTuple, not a dict
    for got, like in zip(jax.tree.leaves(params), jax.tree.leaves(init), strict=True):
        assert isinstance(got, jax.Array) and got.sharding == like.sharding
        assert got.dtype == like.dtype
    assert _bitwise_equal(_leaves_by_name(params), snapshot)
    assert version == sum(versions.values()) > 0
    assert not _bitwise_equal(_leaves_by_name(params), _leaves_by_name(init))  # it trained
    live = [s["islands_live"] for s in probe.cluster_status(cluster.connect)["shards"]]
    assert {i for ids in live for i in ids} <= {"a"}, live  # the read joined no island


def test_numpy_leaves_come_back_as_numpy_and_a_foreign_tree_names_its_leaf(trained):
    cluster, init = trained
    host = jax.tree.map(np.asarray, init)
    params, _version = worker.global_model(cluster.connect, like=host, wait_merged=False)
    assert all(type(leaf) is np.ndarray for leaf in jax.tree.leaves(params))
    other = {**init, "head": np.zeros((3, 2), np.float32)}
    with pytest.raises(TreeError, match="leaf 'head' is not in the cluster's model"):
        worker.global_model(cluster.connect, like=other)


def test_export_writes_a_checkpoint_that_plain_orbax_restores_bit_for_bit(
    trained, tmp_path, capsys
):
    ocp = pytest.importorskip("orbax.checkpoint")
    cluster, _init = trained
    out = tmp_path / "exported"
    # the command's main in this process (orbax and JAX are imported once); its
    # refusals and errors are checked through a real subprocess below
    assert cli.main(["export", "--connect", cluster.connect, "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    _plan, snapshot, versions = probe.global_params(cluster.connect)
    assert summary["version_sum"] == sum(versions.values())
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(out)
    flat = {
        "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]
    }
    assert _bitwise_equal(flat, snapshot)
    again = subprocess.run(
        [*CLI, "export", "--connect", cluster.connect, "--out", str(out)],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert again.returncode == 1 and "exists" in again.stderr  # never overwrites


def test_a_server_that_is_down_is_one_line_naming_the_endpoint(tmp_path):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(GlobalModelError) as caught:
        worker.global_model(endpoint, like=mlp.init_mlp(0), wait_s=5.0)
    assert caught.value.connect == endpoint
    assert "\n" not in str(caught.value) and endpoint in str(caught.value)
    proc = subprocess.run(
        [*CLI, "export", "--connect", endpoint, "--out", str(tmp_path / "never")],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and endpoint in lines[0], proc.stderr
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize(
    "endpoint, why",
    [("localhost:5555", "the scheme must be tcp"), ("tcp://127.0.0.1:notaport", "not a number")],
)
def test_a_malformed_endpoint_is_refused_before_connecting(endpoint, why, tmp_path, capsys):
    with pytest.raises(ValueError, match=why):
        worker.global_model(endpoint, like=mlp.init_mlp(0))
    assert cli.main(["export", "--connect", endpoint, "--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and endpoint in err and why in err, err
    assert not (tmp_path / "never").exists()
